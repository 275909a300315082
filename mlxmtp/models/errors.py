"""What loading a model can fail with: each error's message says what and why in one line,
which the commands print as is."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """The model cannot be loaded (no such folder or repo, not a model, unreadable files);
    the message says which and why, in one line the CLIs print as is."""


class MTPLoadError(ModelLoadError):
    """The model has no usable MTP head; the message says why and how to repair it."""


class MissingMTPHeadError(MTPLoadError):
    pass
