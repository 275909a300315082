"""The model side: loading an mlx-lm model with its MTP head, and the head itself.

Loading (`load.load` is the entry point; each step is a file of its own):
- model_folder.py: where a model's folder is (here, the demo's, or fetched) and whether it is one;
- hub.py: fetching from the Hugging Face Hub;
- backbone.py: the model and tokenizer as mlx-lm loads them;
- head_source.py: where the MTP head's weights are, and reading them;
- head_build.py: the `MTPHead` built from them and checked against the model;
- attach.py: the head attached to the model, or MTP off and why;
- mtp_model.py: `MTPModel`, what `load` returns;
- errors.py: what loading fails with;
- inspection.py: what `mlxmtp inspect` prints (configs and headers only).

The head: mtp_head.py (the module), head_layouts.py (HF tensor layouts -> its naming),
draft_vocab.py (the drafter's trimmed vocabulary). Also generation_config.py (the model's
recommended sampling) and demo.py / demo_prompts.py (the packaged demo model).
"""
