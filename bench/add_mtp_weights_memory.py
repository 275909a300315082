"""Peak memory of `add-mtp-weights` on a head shaped like Qwen3-Next-80B-A3B's MTP head.

    /work/venv/bin/python bench/add_mtp_weights_memory.py [--experts 512] [--keep DIR]

Writes a synthetic BF16 source (only the `mtp.*` tensors + config + index; hidden 2048,
moe_intermediate 512, shared expert 512, 16 heads x 256 (q 2x wide for the gate), 2 kv heads,
`--experts` experts, small vocab) and a tiny matching 4-bit MLX target (one full-attention
layer with a dense MLP via `mlp_only_layers`, so it stays ~20 MB while its config describes
the 512-expert model), then runs the repair in a subprocess and prints the head's BF16 size
against the subprocess's peak RSS (ru_maxrss of the child).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

H, I_MOE, I_SHARED, NH, HD, NKV, VOCAB = 2048, 512, 512, 16, 256, 2, 1024


def config(experts: int) -> dict:
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": H, "num_hidden_layers": 1, "full_attention_interval": 1,
        "num_attention_heads": NH, "num_key_value_heads": NKV, "head_dim": HD,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "num_experts": experts, "num_experts_per_tok": 10, "moe_intermediate_size": I_MOE,
        "shared_expert_intermediate_size": I_SHARED, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "intermediate_size": 512, "mlp_only_layers": [0], "partial_rotary_factor": 0.25,
        "rope_theta": 10000000.0, "rope_scaling": None, "attention_bias": False,
        "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1,
    }


def head_shapes(experts: int):
    p = "mtp.layers.0"
    shapes = {
        "mtp.fc.weight": (H, 2 * H),
        "mtp.pre_fc_norm_embedding.weight": (H,), "mtp.pre_fc_norm_hidden.weight": (H,),
        "mtp.norm.weight": (H,),
        f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
        f"{p}.self_attn.q_proj.weight": (NH * HD * 2, H), f"{p}.self_attn.k_proj.weight": (NKV * HD, H),
        f"{p}.self_attn.v_proj.weight": (NKV * HD, H), f"{p}.self_attn.o_proj.weight": (H, NH * HD),
        f"{p}.self_attn.q_norm.weight": (HD,), f"{p}.self_attn.k_norm.weight": (HD,),
        f"{p}.mlp.gate.weight": (experts, H),
        f"{p}.mlp.shared_expert.gate_proj.weight": (I_SHARED, H),
        f"{p}.mlp.shared_expert.up_proj.weight": (I_SHARED, H),
        f"{p}.mlp.shared_expert.down_proj.weight": (H, I_SHARED),
        f"{p}.mlp.shared_expert_gate.weight": (1, H),
    }
    for e in range(experts):
        shapes[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (I_MOE, H)
        shapes[f"{p}.mlp.experts.{e}.up_proj.weight"] = (I_MOE, H)
        shapes[f"{p}.mlp.experts.{e}.down_proj.weight"] = (H, I_MOE)
    return shapes


def write_source(folder: Path, experts: int) -> int:
    """Stream a BF16 safetensors file (never holding more than one tensor) + config + index."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config(experts), indent=1))
    shapes = head_shapes(experts)
    names = sorted(shapes)
    header, off = {}, 0
    for n in names:
        size = int(np.prod(shapes[n])) * 2
        header[n] = {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": [off, off + size]}
        off += size
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    rng = np.random.default_rng(0)
    pool = rng.standard_normal(H * 2 * H + 4096).astype(np.float32)
    shard = "model-00042-of-00042.safetensors"
    with open(folder / shard, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for i, n in enumerate(names):
            count = int(np.prod(shapes[n]))
            start = (i * 7919) % 4096
            x = pool[start:start + count]
            x = x * (0.1 if len(shapes[n]) == 1 else 1.0 / np.sqrt(shapes[n][-1]))
            f.write((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    index = {"metadata": {"total_size": off}, "weight_map": {n: shard for n in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return off


def write_target(folder: Path, experts: int) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    cfg = config(experts)
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    model, qcfg = quantize_model(model, cfg, 64, 4, quant_predicate=model.quant_predicate)
    mx.eval(model.parameters())
    folder.mkdir(parents=True)
    save_model(folder, model)
    save_config(qcfg, config_path=folder / "config.json")
    assert not any(k.startswith("mtp") for k, _ in tree_flatten(model.parameters()))


CHILD = """
import sys, time
from mlxmtp.convert.add_mtp_weights import add_mtp_weights
t = time.perf_counter()
add_mtp_weights(sys.argv[1], sys.argv[2], echo=lambda s: None)
print(f"repair took {time.perf_counter() - t:.1f}s")
"""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--keep", default=None, help="work folder to keep (default: a temp folder, removed)")
    args = ap.parse_args(argv)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="amw-bench-"))
    try:
        t = time.perf_counter()
        src_bytes = write_source(root / "src", args.experts)
        write_target(root / "target", args.experts)
        print(f"wrote synthetic source ({src_bytes / 2**30:.2f} GiB bf16 head, {args.experts} experts) "
              f"and target in {time.perf_counter() - t:.0f}s")
        base = subprocess.run([sys.executable, "-c", "import mlx.core, mlx_lm, mlxmtp.convert.add_mtp_weights"],
                              check=True)
        base_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        del base
        out = subprocess.run([sys.executable, "-c", CHILD, str(root / "target"), str(root / "src")],
                             check=True, capture_output=True, text=True)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        head = sum(p.stat().st_size for p in (root / "target" / "mtp").iterdir())
        print(out.stdout.strip())
        print(f"head bf16 size:        {src_bytes / 2**30:6.2f} GiB")
        print(f"written 4-bit head:    {head / 2**30:6.2f} GiB")
        print(f"peak RSS of the repair:{peak / 2**30:6.2f} GiB  (python+mlx+mlx_lm import alone: "
              f"{base_rss / 2**30:.2f} GiB)")
        print(f"peak / bf16 head:      {peak / src_bytes:6.2f}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
