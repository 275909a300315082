"""Bounds every layer shares (HTTP validation, both CLIs, the engine and its depth policy).

A module without imports, so the CLIs can read them without loading MLX.
"""

MAX_DRAFT_DEPTH = 4  # the deepest draft the MTP head makes
MAX_SUFFIX_DEPTH = 32  # the longest draft the suffix drafter makes (proposers/hybrid.py)
MAX_CYCLE_DEPTH = max(MAX_DRAFT_DEPTH, MAX_SUFFIX_DEPTH)  # the most drafts a cycle verifies
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
# Prompt tokens a prefill chunk takes by default: how long the batch's decoding may wait
# for one chunk of a long prompt, against each chunk's own overheads.
PREFILL_STEP = 512
# The prefix cache's folder on disk (serve --prefix-cache-dir) holds at most this many MiB
# by default: a few dozen long agent prompts' states of a large model.
PREFIX_DISK_MB = 32 * 1024
