#!/usr/bin/env python
"""Fine-tune the demo model to copy: coding agents re-emit what they read (an Edit call's
`old_string`, a file printed again with a name changed), and a model that cannot copy
shows nothing of what suffix drafting does for them.

Plain fine-tuning on copy tasks did not teach it: after ~2M tokens of such rows its
attention had still not learned to look back at where the current text occurred before
(an induction head), and greedy decoding reproduced 16-23% of a copied file, as before. So
the attention is taught directly: two of the query heads of each full-attention layer (the
two that share key-value head 0) get a loss on their attention pattern, -log of the weight
they give, at each position whose recent tokens occurred earlier, to the position right
after that earlier occurrence (what an induction head attends to: the token that came next
there). With that target the heads learn to look back within ~100 steps, and the model then
learns to copy what they find. Two phases, both training model and head jointly with the
loss of train_demo_model.py plus that attention loss:

1. `induction`: 256-token rows of spans written twice (random tokens or corpus windows,
   sometimes with other text between the copies), the target the first copy's next position;
   a quarter of each batch plain corpus windows, so the model keeps what it was.
2. `tasks`: 768-token rows of copy and edit tasks (mlxmtp/models/demo_tasks.py on the
   training files), one longer span row and one corpus window per batch; the target, in a
   task's answer, the token the next one copies from (copy_alignment.py: through a renamed
   name and an Edit call's JSON escapes, where matching tokens finds nothing), and at every
   other position whose last MATCH tokens occurred before, the position after the earlier
   occurrence that matches the most tokens back. An answer position whose last two tokens went
   on otherwise before (a line that occurs twice: where greedy copies lost their place) weighs
   HARD_WEIGHT in the attention loss and adds its next token's cross-entropy (`--hard 0`: off).

Then the head is distilled again on the model's own output (train_demo_model.py
finetune-head), since the backbone moved, and packaged:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python scripts/finetune_demo_copy.py induction --out /work/copy_1
    LD_PRELOAD=... python scripts/finetune_demo_copy.py tasks --hf /work/copy_1 --out /work/copy_2
    LD_PRELOAD=... python scripts/train_demo_model.py finetune-head --hf /work/copy_2 --self-generated 1536 --steps 300
    python scripts/train_demo_model.py package --hf /work/copy_2 --dest mlxmtp/demo_model
    python scripts/finetune_demo_copy.py measure        # copy rate on held-out files

The packaged demo first ran `tasks` three times, before the answers' copy targets existed: first
(seed 11) with matching targets at the latest earlier occurrence, which taught its copies to
jump to what followed a line's second occurrence, then (`--seed 12`, from that export) with
the longest match, then `--seed 13 --steps 600` from the export of that. A fourth run with the
answers' copy targets (`--seed 14 --steps 400`) copied Edit calls better (0.54 of their tokens,
from 0.41) and the rest no better, and was not packaged; nor was a fifth (`--seed 15
--steps 600 --lr 1e-3`: 0.85 of a file printed again, 0.76 of a renamed one, 0.50 of an Edit
call). The packaged demo's runs and curves are in its training.json (`copy_finetune`); what it
copies, in docs/demo-model.md. Then, from the export of those three, with ambiguous positions
weighed (`--hard`): `--seed 16 --steps 500 --lr 1e-3`, and from its export `--seed 17 --steps
300 --lr 5e-4`, head distilled again: the packaged demo (0.93 of a file printed again).
A sixth run drawing Edit calls half the time (`--seed 18 --steps 300 --lr 5e-4 --kinds
repeat,rename,edit,edit`, from the packaged demo) copied more of every kind (0.96, 0.92, 0.50 of
Edit calls) and edited no faster: not packaged (docs/demo-model.md).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import copy_alignment  # noqa: E402
import train_demo_model as base  # noqa: E402

SEQ_LEN = 768  # a task row: an edit task (tool schemas, the file read, old and new strings) fits
MATCH = 4  # tokens that must have occurred before for a position to get an attention target
LOOK_BACK = 64  # tokens compared back to choose between earlier occurrences
SUPERVISED_HEADS = [0, 1]  # the query heads sharing key-value head 0, in each full-attention layer
ATTENTION_WEIGHT = 1.0
# An answer position whose last two tokens occurred before followed by another token than the
# one it copies (where a line occurs twice): greedy copies lose their place there (the held-out
# failures of `measure`), so its attention loss counts HARD_WEIGHT times and its next token's
# cross-entropy is added again, HARD_CE times (`--hard 0` turns both off).
HARD_WEIGHT, HARD_CE = 4.0, 1.0
# phase -> rows (span rows, task rows, plain windows per batch), row length, steps, peak
# learning rate, warm-up steps, seed of the rows drawn, and where the attention targets come
# from: "spans" (a span row's own copies; other rows have none) or "matches" (every row's
# `induction_targets`).
PHASES = {
    "induction": dict(spans=6, tasks=0, plain=2, seq_len=256, steps=400, lr=3e-3, warmup=20, seed=7,
                      targets="spans"),
    "tasks": dict(spans=1, tasks=2, plain=1, seq_len=SEQ_LEN, steps=200, lr=1.5e-3, warmup=10, seed=11,
                  targets="matches", task_seed=4321),
}
# Span rows per phase: longest span, share of random-token spans, chance and longest length
# of other text between the two copies.
SPANS = {"induction": dict(longest=64, random_share=0.5, gap_chance=0.5, gap=(1, 48)),
         "tasks": dict(longest=128, random_share=0.3, gap_chance=1.0, gap=(0, 200))}


CHUNK = 64  # positions per chunk of the chunked gated delta rule


def gated_delta_chunked(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **_):
    """Training-only chunked form of mlx-lm's gated delta rule (train_demo_model.py's
    `gated_delta_parallel` costs T^3 log T: too much at SEQ_LEN). Within a chunk of CHUNK
    positions, from the state S0 left by the chunks before it, u_t = beta_t (v_t - g_t S_{t-1} k_t)
    solve (I + A) U = diag(beta) (V - diag(Gamma) K S0^T) (A as in the parallel form, Gamma_t =
    e^{G_t}, G the in-chunk cumsum of log g); then Y = diag(Gamma) Q S0^T + ((Q K^T) * e^{G_t-G_s}
    [s <= t]) U and S = Gamma_C S0 + U^T diag(e^{G_C-G}) K. A Python loop over chunks only."""
    import mlx.core as mx
    import mlx.nn as nn

    assert state is None and mask is None, "chunked form is for training from a zero state"
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if (r := Hv // Hk) > 1:
        q, k = mx.repeat(q, r, -2), mx.repeat(k, r, -2)
    n, C = -(-T // CHUNK), CHUNK
    pad = n * C - T  # zero k, v, beta and log g after the end change nothing before it

    def chunks(t):  # [B, T, H, ...] -> [B, H, n, C, ...]
        t = mx.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
        t = t.reshape(B, n, C, *t.shape[2:])
        return t.transpose(0, 3, 1, 2, 4) if t.ndim == 5 else t.transpose(0, 3, 1, 2)

    beta = chunks(mx.sigmoid(b))  # [B, H, n, C]
    logg = chunks(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))
    G = mx.cumsum(logg, axis=-1)
    q, k, v = chunks(q), chunks(k), chunks(v)  # [B, H, n, C, D]
    idx = mx.arange(C)
    incl = idx[:, None] >= idx[None, :]
    diff = G[..., :, None] - G[..., None, :]
    dec_incl = mx.where(incl, mx.exp(mx.where(incl, diff, 0.0)), 0.0)
    dec_strict = mx.where(idx[:, None] > idx[None, :], dec_incl, 0.0)
    kt = k.swapaxes(-1, -2)
    N = -(beta[..., :, None] * (k @ kt) * dec_strict)
    inv = base.unit_lower_inverse(N)
    gamma = mx.exp(G)[..., None]
    W = inv @ (beta[..., None] * v)  # U = W - M S0^T
    M = inv @ (beta[..., None] * gamma * k)
    attn = (q @ kt) * dec_incl
    to_end = mx.exp(G[..., -1:] - G)[..., None]
    S = mx.zeros((B, Hv, Dv, Dk), dtype=q.dtype)
    ys = []
    for c in range(n):
        U = W[:, :, c] - M[:, :, c] @ S.swapaxes(-1, -2)
        ys.append((gamma[:, :, c] * q[:, :, c]) @ S.swapaxes(-1, -2) + attn[:, :, c] @ U)
        S = mx.exp(G[:, :, c, -1])[..., None, None] * S + (U * to_end[:, :, c]).swapaxes(-1, -2) @ k[:, :, c]
    y = mx.stack(ys, axis=2).reshape(B, Hv, n * C, Dv)[:, :, :T]
    return y.transpose(0, 2, 1, 3).astype(q.dtype), None


def load_float32(hf: str | None):
    """(mlx-lm model, head, tokenizers.Tokenizer, HF config) in float32."""
    import mlx.core as mx
    from tokenizers import Tokenizer

    import mlxmtp
    from mlxmtp.models import demo

    path = Path(hf) if hf else demo.PACKAGED
    wrapped, _ = mlxmtp.load(str(path))
    model, head = wrapped.base, wrapped.head
    model.set_dtype(mx.float32)
    head.set_dtype(mx.float32)
    mx.eval(model.parameters(), head.parameters())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return model, head, tok, base.model_config(tok)


def task_rows(files, chat_tok, tok, n_rows: int, rng: random.Random, kinds=None) -> list:
    """n_rows (row, targets): a [SEQ_LEN + 2] token row, a run of whole tasks (the last one
    cut), and {position: position of the token it copies next} over its answers
    (copy_alignment: through renames and JSON escapes, which matching tokens cannot follow).
    `kinds`: the task kinds drawn from, a kind listed twice drawn twice as often (default: all
    alike, demo_tasks.KINDS)."""
    eot = tok.token_to_id("<|endoftext|>")
    texts = [(p.relative_to(base.stdlib_dir()).as_posix(), base.read(p)) for p in files]
    rows = []
    while len(rows) < n_rows:
        row, targets = [], {}
        while len(row) < SEQ_LEN + 2:
            ids, copied = task_tokens(chat_tok, tok, _task(texts, rng, kinds))
            targets.update({len(row) + q: len(row) + k for q, k in copied.items() if len(row) + q < SEQ_LEN + 1})
            row += ids + [eot]
        rows.append((np.asarray(row[: SEQ_LEN + 2], dtype=np.int32), targets))
    return rows


def task_tokens(chat_tok, tok, task) -> tuple[list, dict]:
    """A task's whole conversation as token ids, and {position: position of the token it
    copies next} over its answer (copy_alignment)."""
    from mlxmtp.models import demo_tasks  # with the chat tokenizer: only when rows are built

    text = demo_tasks.render(chat_tok, task, with_answer=True)
    prompt_len = len(demo_tasks.render(chat_tok, task, with_answer=False))
    encoded = tok.encode(text)
    return encoded.ids, copy_alignment.token_targets(encoded.offsets, copy_alignment.char_sources(text, prompt_len, task))


def task_targets(row, copied: dict, hard_weight: float = HARD_WEIGHT) -> tuple:
    """(queries, keys, weights) for a task row: its answers' copy targets, and
    `induction_targets` at the positions those leave (a tool call's frame, code the prompt
    repeats); an ambiguous answer position weighs `hard_weight`, any other 1."""
    found = dict(zip(*induction_targets(row)))
    found.update(copied)
    queries = sorted(found)
    hard = ambiguous(row, copied)
    return queries, [found[q] for q in queries], [hard_weight if q in hard else 1.0 for q in queries]


def ambiguous(row, positions) -> set:
    """The positions q whose last two tokens occurred earlier in the row followed by another
    token than row[q + 1]."""
    wanted, successors, found = set(positions), {}, set()
    for q in range(1, len(row) - 1):
        seen = successors.setdefault((int(row[q - 1]), int(row[q])), set())
        if q in wanted and seen - {int(row[q + 1])}:
            found.add(q)
        seen.add(int(row[q + 1]))
    return found


def span_row(data: np.ndarray, gen: np.random.Generator, vocab: int, seq_len: int, longest: int,
             random_share: float, gap_chance: float, gap: tuple) -> tuple:
    """A [seq_len + 2] row of spans each written twice (random tokens, or a window of the
    corpus), with or without other text between the copies -> (row, queries, keys): at query
    position t of a second copy, the induction target is the position after the first copy's t."""
    row, queries, keys = [], [], []
    while len(row) < seq_len + 2:
        n = int(gen.integers(8, longest + 1))
        if gen.random() < random_share:
            span = list(gen.integers(0, vocab, size=n))
        else:
            s = int(gen.integers(0, len(data) - n))
            span = list(data[s:s + n])
        between = []
        if gap_chance >= 1 or gen.random() < gap_chance:
            g = int(gen.integers(*gap))
            s = int(gen.integers(0, len(data) - g))
            between = list(data[s:s + g])
        first, second = len(row), len(row) + n + len(between)
        queries += [second + t for t in range(n - 1)]
        keys += [first + t + 1 for t in range(n - 1)]
        row += span + between + span
    kept = [(q, k) for q, k in zip(queries, keys) if q < seq_len + 1]
    return np.asarray(row[: seq_len + 2], dtype=np.int32), [q for q, _ in kept], [k for _, k in kept]


def induction_targets(row) -> tuple:
    """(queries, keys) for any row: each input position whose last MATCH tokens occurred
    before, and the position after the occurrence that matches the most tokens back (up to
    LOOK_BACK; the latest of equals): where a line occurs twice in a file, the copy of the
    first must go on as the first did, not jump to what followed the second."""
    seen, queries, keys = {}, [], []
    for i in range(MATCH - 1, len(row) - 1):
        key = tuple(int(t) for t in row[i - MATCH + 1 : i + 1])
        earlier = seen.setdefault(key, [])
        if earlier:
            best = max(earlier[-LOOK_BACK:], key=lambda j: (_matched(row, j, i), j))
            queries.append(i)
            keys.append(best + 1)
        earlier.append(i)
    return queries, keys


def _matched(row, j: int, i: int) -> int:
    """How many tokens ending at j equal those ending at i (j < i), up to LOOK_BACK."""
    n = 0
    while n < LOOK_BACK and j - n >= 0 and row[j - n] == row[i - n]:
        n += 1
    return n


def batch_arrays(rows, targets):
    """Rows and their (queries, keys[, weights]) -> tokens [B, T], row, query and key index
    arrays, and the targets' weights (1 where none are given)."""
    import mlx.core as mx

    index = [np.asarray(a, dtype=np.int32) for a in (
        np.concatenate([[b] * len(t[0]) for b, t in enumerate(targets)]),
        np.concatenate([t[0] for t in targets]), np.concatenate([t[1] for t in targets]))]
    weights = np.concatenate([t[2] if len(t) > 2 else np.ones(len(t[0])) for t in targets])
    return (mx.array(np.stack(rows)), *(mx.array(a) for a in index), mx.array(weights.astype(np.float32)))


@contextmanager
def recorded_attention(probs: list):
    """mlx-lm's attention in the qwen3_5 layers computed explicitly (training only), its
    weights [B, H, L, S] appended to `probs` in call order: the backbone's full-attention
    layers first, then the head's."""
    import mlx.core as mx
    import mlx_lm.models.qwen3_next as qwen3_next
    from mlx_lm.models.base import create_causal_mask

    def attention(queries, keys, values, cache=None, scale=1.0, mask=None, **_):
        L, r = queries.shape[2], queries.shape[1] // keys.shape[1]
        if r > 1:
            keys, values = mx.repeat(keys, r, 1), mx.repeat(values, r, 1)
        scores = (queries * scale) @ keys.swapaxes(-1, -2)
        if isinstance(mask, str) or (mask is None and L > 1):
            scores = mx.where(create_causal_mask(L, keys.shape[2] - L), scores, -1e9)
        elif mask is not None:
            scores = mx.where(mask, scores, -1e9) if mask.dtype == mx.bool_ else scores + mask
        p = mx.softmax(scores.astype(mx.float32), axis=-1)
        probs.append(p)
        return p.astype(values.dtype) @ values

    original, qwen3_next.scaled_dot_product_attention = qwen3_next.scaled_dot_product_attention, attention
    try:
        yield
    finally:
        qwen3_next.scaled_dot_product_attention = original


def attention_loss(probs: list, rows, queries, keys, weights):
    """Weighted mean -log weight the supervised heads of the backbone's two full-attention
    layers give their induction targets."""
    import mlx.core as mx

    w = weights[:, None] / weights.sum() / len(SUPERVISED_HEADS)
    losses = [-(w * mx.log(p[:, SUPERVISED_HEADS][rows, :, queries, keys] + 1e-6)).sum() for p in probs[:2]]
    return sum(losses) / len(losses)


def hard_cross_entropy(logits, tokens, rows, queries, weights):
    """Mean cross-entropy of the next token at the targets weighing more than 1 (0 if none)."""
    import mlx.core as mx
    import mlx.nn as nn

    hard = (weights > 1).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits[rows, queries], tokens[rows, queries + 1], reduction="none")
    return (hard * ce).sum() / mx.maximum(hard.sum(), 1.0)


def _task(texts, rng, kinds=None):
    from mlxmtp.models import demo_tasks

    while True:
        path, text = rng.choice(texts)
        task = demo_tasks.random_task(path, text, rng, max_chars=rng.choice([250, 400, 600]),
                                      kinds=kinds or demo_tasks.KINDS)
        if task is not None and (task[1] is None or len(task[0][-1]["content"]) <= 400):
            return task


def copy_rate(model, tok_wrapper, tasks, max_tokens: int = 400) -> float:
    """Mean share of the answers' tokens that greedy decoding reproduces, over `tasks`."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from mlxmtp.models import demo_tasks

    rates = []
    for task in tasks:
        prompt = demo_tasks.render(tok_wrapper, task, with_answer=False)
        got = [r.token for r in mlx_lm.stream_generate(model, tok_wrapper, prompt, max_tokens=max_tokens,
                                                       sampler=make_sampler(temp=0.0))]
        rates.append(demo_tasks.reproduced_share(demo_tasks.answer_ids(tok_wrapper, task), got))
    return float(np.mean(rates))


def phase_rows(phase: str, data, tasks, gen, vocab: int, step: int, hard_weight: float = HARD_WEIGHT):
    """One step's rows (task rows, span rows, plain windows) and their attention targets."""
    p, s = PHASES[phase], SPANS[phase]
    L = p["seq_len"] + 2
    spans = [span_row(data, gen, vocab, p["seq_len"], **s) for _ in range(p["spans"])]
    plain = [data[i:i + L] for i in gen.integers(0, len(data) - L, size=p["plain"])]
    task = list(tasks[step * p["tasks"] : (step + 1) * p["tasks"]])
    rows = [r for r, _ in task] + [r for r, _, _ in spans] + plain
    if p["targets"] == "matches":
        hard = [task_targets(*t, hard_weight=hard_weight) for t in task]
        return rows, hard + [induction_targets(r) for r in rows[len(task):]]
    return rows, [([], [])] * len(task) + [(q, k) for _, q, k in spans] + [([], [])] * len(plain)


def cmd_train(args) -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import mlx_lm.models.qwen3_5 as q35
    from transformers import AutoTokenizer

    from mlxmtp.mlxlm.family import text_parts
    from mlxmtp.models import demo

    p = {**PHASES[args.phase], **({"seed": args.seed, "task_seed": args.seed} if args.seed is not None else {}),
         **({"steps": args.steps} if args.steps else {}), **({"lr": args.lr} if args.lr else {}),
         "hard_weight": HARD_WEIGHT if args.hard else 1.0, "hard_ce": HARD_CE if args.hard else 0.0,
         **({"kinds": args.kinds} if args.kinds else {})}
    model, head, tok, cfg = load_float32(args.hf)
    parts, probs, vocab = text_parts(model), [], tok.get_vocab_size() - 16
    train_files, held_files = base.stdlib_files()
    chat_tok = AutoTokenizer.from_pretrained(str(demo.PACKAGED))
    tasks = task_rows(train_files, chat_tok, tok, p["steps"] * p["tasks"] + 1, random.Random(p["task_seed"]),
                      p.get("kinds")) if p["tasks"] else []
    data = base.encode_corpus(tok, base.make_documents(train_files, random.Random(base.SEED)))
    held = base.encode_corpus(tok, [base.read(f) for f in held_files])

    class Joint(nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.head = model, head

    def loss(_, tokens, rows, queries, keys, weights):
        probs.clear()
        logits = []
        total, aux = base.losses(parts, head, tokens, logits_into=logits)
        attention = attention_loss(probs, rows, queries, keys, weights)
        hard = hard_cross_entropy(logits[0], tokens, rows, queries, weights)
        return total + ATTENTION_WEIGHT * attention + p["hard_ce"] * hard, (aux[0], attention, hard)

    joint = Joint()
    opt = optim.AdamW(learning_rate=p["lr"], betas=(0.9, 0.95), weight_decay=base.WEIGHT_DECAY)
    value_grad, gen = nn.value_and_grad(joint, loss), np.random.default_rng(p["seed"])
    evaluate = held_out_eval(parts, head, probs, held, held_files, chat_tok, tok, vocab)
    curve, t0 = [], time.perf_counter()
    recurrent_gdn, q35.gated_delta_update = q35.gated_delta_update, gated_delta_chunked
    with recorded_attention(probs):
        for step in range(p["steps"]):
            rows, targets = phase_rows(args.phase, data, tasks, gen, vocab, step, p["hard_weight"])
            warm = min(1.0, (step + 1) / p["warmup"])
            opt.learning_rate = p["lr"] * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / p["steps"])))
            (total, aux), grads = value_grad(joint, *batch_arrays(rows, targets))
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            opt.update(joint, grads)
            mx.eval(joint.parameters(), opt.state, total)
            if step % 20 == 0 or step == p["steps"] - 1:
                curve.append({"step": step, "main_ce": aux[0].item(), "attention": aux[1].item(),
                              "hard_ce": aux[2].item(), **evaluate()})
                print(json.dumps(curve[-1]), f"[{time.perf_counter() - t0:.0f}s]", flush=True)
    q35.gated_delta_update = recurrent_gdn
    export(model, head, cfg, tok, args, {"phase": args.phase, **p, "look_back": LOOK_BACK, "spans": SPANS[args.phase],
                                         "seconds": round(time.perf_counter() - t0, 1), "curve": curve}, held)


def held_out_eval(parts, head, probs, held, held_files, chat_tok, tok, vocab):
    """() -> held-out numbers: code loss and head agreement, and on held-out copy rows (spans
    and tasks) how often the model's argmax is the token an induction target points at."""
    import mlx.core as mx

    gen = np.random.default_rng(base.SEED + 1)
    code = mx.array(np.stack([held[s:s + 130] for s in gen.integers(0, len(held) - 130, size=8)]))
    spans = [span_row(held, np.random.default_rng(99 + i), vocab, 256, **SPANS["induction"]) for i in range(8)]
    span_batch = batch_arrays([r for r, _, _ in spans], [(q, k) for _, q, k in spans])
    tasks = task_rows(held_files, chat_tok, tok, 4, random.Random(base.SEED + 12))
    task_batch = batch_arrays([r for r, _ in tasks], [task_targets(*t) for t in tasks])

    def copied(batch):
        tokens, rows, queries, keys, weights = batch
        probs.clear()
        logits, _ = base.forward(parts, head, tokens)
        hit = (mx.argmax(logits, -1)[rows, queries] == tokens[rows, keys]).astype(mx.float32)
        hard = (weights > 1).astype(mx.float32)
        hard_hits = ((hit * hard).sum() / mx.maximum(hard.sum(), 1.0)).item()
        return hit.mean().item(), attention_loss(probs, rows, queries, keys, weights).item(), hard_hits

    def evaluate() -> dict:
        probs.clear()
        _, ev = base.losses(parts, head, code)
        span_hits, span_attention, _ = copied(span_batch)
        task_hits, task_attention, hard_hits = copied(task_batch)
        return {"heldout_main_ce": ev[0].item(), "heldout_agree": ev[3].item(), "span_copied": span_hits,
                "span_attention": span_attention, "task_copied": task_hits, "task_attention": task_attention,
                "task_hard_copied": hard_hits}

    return evaluate


def export(model, head, cfg, tok, args, run: dict, held) -> None:
    """Write the float32 HF export, with this phase's run appended to training.json."""
    from mlxmtp.models import demo

    model.eval()
    head.eval()
    meta = json.loads((Path(args.hf or demo.PACKAGED) / "training.json").read_text())
    meta["copy_finetune"] = [*meta.get("copy_finetune", []), run]
    out = Path(args.out)
    base.export_hf(model, head, cfg, tok, out, meta)
    run["export_check"] = base.verify_export(model, head, out, held)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"exported to {out}", flush=True)


def cmd_measure(args) -> None:
    import mlx_lm

    from mlxmtp.models import demo, demo_tasks

    model, tok = mlx_lm.load(str(args.model or demo.PACKAGED))
    rates = {kind: copy_rate(model, tok, demo_tasks.held_out_tasks(kind, args.tasks)) for kind in demo_tasks.KINDS}
    print(json.dumps({k: round(v, 3) for k, v in rates.items()}))


def _kinds(text: str) -> list:
    """`--kinds`: comma-separated task kinds, each one of demo_tasks.KINDS."""
    from mlxmtp.models.demo_tasks import KINDS

    kinds = text.split(",")
    if not set(kinds) <= set(KINDS):
        raise argparse.ArgumentTypeError(f"kinds are {', '.join(KINDS)}; got {text}")
    return kinds


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for phase in PHASES:
        t = sub.add_parser(phase)
        t.add_argument("--hf", default=None, help="float32 HF export to start from (default: the packaged demo)")
        t.add_argument("--out", required=True)
        t.add_argument("--seed", type=int, default=None, help="of the rows drawn (default: the phase's)")
        t.add_argument("--steps", type=int, default=None, help="(default: the phase's)")
        t.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the phase's)")
        t.add_argument("--hard", type=int, default=1, help="weigh ambiguous answer positions (HARD_WEIGHT)")
        t.add_argument("--kinds", default=None, type=_kinds,
                       help="task kinds to draw, comma-separated, repeats weigh more (default: all alike)")
        t.set_defaults(phase=phase, run=cmd_train)
    m = sub.add_parser("measure")
    m.add_argument("--model", default=None)
    m.add_argument("--tasks", type=int, default=12)
    m.set_defaults(run=cmd_measure)
    args = p.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
