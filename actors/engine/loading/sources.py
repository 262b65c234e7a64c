"""Where a model comes from: a local directory, a GGUF file, or a Hugging Face Hub id.

``model_source`` classifies what the user wrote (``model.path``, a draft or scorer
model); ``hub_snapshot`` finds a hub id's snapshot in the Hugging Face cache
(``HF_HOME`` / ``HF_HUB_CACHE``) and downloads it only when it is not there, so a
cached model never touches the network, and with ``HF_HUB_OFFLINE`` set a missing
one is a one-line error. Plain Python: huggingface_hub is imported only to fetch
(it reads ``HF_HUB_OFFLINE`` once, at import).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

# huggingface_hub's repo-name rule (``validate_repo_id``), with exactly one slash: ORG/NAME.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.\-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"(?P<repo>{_PART}/{_PART})(?:@(?P<revision>[^\s@]+))?")

# The files an MLX checkpoint needs (weights, config, tokenizer, processor, template);
# never the PyTorch / GGUF copies many repositories also hold, nor remote code.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "*.txt",
    "*.jsonl",
    "*.tiktoken",
    "tokenizer.model",
]


@dataclass(frozen=True)
class ModelSource:
    """What a model path names: ``local`` dir, ``gguf`` file, ``hub`` id, or ``missing``."""

    kind: Literal["local", "gguf", "hub", "missing"]
    text: str
    path: Path  # as written, ``~`` expanded
    repo: str = ""  # hub
    revision: str | None = None  # hub: a branch, tag or commit; None = main


def model_source(text: str) -> ModelSource:
    """Classify a model path as written: an existing path wins over a hub id."""
    path = Path(text).expanduser()
    if path.exists():
        return ModelSource("gguf" if path.suffix == ".gguf" else "local", text, path)
    match = _HUB_ID.fullmatch(text)
    if match and ".." not in text and "--" not in match["repo"] and path.suffix != ".gguf":
        return ModelSource("hub", text, path, repo=match["repo"], revision=match["revision"])
    return ModelSource("missing", text, path)


def is_hub_id(text: str) -> bool:
    return bool(text) and model_source(text).kind == "hub"


def hub_snapshot(source: ModelSource, progress: Callable[[str], None]) -> Path:
    """The snapshot directory of a hub id: from the cache, else downloaded (unless offline)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(
            source.repo, revision=source.revision, allow_patterns=ALLOW_PATTERNS,
            local_files_only=True,
        )  # fmt: skip
    except LocalEntryNotFoundError:
        if constants.is_offline_mode():
            raise FileNotFoundError(
                f"model not found: {source.text} (not a local path, not in the Hugging Face "
                f"cache {constants.HF_HUB_CACHE}, and HF_HUB_OFFLINE is set)"
            ) from None
        return check_snapshot(download(source, progress), source.text, downloaded=True)
    progress(f"{source.text}: using the cached snapshot {snapshot}")
    return check_snapshot(Path(snapshot), source.text, downloaded=False)


def download(source: ModelSource, progress: Callable[[str], None]) -> Path:
    """Fetch a hub id's MLX files into the cache (huggingface_hub draws the progress bars)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    progress(f"downloading {source.text} from {constants.ENDPOINT} into {constants.HF_HUB_CACHE}")
    try:
        snapshot = snapshot_download(
            source.repo, revision=source.revision, allow_patterns=ALLOW_PATTERNS
        )
    except (HfHubHTTPError, LocalEntryNotFoundError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FileNotFoundError(
            f"model not found: {source.text} (not a local path; from "
            f"{constants.ENDPOINT}: {type(exc).__name__}: {first})"
        ) from None
    progress(f"downloaded {source.text} to {snapshot}")
    return Path(snapshot)


def check_snapshot(snapshot: Path, name: str, *, downloaded: bool) -> Path:
    """A snapshot that can load: a ``config.json`` and every weight file its index names."""
    if not (snapshot / "config.json").is_file():
        raise FileNotFoundError(
            f"{name}: no config.json in {snapshot}: not an MLX (mlx-lm / mlx-vlm) model repository"
        )
    index = snapshot / "model.safetensors.index.json"
    shards = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else ()
    missing = sorted(s for s in shards if not (snapshot / s).is_file())
    if missing or not any(snapshot.glob("*.safetensors")):
        why = (
            "not an MLX model repository?"
            if downloaded
            else "an interrupted download? Run again online to complete it"
        )
        raise FileNotFoundError(
            f"{name}: the snapshot {snapshot} lacks weights "
            f"({', '.join(missing) or 'no .safetensors file'}); {why}"
        )
    return snapshot
