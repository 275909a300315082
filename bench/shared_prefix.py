"""Conversations that share one long system prompt, through a real `mlxmtp serve`.

Coding agents open many conversations (sessions, subagents) with the same system prompt
and tool definitions, thousands of tokens long. Each conversation here is one chat
request: that system prompt plus its own short user message, greedy, one output token,
sent one after another. Prints, per conversation, the prompt tokens, how many of them the
prefix cache restored (`usage.prompt_tokens_details.cached_tokens`) and the time to the
first token. The first prefills everything, storing the state where its system prompt
ends on the way (the request's shared_prefix); from the second on only the user message is
prefilled.

    python bench/shared_prefix.py                       # demo model, 4 conversations
    python bench/shared_prefix.py --model PATH --rules 200 --conversations 6
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import httpx

QUESTIONS = ["Write a function that reverses a list.", "Explain recursion briefly.",
             "How do I read a file in Python?", "What is a closure?", "Sort a dict by value.",
             "What does yield do?"]


def start_server(port: int, model) -> subprocess.Popen:
    args = [sys.executable, "-m", "mlxmtp.commands", "serve", "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(args + (["--model", model] if model else []), stdout=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not start")


def conversation(port: int, system: str, question: str) -> tuple:
    """-> (prompt tokens, cached prompt tokens, seconds to the first token)."""
    t = time.perf_counter()
    body = {"model": "m", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    usage = r.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the packaged demo model")
    ap.add_argument("--rules", type=int, default=60, help="length of the system prompt, in rules of ~30 tokens")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--port", type=int, default=8317)
    args = ap.parse_args()
    system = "You are a coding agent. " + " ".join(
        f"Rule {i}: keep functions short, name things clearly, test edge case {i}." for i in range(args.rules))
    proc = start_server(args.port, args.model)
    try:
        print("| conversation | prompt tokens | restored from the cache | time to first token |")
        print("|---|---|---|---|")
        for i in range(args.conversations):
            n, cached, seconds = conversation(args.port, system, QUESTIONS[i % len(QUESTIONS)] + f" ({i})")
            print(f"| {i + 1} | {n} | {cached} | {seconds:.2f} s |")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
