"""Fetching a model from the Hugging Face Hub: the one place mlxmtp downloads, through
huggingface_hub (whose cache makes a second load offline)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from huggingface_hub import constants as hf_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

from ..checkpoint import hf_head, mtp_folder
from .errors import ModelLoadError

# Fetched with every model, whatever weight files a rank needs: configs, the tokenizer, and
# the head's own files (mlxmtp's mtp/ folder, other tools' sidecars: every rank holds the head).
CONFIG_FILES = ["*.json", "*.py", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt", f"{mtp_folder.FOLDER}/*",
                *hf_head.SIDECARS]


def hub_snapshot(repo_id: str, patterns: list, revision: Optional[str] = None, tqdm_class=None) -> Path:
    """The files of a Hugging Face repo matching `patterns`, through huggingface_hub (the
    one place mlxmtp fetches; `tqdm_class`: its download bars, huggingface_hub's own by
    default). A name that is a path (no such folder here) or a fetch that fails is a
    ModelLoadError."""
    if _names_a_path(repo_id):
        raise ModelLoadError(f"no such model folder: {repo_id}")
    bars = {"tqdm_class": tqdm_class} if tqdm_class is not None else {}
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns, **bars))
    except HFValidationError:
        raise ModelLoadError(f"{repo_id} is neither a model folder nor a Hugging Face repo id") from None
    except LocalEntryNotFoundError as e:
        raise ModelLoadError(f"cannot fetch {repo_id} from Hugging Face, and it is not in the local cache "
                             f"({str(e).strip().splitlines()[0]}); nor is it a folder here. "
                             + _fetch_hint(repo_id)) from e
    except (HfHubHTTPError, OSError, ValueError) as e:  # no such repo, no access, a disk error
        why = " ".join(str(e).split()) or type(e).__name__
        raise ModelLoadError(f"cannot fetch {repo_id} from Hugging Face: {why}; nor is it a folder here") from e


def _fetch_hint(repo_id: str) -> str:
    """What to do about a repo that is neither fetched nor cached: the network, or offline
    mode (HF_HUB_OFFLINE), stands in the way."""
    offline = getattr(hf_constants, "is_offline_mode", lambda: hf_constants.HF_HUB_OFFLINE)()
    if offline:
        return (f"Hugging Face's offline mode is on (HF_HUB_OFFLINE): fetch it once with `hf download {repo_id}` "
                "with the variable unset")
    return f"Check the network, or fetch it first with `hf download {repo_id}`"


def _names_a_path(name: str) -> bool:
    """Whether a missing model name can only be meant as a path: absolute, relative to
    `.` or `~`, more than one folder deep, or `owner/name` where a folder `owner` exists
    here (`models/qwen` beside the other models, not a repo of a user called models)."""
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        return True
    return "/" in name and Path(name).parent.is_dir()
