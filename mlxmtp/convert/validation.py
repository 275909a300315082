"""Refuse a source head that does not fit the target model, before anything is written."""

from __future__ import annotations

from typing import Iterator, List, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten

from ..checkpoint import hf_head, norm_convention
from ..checkpoint.tensor_files import TensorReader
from ..mlxlm.family import family_of, text_config, text_parts
from .plan import AddMTPError, Plan
from .target import cpu, head_skeleton

# Config fields that must agree between source and target (text config level).
_CONFIG_FIELDS = (
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "intermediate_size",
)




def validate(p: Plan, target) -> None:
    """Refuse anything that would give a head of another model; raises AddMTPError."""
    parts = text_parts(target)
    problems = _config_problems(p) + _architecture_problems(p, parts)
    if p.tensors and not problems:
        problems += _shape_problems(p, target, parts)
    if p.tensors and not problems:
        problems += _norm_problems(p, parts)
    if problems:
        raise AddMTPError("source head does not fit the target model, nothing written:\n  - "
                          + "\n  - ".join(problems))


def _config_problems(p: Plan) -> List[str]:
    """Source and target configs: same family, same sizes."""
    if not p.source_config:
        return []
    problems: List[str] = []
    try:
        src_family = family_of(p.source_config)
    except ValueError as e:
        src_family = None
        problems.append(f"source: {e}")
    if src_family and src_family != p.family:
        problems.append(f"source is a {src_family} checkpoint, target a {p.family} model")
    s, t = text_config(p.source_config), text_config(p.target_config)
    problems += [f"{k}: source {s[k]}, target {t[k]}" for k in _CONFIG_FIELDS
                 if k in s and k in t and s[k] != t[k]]
    return problems


def _architecture_problems(p: Plan, parts) -> List[str]:
    """The source against the loaded target: vocabulary, MoE or dense, expert count."""
    problems: List[str] = []
    args = parts.args
    vocab = parts.embed_tokens.weight.shape[0]
    src_vocab = text_config(p.source_config).get("vocab_size")
    if src_vocab is not None and src_vocab != vocab:
        problems.append(f"vocabulary: source {src_vocab}, target embedding has {vocab} rows")
    target_moe = int(getattr(args, "num_experts", 0) or 0) > 0
    if p.info["moe"] != target_moe:
        problems.append(f"source head is {'MoE' if p.info['moe'] else 'dense'}, target model "
                        f"{'MoE' if target_moe else 'dense'}")
    elif target_moe and p.info["num_experts"] and p.info["num_experts"] != args.num_experts:
        problems.append(f"expert count: source head has {p.info['num_experts']} experts, target model "
                        f"{args.num_experts} (a pruned model needs a head pruned the same way)")
    return problems


def _shape_problems(p: Plan, target, parts) -> List[str]:
    """Every head parameter present, of the shape and dtype the target's layers have."""
    problems: List[str] = []
    expected = {k: tuple(v.shape) for k, v in tree_flatten(head_skeleton(target, p.info).parameters())}
    got = {j.out: tuple(j.shape) for j in p.jobs}
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing:
        problems.append(f"source head lacks {missing[:5]}")
    if extra:
        problems.append(f"source head has tensors the target's layer has no place for: {extra[:5]}")
    problems += [f"{k}: source {got[k]}, target expects {expected[k]}"
                 for k in sorted(set(got) & set(expected)) if got[k] != expected[k]][:5]
    target_dtype = parts.backbone.norm.weight.dtype
    if p.dtype and getattr(mx, p.dtype) != target_dtype:
        problems.append(f"dtype: source head is {p.dtype}, target model {str(target_dtype).split('.')[-1]}")
    return problems


def _norm_problems(p: Plan, parts) -> List[str]:
    """The rule of `models.head_build.check_norm_convention` (norm_convention.misshifted_norms),
    before writing: after our +1 the head's norms must sit near the target's (already shifted)
    norms of the same kind."""
    with cpu():
        reference = norm_convention.norm_reference(parts.backbone)
        bad = list(norm_convention.misshifted_norms(_source_norms(p), reference))
    return [f"source norm {n.name} looks "
            + ("already shifted (norms ~1-centred: converted or double-shifted)" if n.twice
               else "shifted the wrong way")
            + f": mean {n.mean - 1.0:.2f}, expected ~0 (HF zero-centred form)" for n in bad]


def _source_norms(p: Plan) -> Iterator[Tuple[str, mx.array]]:
    """(source name, effective weight) of each head norm, read one at a time."""
    reader = TensorReader(p.source_dir)
    for job in p.jobs:
        if job.kind == "norm":
            src = job.sources[0]
            yield src, hf_head.head_form("norm", reader.read(p.files[src], src).astype(mx.float32))
