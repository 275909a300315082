#!/usr/bin/env python
"""Train the demo model shipped in `mlxmtp/demo_model/`: a small Qwen3.5 model
(model_type `qwen3_5`, dense, Gated DeltaNet + full attention every 4th layer)
with ONE trained MTP head, on the Python standard library's source code.

Everything is seeded and regenerated from scratch:

    # one-off; OpenBLAS makes float32 training matmuls ~30x faster (optional)
    apt-get install -y libopenblas0-pthread
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python scripts/train_demo_model.py train --out /work/demo_hf_export
    LD_PRELOAD=... python scripts/train_demo_model.py finetune-head --hf /work/demo_hf_export
    python scripts/train_demo_model.py package --hf /work/demo_hf_export --dest mlxmtp/demo_model
    python scripts/train_demo_model.py measure          # cost of (k+1)-token forwards / head steps

`train` writes a Hugging Face checkpoint in the real Qwen3.5 layout (nested
`text_config`, `model.language_model.*` + `mtp.*` tensors, zero-centred norms
stored without their +1, conv1d as [C, 1, K]) and checks that `mlx_lm.load` gives
the trained model's logits and `mlxmtp.load` the trained head's output.
`package` converts it with mlx-lm (float16) and injects the head as an `mtp/`
folder (`mlxmtp add-mtp-weights` when available, else the same library calls).

The model is built with mlx-lm's own `qwen3_5.Model` and the head with
`mlxmtp.models.mtp_head.MTPHead`, so the trained weights are exactly what
mlx-lm / mlxmtp run.  Head position i sees the post-final-norm hidden state h_i
and embed(token_{i+1}) and predicts token_{i+2}; the loss is
    main CE + HEAD_WEIGHT * (HARD * head CE + (1 - HARD) * CE(head, softmax(sg(main logits at i+1))))
the second term distils the head towards the model's own next-next prediction,
which is what greedy acceptance is measured against.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SEED = 1234
VOCAB_SIZE = 2048
# Chosen from `measure` and the training budget (a 2-core CPU, ~15 minutes): hidden 192,
# 8 layers and a 2048-token vocabulary keep the head (1 layer + lm_head) at ~0.17 of a
# backbone step; float16 makes a 2-token verify ~1.25x a 1-token step on MLX's CPU
# backend (float32: ~1.7x) and keeps the shipped folder small.
SIZES = dict(
    hidden_size=192,
    num_hidden_layers=8,
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=48,
    linear_value_head_dim=48,
    linear_conv_kernel_dim=4,
    intermediate_size=512,
    vocab_size=VOCAB_SIZE,
    partial_rotary_factor=0.25,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
)
SEQ_LEN = 128
BATCH = 8
STEPS = 420
WARMUP = 30
LR = 3e-3
MIN_LR_FRAC = 0.1
WEIGHT_DECAY = 0.01
HEAD_WEIGHT = 0.5
HARD = 0.3  # share of the head loss on the true token (the rest distils the main model)
CHAT_FRACTION = 0.2  # documents wrapped as a ChatML exchange so the chat template means something
HEAD_STEPS = 250  # head-only distillation phase (finetune-head)
HOLDOUT_EVERY = 25  # every 25th file (sorted by hash) is held out for evaluation

EXCLUDE_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


def stdlib_dir() -> Path:
    return Path(os.__file__).resolve().parent


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train, held-out) .py files of the standard library, deterministic split."""
    root = stdlib_dir()
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if EXCLUDE_DIRS & set(rel.parts[:-1]):
            continue
        files.append(p)
    key = lambda p: hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest()  # noqa: E731
    files.sort(key=key)
    held = [p for i, p in enumerate(files) if i % HOLDOUT_EVERY == 0]
    train = [p for i, p in enumerate(files) if i % HOLDOUT_EVERY != 0]
    return train, held


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def train_tokenizer(texts: list[str]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from mlxmtp.testing.fixtures import _PRETOKENIZE_REGEX, ADDED_TOKENS, SPECIAL_TOKENS

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    n_extra = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - n_extra,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Added after the BPE vocabulary, in this order (ids VOCAB_SIZE-9 .. VOCAB_SIZE-1).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def write_tokenizer_files(tok, path: Path) -> None:
    from mlxmtp.testing.fixtures import EOS_TOKEN, PAD_TOKEN, _write_json, save_tokenizer

    save_tokenizer(tok, path)
    eos, pad = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
    _write_json(path / "generation_config.json", {
        "bos_token_id": pad, "pad_token_id": pad, "do_sample": False,
        "eos_token_id": [eos, pad], "transformers_version": "4.57.0",
    })


def make_documents(files: list[Path], rng: random.Random) -> list[str]:
    """Raw source files; some wrapped as a chat turn ("show me module x" -> code)."""
    docs = []
    for p in files:
        text = read(p)
        if rng.random() < CHAT_FRACTION:
            name = p.relative_to(stdlib_dir()).as_posix()
            body = text[: rng.randint(800, 4000)]
            docs.append(
                f"<|im_start|>user\nShow me the start of the Python standard library file {name}.<|im_end|>\n"
                f"<|im_start|>assistant\n<think>\n\n</think>\n\n{body}<|im_end|>\n"
            )
        else:
            docs.append(text)
    return docs


def encode_corpus(tok, docs: list[str]) -> np.ndarray:
    eot = tok.token_to_id("<|endoftext|>")
    out = []
    for enc in tok.encode_batch(docs):
        out.extend(enc.ids)
        out.append(eot)
    return np.asarray(out, dtype=np.int32)


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


def model_config(tok) -> dict:
    from mlxmtp.testing.fixtures import EOS_TOKEN, PAD_TOKEN, make_config

    bos, eos = tok.token_to_id(PAD_TOKEN), tok.token_to_id(EOS_TOKEN)
    cfg = make_config("qwen3_5", dtype="float32", tie_word_embeddings=True,
                      bos_token_id=bos, eos_token_id=eos, **SIZES)
    cfg["image_token_id"] = cfg["video_token_id"] = bos
    return cfg


def build(cfg: dict):
    """mlx-lm's own Qwen3.5 model + our MTPHead, deterministically initialised."""
    import mlx.core as mx
    from mlx_lm.models import qwen3_5

    from mlxmtp.mlxlm.family import text_parts
    from mlxmtp.models.mtp_head import MTPHead

    mx.random.seed(SEED)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(cfg))
    parts = text_parts(model)
    head = MTPHead(parts)
    # Gated DeltaNet decay spread (A in [1, 16] as in mlx-lm's init, but seeded here).
    for layer in parts.backbone.layers:
        if hasattr(layer, "linear_attn"):
            nv = layer.linear_attn.A_log.shape[0]
            layer.linear_attn.A_log = mx.log(mx.random.uniform(1.0, 16.0, (nv,)))
    # Small residual-branch outputs at init (GPT-2 style) for a stable start.
    scale = 1.0 / math.sqrt(2 * (SIZES["num_hidden_layers"] + 1))
    for layer in list(parts.backbone.layers) + list(head.layers):
        mixer = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
        out = mixer.out_proj if hasattr(mixer, "out_proj") else mixer.o_proj
        out.weight = out.weight * scale
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * scale
    mx.eval(model.parameters(), head.parameters())
    return model, head, parts


def forward(parts, head, batch):
    """batch [B, T+2] -> (main logits [B, T+1, V], head logits [B, T, V])."""
    inputs = batch[:, :-1]
    h = parts.backbone(inputs)  # post final norm
    logits = parts.lm_head(h)
    e = parts.embed_tokens(inputs[:, 1:])
    hl = parts.lm_head(head(e, h[:, :-1]))
    return logits, hl


def losses(parts, head, batch, logits_into: list | None = None):
    import mlx.core as mx
    import mlx.nn as nn

    logits, hl = forward(parts, head, batch)
    if logits_into is not None:  # a caller adding losses of its own on the main logits
        logits_into.append(logits)
    main = nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")
    head_hard = nn.losses.cross_entropy(hl, batch[:, 2:], reduction="mean")
    teacher = mx.stop_gradient(mx.softmax(logits[:, 1:].astype(mx.float32), axis=-1))
    head_soft = -(teacher * nn.log_softmax(hl.astype(mx.float32), axis=-1)).sum(-1).mean()
    total = main + HEAD_WEIGHT * (HARD * head_hard + (1 - HARD) * head_soft)
    # Proxy for greedy acceptance: head argmax == main argmax at i+1 (teacher forced).
    agree = (mx.argmax(hl, -1) == mx.argmax(logits[:, 1:], -1)).astype(mx.float32).mean()
    return total, (main, head_hard, head_soft, agree)


def gated_delta_parallel(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **_):
    """Training-only, whole-sequence parallel form of mlx-lm's gated delta rule
    (`gated_delta_ops`: S_t = g_t S_{t-1}; S_t += beta_t (v_t - S_t k_t) k_t^T; y_t = S_t q_t),
    from a zero state and without a mask.

    With u_t = beta_t (v_t - g_t S_{t-1} k_t) the state is S_t = sum_{s<=t} e^{G_t-G_s} u_s k_s^T
    (G = cumsum log g), so (I + A) U = diag(beta) V with A_ts = beta_t e^{G_t-G_s} k_t.k_s (s < t):
    a unit lower-triangular system, solved as prod_j (I + (-A)^(2^j)) (A is nilpotent),
    and Y = ((Q K^T) * e^{G_t-G_s} [s <= t]) U.  All matmuls, so training is not a Python loop
    over positions; `verify_export` checks the result against mlx-lm's own recurrence.
    """
    import mlx.core as mx
    import mlx.nn as nn

    assert state is None and mask is None, "parallel form is for training from a zero state"
    B, T, Hk, Dk = q.shape
    Hv = v.shape[-2]
    if (r := Hv // Hk) > 1:
        q, k = mx.repeat(q, r, -2), mx.repeat(k, r, -2)
    beta = mx.sigmoid(b).transpose(0, 2, 1)  # [B, H, T]
    logg = (-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias)).transpose(0, 2, 1)
    G = mx.cumsum(logg, axis=-1)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # [B, H, T, D]
    idx = mx.arange(T)
    incl = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    diff = G[..., :, None] - G[..., None, :]
    dec_incl = mx.where(incl, mx.exp(mx.where(incl, diff, 0.0)), 0.0)
    dec_strict = mx.where(strict, dec_incl, 0.0)
    kt = k.swapaxes(-1, -2)
    N = -(beta[..., :, None] * (k @ kt) * dec_strict)
    inv = unit_lower_inverse(N)
    U = inv @ (beta[..., None] * v)
    y = ((q @ kt) * dec_incl) @ U
    return y.transpose(0, 2, 1, 3).astype(q.dtype), None


def unit_lower_inverse(N):
    """(I - N)^-1, as prod_j (I + N^(2^j)) for a strictly lower-triangular [..., T, T] N
    (nilpotent: the product ends once 2^j reaches T), all matmuls."""
    import mlx.core as mx

    T = N.shape[-1]
    inv, P, covered = mx.eye(T, dtype=N.dtype) + N, N, 2
    while covered < T:
        P = P @ P
        inv = inv + inv @ P
        covered *= 2
    return inv


def check_gdn_form(form=None, T: int = SEQ_LEN + 1, D: int = 64) -> float:
    """Largest difference between a training form of the gated delta rule (default: the
    parallel one) and mlx-lm's own recurrence, on random inputs of T positions."""
    import mlx.core as mx
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

    form = form or gated_delta_parallel
    mx.random.seed(0)
    B, Hk, Hv = 2, 2, 4
    q, k = normalize_qk(mx.random.normal((B, T, Hk, D)), mx.random.normal((B, T, Hk, D)),
                        inv_scale=D ** -0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, D))
    a, b = mx.random.normal((B, T, Hv)), mx.random.normal((B, T, Hv))
    A_log, dt = mx.log(mx.random.uniform(1.0, 16.0, (Hv,))), mx.ones(Hv)
    ref, _ = gated_delta_update(q, k, v, a, b, A_log, dt, None, None, use_kernel=False)
    out, _ = form(q, k, v, a, b, A_log, dt)
    err = mx.abs(ref - out).max().item()
    assert err < 1e-4, err
    return err


# ---------------------------------------------------------------------------
# Export / verification
# ---------------------------------------------------------------------------

# What the shipped head's mtp/config.json names as its source: the export's own path would
# be a folder on the machine that trained it.
HEAD_SOURCE = "scripts/train_demo_model.py (its float16 HF export)"

HF_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
            ".q_norm.weight", ".k_norm.weight")


def export_hf(model, head, cfg: dict, tok, out: Path, meta: dict) -> None:
    """Write the HF layout that mlx-lm's qwen3_5 `sanitize` reads back to these exact weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlxmtp.checkpoint.hf_head import is_zero_centred_norm
    from mlxmtp.testing.fixtures import _write_json, save_safetensors_shards

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    w = {}
    for k, v in tree_flatten(model.parameters()):
        assert k.startswith("language_model.model."), k  # tied: no lm_head
        name = "model.language_model." + k[len("language_model.model."):]
        if "conv1d.weight" in name:
            v = v.swapaxes(1, 2)  # mlx [C, K, 1] -> HF [C, 1, K]
        elif v.ndim == 1 and name.endswith(HF_NORMS):
            v = v - 1.0  # zero-centred RMSNorm, stored without its +1
        w[name] = np.array(v.astype(mx.float32))
    for k, v in tree_flatten(head.parameters()):
        if v.ndim == 1 and is_zero_centred_norm(k):
            v = v - 1.0
        w["mtp." + k] = np.array(v.astype(mx.float32))
    _write_json(out / "config.json", cfg)
    save_safetensors_shards(out, w, dtype="float32", num_shards=2)
    write_tokenizer_files(tok, out)
    _write_json(out / "training.json", meta)


def verify_export(model, head, out: Path, held_ids: np.ndarray) -> dict:
    """mlx_lm.load(export) == trained model; mlxmtp.load(export) head == trained head."""
    import mlx.core as mx
    import mlx_lm

    import mlxmtp
    from mlxmtp.mlxlm.family import text_parts

    x = mx.array(held_ids[None, :129])
    parts = text_parts(model)
    h = parts.backbone(x[:, :-1])
    ref_logits = parts.lm_head(h)
    ref_head = head(parts.embed_tokens(x[:, 1:]), h)

    m2, _ = mlx_lm.load(str(out))
    d_logits = mx.abs(m2(x[:, :-1]) - ref_logits).max().item()
    m3, _ = mlxmtp.load(str(out))
    p3 = m3.parts
    h3 = p3.backbone(x[:, :-1])
    d_head = mx.abs(m3.head(p3.embed_tokens(x[:, 1:]), h3) - ref_head).max().item()
    res = {"max_abs_logit_diff_mlx_lm": d_logits, "max_abs_head_diff_mlxmtp": d_head}
    print("export check:", res, flush=True)
    assert d_logits < 1e-4 and d_head < 1e-4, res
    return res


# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------


def cmd_train(args) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    t_start = time.perf_counter()
    rng = random.Random(SEED)
    np_rng = np.random.default_rng(SEED)
    train_files, held_files = stdlib_files()
    docs = make_documents(train_files, rng)
    tok = train_tokenizer(docs)
    data = encode_corpus(tok, docs)
    held = encode_corpus(tok, [read(p) for p in held_files])
    print(f"tokenizer {tok.get_vocab_size()} tokens; train {len(train_files)} files / {len(data)} tokens; "
          f"held-out {len(held_files)} files / {len(held)} tokens "
          f"({len(''.join(docs)) / len(data):.2f} chars/token) [{time.perf_counter() - t_start:.0f}s]", flush=True)

    import mlx_lm.models.qwen3_5 as q35

    print(f"parallel gated delta rule vs mlx-lm recurrence: max abs diff {check_gdn_form():.2e}", flush=True)
    recurrent_gdn = q35.gated_delta_update
    q35.gated_delta_update = gated_delta_parallel  # training only; restored before export
    cfg = model_config(tok)
    model, head, parts = build(cfg)
    n_main = sum(v.size for _, v in tree_flatten(model.parameters()))
    n_head = sum(v.size for _, v in tree_flatten(head.parameters()))
    print(f"params: main {n_main / 1e6:.2f}M, head {n_head / 1e6:.2f}M", flush=True)

    class Joint(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model
            self.head = head

    joint = Joint()
    steps = args.steps

    def lr_at(step):
        if step < WARMUP:
            return LR * (step + 1) / WARMUP
        t = (step - WARMUP) / max(1, steps - WARMUP)
        return LR * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * t)))

    opt = optim.AdamW(learning_rate=LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)

    def loss_fn(j, batch):
        return losses(parts, head, batch)

    value_grad = nn.value_and_grad(joint, loss_fn)
    state = [joint.state, opt.state]

    def step_fn(batch, lr):
        opt.learning_rate = lr
        (loss, aux), grads = value_grad(joint, batch)
        grads, norm = optim.clip_grad_norm(grads, 1.0)
        opt.update(joint, grads)
        return loss, aux, norm

    L = SEQ_LEN + 2

    def sample(n, arr, gen):
        starts = gen.integers(0, len(arr) - L, size=n)
        return mx.array(np.stack([arr[s:s + L] for s in starts]))

    eval_rng = np.random.default_rng(SEED + 1)
    eval_batches = [sample(BATCH, held, eval_rng) for _ in range(2)]

    def evaluate():
        vals = np.zeros(4)
        for b in eval_batches:
            _, aux = losses(parts, head, b)
            vals += np.array([a.item() for a in aux])
        return vals / len(eval_batches)

    curve = []
    t0 = time.perf_counter()
    for step in range(steps):
        batch = sample(BATCH, data, np_rng)
        loss, aux, norm = step_fn(batch, mx.array(lr_at(step)))
        mx.eval(state, loss, aux)
        if step % 25 == 0 or step == steps - 1 or step < 3:
            el = time.perf_counter() - t0
            main, hh, hs, ag = (a.item() for a in aux)
            print(f"step {step:5d} loss {loss.item():.3f} main {main:.3f} head {hh:.3f} distil {hs:.3f} "
                  f"agree {ag:.2f} gnorm {norm.item():.2f} lr {lr_at(step):.2e} [{el:.0f}s, "
                  f"{(step + 1) * BATCH * L / el:.0f} tok/s]", flush=True)
        if step % 100 == 0 or step == steps - 1:
            ev = evaluate()
            curve.append({"step": step, "train_main_ce": main, "heldout_main_ce": ev[0], "heldout_head_ce": ev[1],
                          "heldout_agree": ev[3]})
            print(f"  eval step {step}: held-out main CE {ev[0]:.3f} head CE {ev[1]:.3f} agree {ev[3]:.3f}",
                  flush=True)
    train_seconds = time.perf_counter() - t0
    q35.gated_delta_update = recurrent_gdn
    model.eval()
    head.eval()
    meta = {
        "seed": SEED, "steps": steps, "batch": BATCH, "seq_len": SEQ_LEN, "lr": LR, "head_weight": HEAD_WEIGHT,
        "hard_fraction": HARD, "train_seconds": round(train_seconds, 1), "train_tokens": int(len(data)),
        "tokens_seen": int(steps * BATCH * L), "params_main": int(n_main), "params_head": int(n_head),
        "held_out_files": [p.relative_to(stdlib_dir()).as_posix() for p in held_files],
        "curve": curve, "python": sys.version.split()[0],
    }
    out = Path(args.out)
    export_hf(model, head, cfg, tok, out, meta)
    meta["export_check"] = verify_export(model, head, out, held)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"exported to {out} [{time.perf_counter() - t_start:.0f}s total]", flush=True)


def cmd_finetune_head(args) -> None:
    """Second phase: backbone frozen, the head alone distilled towards the model's own
    next-next distribution (what greedy acceptance measures); rewrites the export's mtp.*."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import mlx_lm.models.qwen3_5 as q35
    from mlx.utils import tree_flatten
    from tokenizers import Tokenizer

    import mlxmtp
    from mlxmtp.checkpoint.hf_head import checkpoint_weight_map, is_zero_centred_norm
    from mlxmtp.testing.fixtures import save_safetensors_shards

    t_start = time.perf_counter()
    out = Path(args.hf)
    model, _ = mlxmtp.load(str(out))
    parts, head = model.parts, model.head
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    train_files, held_files = stdlib_files()
    data = encode_corpus(tok, make_documents(train_files, random.Random(SEED)))
    held = encode_corpus(tok, [read(p) for p in held_files])
    model.eval()
    L, B, steps = SEQ_LEN + 2, 2 * BATCH, args.steps
    # Self-distillation data: what greedy acceptance is measured on is the model's OWN
    # continuations (more regular than human code), so the head also learns from text the
    # model generated itself, greedy and at temperature 0.6, from prompts cut out of the
    # training files (held-out files are only used to evaluate).
    gen_rng = np.random.default_rng(SEED + 3)
    own = self_generated(model, data, args.self_generated, gen_rng) if args.self_generated else None
    own_held = self_generated(model, held, 32, np.random.default_rng(SEED + 4)) if args.self_generated else None
    recurrent_gdn = q35.gated_delta_update
    q35.gated_delta_update = gated_delta_parallel
    head.train()
    np_rng = np.random.default_rng(SEED + 2)
    lr0 = args.lr
    opt = optim.AdamW(learning_rate=lr0, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)

    def sample(n, arr, gen):
        if arr.ndim == 2:  # generated sequences: one window per row
            rows = gen.integers(0, len(arr), size=n)
            starts = gen.integers(0, arr.shape[1] - L + 1, size=n)
            return mx.array(np.stack([arr[r, s:s + L] for r, s in zip(rows, starts)]))
        starts = gen.integers(0, len(arr) - L, size=n)
        return mx.array(np.stack([arr[s:s + L] for s in starts]))

    def teacher(batch):
        inputs = batch[:, :-1]
        h = parts.backbone(inputs)
        return h, mx.softmax(parts.lm_head(h)[:, 1:].astype(mx.float32), axis=-1)

    def loss_fn(hd, batch, h, p):
        hl = parts.lm_head(hd(parts.embed_tokens(batch[:, 1:-1]), h[:, :-1]))
        soft = -(p * nn.log_softmax(hl.astype(mx.float32), axis=-1)).sum(-1).mean()
        agree = (mx.argmax(hl, -1) == mx.argmax(p, -1)).astype(mx.float32).mean()
        return soft, agree

    value_grad = nn.value_and_grad(head, loss_fn)
    eval_batches = [sample(BATCH, held, np.random.default_rng(SEED + 1)) for _ in range(2)]
    own_eval = [sample(BATCH, own_held, np.random.default_rng(SEED + 5)) for _ in range(2)] if own is not None else []

    def evaluate():
        real = np.mean([loss_fn(head, b, *teacher(b))[1].item() for b in eval_batches])
        gen = np.mean([loss_fn(head, b, *teacher(b))[1].item() for b in own_eval]) if own_eval else float("nan")
        return real, gen

    print("head fine-tune: held-out agree before (real, generated) %.3f %.3f" % evaluate(), flush=True)
    curve = []
    t0 = time.perf_counter()
    for step in range(steps):
        opt.learning_rate = lr0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        if own is not None:  # half real text, half the model's own continuations
            batch = mx.concatenate([sample(B // 2, data, np_rng), sample(B - B // 2, own, np_rng)])
        else:
            batch = sample(B, data, np_rng)
        h, p = teacher(batch)
        h, p = mx.stop_gradient(h), mx.stop_gradient(p)
        (loss, agree), grads = value_grad(head, batch, h, p)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss, agree)
        if step % 25 == 0 or step == steps - 1:
            print(f"head step {step:4d} distil {loss.item():.3f} agree {agree.item():.2f} "
                  f"[{time.perf_counter() - t0:.0f}s]", flush=True)
        if step % 100 == 0 or step == steps - 1:
            real, gen = evaluate()
            curve.append({"step": step, "heldout_agree": float(real), "heldout_generated_agree": float(gen)})
            print(f"  eval head step {step}: held-out agree {real:.3f}, on generated continuations {gen:.3f}",
                  flush=True)
    q35.gated_delta_update = recurrent_gdn
    head.eval()
    # Rewrite the export with the new mtp.* tensors (HF convention: zero-centred norms - 1).
    weights = {}
    for shard in sorted(set(checkpoint_weight_map(out).values())):
        weights.update({k: np.array(v) for k, v in mx.load(str(out / shard)).items() if not k.startswith("mtp.")})
    for k, v in tree_flatten(head.parameters()):
        weights["mtp." + k] = np.array((v - 1.0 if v.ndim == 1 and is_zero_centred_norm(k) else v).astype(mx.float32))
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    save_safetensors_shards(out, weights, dtype="float32", num_shards=2)
    m2, _ = mlxmtp.load(str(out))
    x = mx.array(held[None, :129])
    hh = parts.backbone(x[:, :-1])
    e = parts.embed_tokens(x[:, 1:])
    d = mx.abs(m2.head(e, hh) - head(e, hh)).max().item()
    print(f"export check (head): max abs diff {d}", flush=True)
    assert d < 1e-4
    meta = json.loads((out / "training.json").read_text())
    runs = meta.get("head_finetune", [])
    runs = runs if isinstance(runs, list) else [runs]
    runs.append({"steps": steps, "batch": B, "lr": lr0, "seconds": round(time.perf_counter() - t0, 1),
                 "self_generated_sequences": args.self_generated, "curve": curve,
                 "loss": "distillation only, backbone frozen"})
    meta["head_finetune"] = runs
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"done [{time.perf_counter() - t_start:.0f}s]", flush=True)


def self_generated(model, arr, n: int, rng, prompt_len: int = 32, new_tokens: int = 224, batch: int = 64):
    """n continuations by the model itself (half greedy, half temperature 0.6) of prompts cut
    from `arr` -> int32 [n, prompt_len + new_tokens]. Plain batched decoding with mlx-lm's cache
    (all rows the same length, so no padding)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    out, t0 = [], time.perf_counter()
    for i in range(0, n, batch):
        b = min(batch, n - i)
        starts = rng.integers(0, len(arr) - prompt_len, size=b)
        toks = mx.array(np.stack([arr[s:s + prompt_len] for s in starts]))
        temp = mx.array([0.0 if j % 2 == 0 else 0.6 for j in range(b)])[:, None]
        cache = make_prompt_cache(model)
        logits = model(toks, cache=cache)[:, -1]
        seq = [toks]
        for _ in range(new_tokens):
            greedy = mx.argmax(logits, -1)
            sampled = mx.random.categorical(logits / mx.maximum(temp, 1e-6), key=mx.random.key(int(rng.integers(2**31))))
            y = mx.where(temp[:, 0] > 0, sampled, greedy).astype(mx.int32)[:, None]
            seq.append(y)
            logits = model(y, cache=cache)[:, -1]
            mx.eval(logits)
        out.append(np.array(mx.concatenate(seq, axis=1)))
        print(f"self-generated {i + b}/{n} sequences [{time.perf_counter() - t0:.0f}s]", flush=True)
    return np.concatenate(out)


def half_precision_copy(hf: Path, out: Path) -> Path:
    """The float16 twin of the float32 export (same HF layout; A_log stays float32 as in real
    Qwen3.5 checkpoints): the source of both the MLX conversion and the head injection."""
    import mlx.core as mx

    from mlxmtp.checkpoint.hf_head import checkpoint_weight_map
    from mlxmtp.testing.fixtures import save_safetensors_shards

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    weights = {}
    for shard in sorted(set(checkpoint_weight_map(hf).values())):
        weights.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(hf / shard)).items()})
    save_safetensors_shards(out, weights, dtype="float16", num_shards=2)
    for f in hf.iterdir():
        if f.suffix in (".json", ".jinja") and not f.name.startswith("model.safetensors"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def cmd_package(args) -> None:
    """HF export -> float16 HF twin -> float16 MLX folder (mlx_lm.convert) + head injected
    with `mlxmtp add-mtp-weights --bits 16` as an `mtp/` folder."""
    from mlxmtp.testing.fixtures import write_mlx_conversion

    hf, dest = Path(args.hf), Path(args.dest)
    hf16 = half_precision_copy(hf, Path(str(hf) + "-float16"))
    # The model card is written by hand; the conversion replaces the folder (and writes mlx-lm's card).
    card = (dest / "README.md").read_text() if (dest / "README.md").exists() else None
    write_mlx_conversion(hf16, dest, dtype="float16")
    if card is not None:
        (dest / "README.md").write_text(card)
    cmd = [sys.executable, "-m", "mlxmtp.commands", "add-mtp-weights", "--model", str(dest), "--source", str(hf16),
           "--bits", "16"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == 0:
        print("head injected with: mlxmtp " + " ".join(cmd[3:]))
    else:
        # Same library calls the command is built on: HF mtp.* -> mlx naming (+1 on the
        # zero-centred norms, once) -> `mtp/` folder, float16 like the model.
        print("add-mtp-weights failed (" + (r.stderr.strip().splitlines() or ["?"])[-1]
              + "); writing mtp/ with mlxmtp.checkpoint directly")
        import mlx.core as mx

        from mlxmtp.checkpoint import hf_head, mtp_folder

        weights, info = hf_head.convert_hf_head(hf_head.load_mtp_tensors(hf16))
        weights = {k: v.astype(mx.float16) for k, v in weights.items()}
        config = mtp_folder.make_head_config(source=HEAD_SOURCE, family="qwen3_5", info=info, quantization=None,
                                             dtype="float16")
        mtp_folder.write_mtp_folder(dest, config, weights, force=True)
    head_config = json.loads((dest / "mtp" / "config.json").read_text())
    (dest / "mtp" / "config.json").write_text(json.dumps({**head_config, "source": HEAD_SOURCE}, indent=2) + "\n")
    meta = json.loads((hf / "training.json").read_text())
    (dest / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    # The shipped files name no folder of the machine that built them.
    for f in dest.rglob("*"):
        if f.is_file() and f.suffix in (".json", ".md", ".jinja"):
            text = f.read_text()
            assert str(hf) not in text and str(hf.resolve()) not in text, f"{f} names {hf}"
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"packaged {dest}: {size / 1e6:.2f} MB")


def cmd_measure(args) -> None:
    """Cost of a T-token decode forward relative to T=1 and of one head step, per size/dtype."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from mlxmtp.mlxlm.family import text_parts
    from mlxmtp.models.mtp_head import MTPHead
    from mlxmtp.testing.fixtures import make_config

    def bench(fn, n):
        for _ in range(3):
            fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e3

    shapes = [(256, 8, 768), (256, 12, 768), (192, 8, 512), (384, 8, 1024)]
    for h, n_layers, inter in shapes:
        for dt in (mx.float32, mx.float16):
            cfg = make_config("qwen3_5", tie_word_embeddings=True, **{
                **SIZES, "hidden_size": h, "num_hidden_layers": n_layers, "intermediate_size": inter,
                "head_dim": h // 4, "linear_key_head_dim": h // 4, "linear_value_head_dim": h // 4})
            m = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(cfg))
            parts = text_parts(m)
            head = MTPHead(parts)
            m.set_dtype(dt)
            head.set_dtype(dt)
            cache = make_prompt_cache(m)
            mx.eval(m(mx.array([list(range(3, 259))]), cache=cache))
            ms = {}
            for T in (1, 2, 3, 4):
                toks = mx.array([list(range(5, 5 + T))])

                def f(m=m, toks=toks, cache=cache, T=T):
                    mx.eval(mx.argmax(m(toks, cache=cache), -1))
                    for c in cache:
                        if c.is_trimmable():
                            c.trim(T)

                ms[T] = bench(f, args.iters)
            hc = KVCache()
            mx.eval(head(parts.embed_tokens(mx.zeros((1, 256), mx.int32)), mx.zeros((1, 256, h), dt), cache=[hc]))
            tok, hid = mx.array([[7]]), mx.zeros((1, 1, h), dt)

            def g(parts=parts, head=head, tok=tok, hid=hid, hc=hc):
                mx.eval(mx.argmax(parts.lm_head(head(parts.embed_tokens(tok), hid, cache=[hc])), -1))
                hc.trim(1)

            hs = bench(g, args.iters)
            n = sum(v.size for _, v in tree_flatten(m.parameters()))
            print(json.dumps({"hidden": h, "layers": n_layers, "intermediate": inter, "dtype": str(dt).split(".")[-1],
                              "params_M": round(n / 1e6, 2), "T1_ms": round(ms[1], 2),
                              "T_over_T1": {T: round(ms[T] / ms[1], 2) for T in ms},
                              "head_over_T1": round(hs / ms[1], 3)}), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--out", default="/work/demo_hf_export")
    t.add_argument("--steps", type=int, default=STEPS)
    k = sub.add_parser("package")
    k.add_argument("--hf", default="/work/demo_hf_export")
    k.add_argument("--dest", default=str(Path(__file__).resolve().parent.parent / "mlxmtp" / "demo_model"))
    f = sub.add_parser("finetune-head")
    f.add_argument("--hf", default="/work/demo_hf_export")
    f.add_argument("--steps", type=int, default=HEAD_STEPS)
    f.add_argument("--lr", type=float, default=1e-3)
    f.add_argument("--self-generated", type=int, default=0,
                   help="also distil on this many continuations generated by the model itself")
    m = sub.add_parser("measure")
    m.add_argument("--iters", type=int, default=30)
    args = p.parse_args(argv)
    {"train": cmd_train, "finetune-head": cmd_finetune_head, "package": cmd_package,
     "measure": cmd_measure}[args.cmd](args)


if __name__ == "__main__":
    main()
