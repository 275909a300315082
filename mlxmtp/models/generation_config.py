"""The sampling a model's authors recommend: its `generation_config.json`.

Qwen3.5 / 3.6 ship `do_sample: true` with a temperature, top_p and top_k, and their cards
warn that greedy decoding can repeat itself endlessly. The server uses these for a request
that leaves a field unset, as vLLM and transformers do; `do_sample: false` (the demo model)
or no file means greedy, as mlx-lm's server decodes by default.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Optional

log = logging.getLogger("mlxmtp.models")

# Each field and the values a request may give it (as the APIs check them).
_VALID = {
    "temperature": lambda v: v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "top_k": lambda v: v >= 0 and float(v).is_integer(),
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: v > 0,
}


def recommended_sampling(model_dir: Optional[Path]) -> dict:
    """{field: value} for the sampling fields the model's generation_config sets (temperature
    1.0 when it samples and names none, as transformers reads it); {}: greedy."""
    path = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s unreadable (%s): requests without sampling fields decode greedily", path, e)
        return {}
    if not isinstance(config, dict) or config.get("do_sample") is not True:
        return {}
    out = {"temperature": 1.0}
    for name, valid in _VALID.items():
        value = config.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and valid(value):
            out[name] = int(value) if name == "top_k" else float(value)
    return out
