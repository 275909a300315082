"""Decode speed of answers held to a JSON schema (structured output), MTP against mlx-lm.

A held request runs llguidance's grammar as a logits processor (server/structured_output.py):
on every verified position and every draft, with a host round trip per cycle (processors
need the tokens). Side by side in one run, greedy, the same held tokens on every side:
mlx-lm's `stream_generate` with the same processor, mlxmtp with MTP off, fixed depths and
adaptive depth, and mlxmtp adaptive on the same prompt without a schema (free text, for
what the grammar costs). Turns of 16 tokens alternate as in bench/decode.py.

    python bench/structured_output.py                  # demo model, 3 rounds
    python bench/structured_output.py --model PATH --rounds 5 --max-tokens 200
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import mlx_lm
from decode import PROMPTS, interleaved, model_path

from mlxmtp.engine.batch import BatchGenerator
from mlxmtp.engine.config import EngineConfig
from mlxmtp.engine.generate import stream_generate
from mlxmtp.engine.sampling.params import SamplingParams
from mlxmtp.models.load import load
from mlxmtp.server.structured_output import grammar_for, grammar_processor, serve_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "summary", "steps"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "summary": {"type": "string"},
                         "steps": {"type": "array", "items": {"type": "string"}, "maxItems": 8}}}
SETTINGS = [("MTP off", 0), ("k=2", 2), ("k=3", 3), ("adaptive", None), ("adaptive, free text", "free")]


def held(tok, prompt, grammar):
    return [grammar_processor(grammar, len(prompt))]


def mlx_lm_side(ref, tok, prompt, n, grammar):
    def tokens():
        for _ in mlx_lm.stream_generate(ref, tok, prompt, max_tokens=n, logits_processors=held(tok, prompt, grammar)):
            yield 1
        yield None

    return tokens(), None


def mlxmtp_side(model, tok, prompt, n, grammar, k):
    engine = BatchGenerator(model, tok, EngineConfig(enable_mtp=k != 0,
                                                     num_draft=k if isinstance(k, int) and k else None))
    procs = [] if k == "free" else held(tok, prompt, grammar)

    def tokens():
        for ev in stream_generate(model, tok, prompt, max_tokens=n, engine=engine,
                                  params=SamplingParams(logits_processors=procs)):
            yield len(ev.token_ids)
        yield None

    return tokens(), engine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo", help='"demo", "demo-4bit", or a path or Hub id')
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=150)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, tmp)[0]
        model, tok = load(path)
        ref, _ = mlx_lm.load(str(path))
        serve_tokenizer(tok, model.parts.args.vocab_size)
        grammar = grammar_for(SCHEMA, "bench")
        ratios = {name: [] for name, _ in SETTINGS}
        for r in range(args.rounds):
            prompt = tok.apply_chat_template([{"role": "user", "content": "Describe this code as JSON:\n"
                                               + PROMPTS[r % len(PROMPTS)]}],
                                             add_generation_prompt=True, enable_thinking=False)
            sides = [mlx_lm_side(ref, tok, prompt, args.max_tokens, grammar)]
            sides += [mlxmtp_side(model, tok, prompt, args.max_tokens, grammar, k) for _, k in SETTINGS]
            result = interleaved(sides)
            for (name, _), res in zip(SETTINGS, result[1:]):
                ratios[name].append(res["tps"] / result[0]["tps"])
            print(f"round {r}: mlx-lm held {result[0]['tps']:.1f} tok/s, {result[0]['tokens']} tokens timed")
        print("| setting (held to a schema, greedy) | vs mlx-lm held | range |\n|---|---|---|")
        for name, vals in ratios.items():
            print(f"| {name} | {statistics.median(vals):.2f}x | {min(vals):.2f}-{max(vals):.2f} |")


if __name__ == "__main__":
    main()
