"""The draft vocabulary's token list: the special tokens and a corpus's most frequent tokens.

FastMTP's idea (llama.cpp cut Qwen3.5's 248K-row MTP lm_head to 32K rows for a 3.7x
faster draft step): the head only ever drafts tokens from a short list, and the main
model still verifies every draft, so output stays exact; only acceptance can drop.

File `draft_vocab.json`, beside the head (MODEL/mtp/ when the model has an `mtp/`
folder, else wherever the user puts it):

    {"format": "mlxmtp-draft-vocab", "format_version": 1, "vocab_size": V,
     "num_special": S, "corpus": [file names], "corpus_tokens": T, "token_ids": [...]}

`token_ids` is ordered: the special tokens first (ascending ids), then the corpus's
tokens by count (most frequent first, ties by lower id), then, if the corpus had too
few distinct tokens, unseen ids in ascending order (BPE ids roughly follow merge
order). So its first n ids are the list of size n: one file serves every size up to
its length.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from itertools import chain
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

from . import mtp_folder

FILE = "draft_vocab.json"
FORMAT = "mlxmtp-draft-vocab"
FORMAT_VERSION = 1
CHUNK_CHARS = 1 << 20  # tokenize big files a piece at a time (lines kept whole)


class DraftVocabError(ValueError):
    """A token list that cannot be made, read or used with this model."""


def check_token_ids(ids: Sequence, vocab_size: int) -> List[int]:
    """The ids as sorted ints; refuses non-integers, duplicates and ids outside [0, vocab_size)."""
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DraftVocabError("draft vocabulary token ids must be integers")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise DraftVocabError(f"draft vocabulary has token ids outside [0, {vocab_size}) (e.g. {bad[0]}): "
                              "was the list made for another model?")
    if len(set(ids)) != len(ids):
        raise DraftVocabError("draft vocabulary lists a token id twice")
    if not ids:
        raise DraftVocabError("draft vocabulary is empty")
    return sorted(ids)


def special_ids(tokenizer) -> List[int]:
    """EOS ids (config, generation_config and tokenizer: mlx-lm's TokenizerWrapper merges
    them), the tokenizer's special tokens and its added tokens (<think>, <tool_call>, ...)."""
    ids = set(getattr(tokenizer, "eos_token_ids", None) or ())
    ids.update(getattr(tokenizer, "all_special_ids", None) or ())
    ids.update((getattr(tokenizer, "added_tokens_decoder", None) or {}).keys())
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if isinstance(getattr(tokenizer, name, None), int):
            ids.add(getattr(tokenizer, name))
    return sorted(i for i in ids if isinstance(i, int))


def _chunks(text: str) -> Iterable[str]:
    start = 0
    while start < len(text):
        end = text.find("\n", start + CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        yield text[start:end]
        start = end


def count_tokens(tokenizer, files: Sequence[Path]) -> Counter:
    """Token counts over the files' UTF-8 text (undecodable bytes replaced)."""
    counts: Counter = Counter()
    for f in files:
        text = Path(f).read_text(encoding="utf-8", errors="replace")
        for chunk in _chunks(text):
            counts.update(tokenizer.encode(chunk, add_special_tokens=False))
    return counts


def make_token_list(tokenizer, files: Sequence[Path], size: int, vocab_size: int) -> Tuple[List[int], dict]:
    """(ids in file order, the file's other fields) for a list of `size` tokens."""
    n_tokens = min(len(tokenizer), vocab_size)  # rows past the tokenizer are padding
    if not 0 < size < vocab_size or size > n_tokens:
        raise DraftVocabError(f"--size must be below the vocabulary size ({vocab_size}) and at most the "
                              f"tokenizer's {n_tokens} tokens, got {size}")
    specials = [i for i in special_ids(tokenizer) if i < vocab_size]
    if size < len(specials):
        raise DraftVocabError(f"--size {size} cannot hold the {len(specials)} special tokens")
    counts = count_tokens(tokenizer, files)
    ids, seen = list(specials), set(specials)
    by_count = sorted(counts, key=lambda t: (-counts[t], t))
    for t in chain(by_count, range(n_tokens)):
        if len(ids) == size:
            break
        if t not in seen and 0 <= t < n_tokens:
            ids.append(t)
            seen.add(t)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "vocab_size": vocab_size,
            "num_special": len(specials), "corpus": [Path(f).name for f in files],
            "corpus_tokens": sum(counts.values())}
    return ids, meta


def write_token_list(path: Path, ids: List[int], meta: dict) -> Path:
    """Write the list atomically (a temporary sibling, fsync, one rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".draft_vocab-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps({**meta, "size": len(ids), "token_ids": ids}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; the model's readers need it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_token_list(path: Path, size: int, vocab_size: int) -> List[int]:
    """The first `size` ids of a list file, checked against a model of `vocab_size` rows."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DraftVocabError(f"cannot read the draft vocabulary {path}: {e}") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
        raise DraftVocabError(f"{path} is not an mlxmtp draft vocabulary of format version {FORMAT_VERSION}")
    if data.get("vocab_size") != vocab_size:
        raise DraftVocabError(f"{path} was made for a vocabulary of {data.get('vocab_size')} tokens, "
                              f"this model has {vocab_size}")
    ids = data.get("token_ids")
    if not isinstance(ids, list) or len(ids) < size:
        raise DraftVocabError(f"{path} holds {len(ids) if isinstance(ids, list) else 0} tokens, fewer than "
                              f"the {size} asked for: rebuild it with mlxmtp draft-vocab --size {size}")
    if size < data.get("num_special", 0):
        raise DraftVocabError(f"a draft vocabulary of {size} tokens cannot hold the list's "
                              f"{data['num_special']} special tokens")
    return check_token_ids(ids[:size], vocab_size)


def default_path(model_dir: Path) -> Optional[Path]:
    """Where the list lives by default: in the model's `mtp/` folder, if it has one."""
    return Path(model_dir) / mtp_folder.FOLDER / FILE if mtp_folder.has_mtp_folder(model_dir) else None
