"""Everything mlxmtp takes from mlx-lm, in one package: no other module of mlxmtp imports
mlx-lm (mlxmtp/testing may still call its converter to build fixtures).

- families/: one file per supported family (its layer classes, what mlxmtp patches in
  them, its Hugging Face tensor conventions);
- family.py: which family a checkpoint is, where its parts live in the mlx-lm model, the
  layer classes the MTP head is built from;
- adapter.py: the engine's forward pass over mlx-lm's model classes, and new caches;
- model_cache.py: a model's per-layer caches and every operation on them (rollback,
  batching, snapshots, sizes, the file layout);
- ragged_cache.py: the attention KV cache with a per-row end;
- gdn_capture.py: the recorder that keeps what a Gated DeltaNet rollback needs;
- loading.py: loading models, configs and tokenizers;
- token_text.py: a tokenizer's text exactly (its streaming detokenizer, a token's bytes);
- sampling.py: mlx-lm's samplers and logits processors, and its own generation loop (the
  baseline the benchmarks compare against).

Tested with mlx-lm 0.32.x (pinned in pyproject): if mlx-lm changes its Qwen model files,
this package is what to revisit. mlx-lm takes seconds to import, so modules that
`mlxmtp inspect` or the CLI's start-up reach import it on use.
"""
