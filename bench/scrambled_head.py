"""A head that does not work: what the adaptive depth policy costs when no draft is kept.

Some quantized conversions carry an MTP head whose drafts are never kept (a mis-scaled
or mis-shifted head gives 0% acceptance). The policy must notice and fall back to plain
decoding within its first cycles, so that such a model runs as fast as with MTP off.
This copies the demo model to a temporary folder with every matrix of its head replaced
by noise of the same scale, then runs fresh `mlxmtp generate` processes alternating MTP
off and adaptive (bench/cold_start.py), greedy and sampled.

    python bench/scrambled_head.py                  # 4 rounds, temperatures 0 and 0.6
    python bench/scrambled_head.py --rounds 6 --markdown
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cold_start  # noqa: E402

from mlxmtp.models.demo import demo_model_path  # noqa: E402


def scrambled_copy(folder: Path) -> Path:
    """The demo model in `folder`, its head's matrices replaced by noise of their scale."""
    dest = folder / "demo-scrambled-head"
    shutil.copytree(demo_model_path(), dest)
    weights = dest / "mtp" / "weights.safetensors"
    arrays = mx.load(str(weights))
    mx.random.seed(0)
    for name, a in arrays.items():
        if a.ndim == 2:  # projections; norms stay, as a broken conversion leaves them
            std = mx.sqrt(mx.mean(a.astype(mx.float32) ** 2))
            arrays[name] = (mx.random.normal(a.shape) * std).astype(a.dtype)
    mx.save_safetensors(str(weights), arrays)
    return dest


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--temps", default="0,0.6")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(scrambled_copy(Path(tmp)))
        print("| temperature | adaptive / MTP off: min | median | max | cycles drafting (of all) |")
        print("|---|---|---|---|---|")
        for temp in [float(t) for t in args.temps.split(",")]:
            run = argparse.Namespace(model=model, rounds=args.rounds, depths="", temp=temp,
                                     max_tokens=args.max_tokens, prompt=cold_start.PROMPT, timeout=900,
                                     baseline=None, head_alone=False)
            result = cold_start.measure(run)
            (_, lo, mid, hi, _), = cold_start.summary(result["rates"])
            hists = result["depths"]["adaptive"]
            drafting = sum(n for h in hists for k, n in h.items() if k != "0")
            total = sum(n for h in hists for n in h.values())
            print(f"| {temp} | {lo:.2f}x | {mid:.2f}x | {hi:.2f}x | {drafting} of {total} |")


if __name__ == "__main__":
    main()
