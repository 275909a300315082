"""The on-disk formats of an MTP head, shared by the loader and the converter.

- `tensor_files`: safetensors headers and tensor reads (the one reader of their layout);
- `hf_head`: HF `mtp.*` tensor names -> MTPHead parameters, and the norm convention
  (+1 on zero-centred RMSNorm weights, exactly once, and the check that it was);
- `mtp_folder`: the `MODEL/mtp/` folder an injected head lives in;
- `token_list`: the draft vocabulary's token list file.

A package of its own, not a module of `models` or `convert`: the loader
(`models/load.py`) reads these formats and the converter (`convert/`) writes them, and
neither should reach into the other for them. It imports nothing else from mlxmtp, so the
layers stay one-way: `checkpoint` <- `models` <- `convert`.
"""
