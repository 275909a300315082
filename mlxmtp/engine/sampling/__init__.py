"""Sampling and acceptance: how each row's tokens are drawn and its drafts kept, exactly.

params.py: `SamplingParams`, a request's fields, and their ranges (the one place the
range rules live). row.py: `RowSampler`, one request's processors, filters and key, over
ops.py (the compiled array steps). batch.py: `BatchSampling`, one cycle's batch, decided
once: greedy, vectorised or row by row, for the draft picks, the accept step and first
tokens alike. accept.py: the accept step (`VerifyMetadata`, `accept`), the draft picker
and the first token; rejection.py: the acceptance rules; seeded.py: reproducible seeds;
logprobs.py: logprob tables.

Nothing is imported here: import each module by its path.
"""
