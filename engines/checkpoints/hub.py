"""Checkpoints named by Hugging Face repo id: ``nvidia/personaplex-7b-v1[@revision]``.

``resolve_checkpoint`` turns what an operator wrote (``PERSONAPLEX_CHECKPOINT``, a tool's
``--checkpoint`` or ``--hf-repo``) into a local checkpoint directory:

- an existing directory is used as it is;
- ``owner/name`` or ``owner/name@revision`` (a branch, tag or commit) is a snapshot in the
  standard Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``), downloaded on first use with
  only the files a checkpoint needs (the LM, Mimi and tokenizer files that ``config.json``
  names or the PersonaPlex defaults, ``voices.tgz``, ``voices/*.pt``): not the web client or
  anything else in the repository.  ``HF_TOKEN`` (or a saved ``hf auth login``) is used for
  gated repositories; ``HF_HUB_OFFLINE=1`` uses the cache alone; downloads show progress bars
  unless ``HF_HUB_DISABLE_PROGRESS_BARS=1``.  ``voices.tgz`` is unpacked once into
  ``voices/`` beside it in the snapshot.

Every failure is a ``CheckpointError`` whose message says what to do (accept the licence,
set ``HF_TOKEN``, go online, fix the name).  Torch-free: the settings check names with it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engines import progress
from engines.config import CONFIG_FILE, LM_FILE, MIMI_FILE, TOKENIZER_FILE, VOICES_ARCHIVE, VOICES_DIR
from engines.errors import CheckpointError

log = logging.getLogger(__name__)

DEFAULT_REPO = "nvidia/personaplex-7b-v1"
# owner/name[@revision]; Hugging Face names are letters, digits, '-', '_' and '.'.
_REPO_REF = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")
_TRUE = ("1", "true", "yes", "on")
# config.json keys of Kyutai's layout that name the checkpoint's files.
_NAMED_FILES = {"moshi_name": LM_FILE, "mimi_name": MIMI_FILE, "tokenizer_name": TOKENIZER_FILE, "mimi_config_name": None}


@dataclass(frozen=True)
class RepoRef:
    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")

    @property
    def url(self) -> str:
        return f"{_endpoint()}/{self.repo_id}"


def parse_repo_ref(value: str) -> RepoRef | None:
    """``value`` as ``owner/name[@revision]``, or None when it is not one or names an existing
    path (a local directory of that name wins)."""
    if Path(value).expanduser().exists():
        return None
    match = _REPO_REF.fullmatch(value.strip())
    if match is None or ".." in value:
        return None
    return RepoRef(match["repo"], match["revision"])


def resolve_checkpoint(value: str | Path | None, *, cache_dir: str | Path | None = None) -> Path | None:
    """A local checkpoint directory for ``value`` (None stays None: the embedded default)."""
    if value is None:
        return None
    text = str(value)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    ref = parse_repo_ref(text)
    if ref is None:
        raise CheckpointError(f"checkpoint {text!r} is neither a directory nor a Hugging Face repo id "
                              f"(owner/name[@revision], e.g. {DEFAULT_REPO})")
    return download(ref, cache_dir=cache_dir, local_name=text)


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set: the cache alone, no network."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE


def local_checkpoint(value: str) -> Path | None:
    """What ``resolve_checkpoint`` would give without fetching anything: the directory
    ``value`` names, or a repo id's snapshot already in the local Hugging Face cache (None
    when it is not there, or ``value`` is neither)."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path
    ref = parse_repo_ref(value)
    if ref is None:
        return None
    import huggingface_hub

    def cached(name: str) -> str | None:
        found = huggingface_hub.try_to_load_from_cache(ref.repo_id, name, revision=ref.revision)
        return found if isinstance(found, str) else None

    lm_file = LM_FILE  # or the one the checkpoint's config.json names
    config = cached(CONFIG_FILE)
    if config is not None:
        try:
            named = json.loads(Path(config).read_text(encoding="utf-8") or "{}").get("moshi_name")
        except (OSError, ValueError, AttributeError):
            named = None
        lm_file = named if isinstance(named, str) else LM_FILE
    found = cached(lm_file)
    return Path(found).parent if found is not None else None


def download(ref: RepoRef, *, cache_dir: str | Path | None = None, local_name: str | None = None) -> Path:
    """The snapshot of ``ref`` with the files a checkpoint needs (downloaded as needed)."""
    import huggingface_hub
    from huggingface_hub import errors

    offline = hub_offline()
    progress.report(progress.CHECKPOINT, f"{ref} from the Hugging Face cache" if offline else f"downloading {ref}")
    try:
        patterns = _needed_files(ref, cache_dir, offline)
        log.info("checkpoint %s: %s (%s)", ref,
                 "looking in the local cache only (HF_HUB_OFFLINE)" if offline else "downloading what is missing",
                 ", ".join(patterns))
        snapshot = Path(huggingface_hub.snapshot_download(ref.repo_id, revision=ref.revision, cache_dir=cache_dir,
                                                          allow_patterns=patterns, local_files_only=offline,
                                                          endpoint=_endpoint()))
    except errors.GatedRepoError:
        raise CheckpointError(f"{ref.repo_id} is gated: accept its licence at {ref.url} (logged in to Hugging "
                              f"Face), then set HF_TOKEN to a read token of that account ({_token_state()})") from None
    except errors.RevisionNotFoundError:
        raise CheckpointError(f"{ref.repo_id} has no revision {ref.revision!r} (a branch, tag or commit)") from None
    except errors.RepositoryNotFoundError:  # 401 too: the Hub answers it for missing, private and gated repos
        here = f"; there is no directory {local_name!r} here either" if local_name else ""
        raise CheckpointError(f"{ref.repo_id} was not found at {_endpoint()}, or it is gated or private and "
                              f"{_token_state()}: check the name; for a gated repo accept its licence at {ref.url} "
                              f"and set HF_TOKEN{here}") from None
    except errors.LocalEntryNotFoundError as exc:
        if offline:
            raise CheckpointError(f"{ref} is not in the local Hugging Face cache ({_cache_dir(cache_dir)}) and "
                                  "HF_HUB_OFFLINE is set: download it once with network access (or unset "
                                  "HF_HUB_OFFLINE)") from None
        if isinstance(exc.__cause__, errors.HfHubHTTPError):  # the Hub answered, with a refusal
            raise _refused(ref, exc.__cause__) from None
        raise CheckpointError(f"cannot reach {_endpoint()} to download {ref}, and it is not in the local cache "
                              f"({_cache_dir(cache_dir)}): check the network (or HF_ENDPOINT), or copy the "
                              "checkpoint and name its directory instead") from None
    except errors.HfHubHTTPError as exc:
        raise _refused(ref, exc) from None
    except OSError as exc:
        raise CheckpointError(f"cannot download {ref} into {_cache_dir(cache_dir)}: {exc}") from None
    unpack_voices(snapshot)
    return snapshot


def _needed_files(ref: RepoRef, cache_dir: str | Path | None, offline: bool) -> list[str]:
    """The files of the checkpoint: the ones ``config.json`` names, or PersonaPlex's."""
    import huggingface_hub
    from huggingface_hub import errors

    names = {CONFIG_FILE, LM_FILE, MIMI_FILE, TOKENIZER_FILE, VOICES_ARCHIVE, f"{VOICES_DIR}/*.pt"}
    try:
        config = huggingface_hub.hf_hub_download(ref.repo_id, CONFIG_FILE, revision=ref.revision, cache_dir=cache_dir,
                                                 local_files_only=offline, endpoint=_endpoint())
    except errors.EntryNotFoundError:
        # No config.json (PersonaPlex's names then), or none to be had offline: the snapshot
        # download says whether the checkpoint itself is there.
        return sorted(names)
    try:
        raw = json.loads(Path(config).read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        raw = {}
    if isinstance(raw, dict):
        for key, default in _NAMED_FILES.items():
            if isinstance(raw.get(key), str):
                names.discard(default)
                names.add(raw[key])
    return sorted(names)


def unpack_voices(root: Path) -> None:
    """Unpack ``voices.tgz`` into ``voices/`` beside it, once (a ``voices/`` already there
    is kept).  Only ``.pt`` files, by their base name: nothing lands outside ``voices/``."""
    archive, target = root / VOICES_ARCHIVE, root / VOICES_DIR
    if not archive.is_file() or target.is_dir():
        return
    staging = Path(tempfile.mkdtemp(prefix=".voices-", dir=root))
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if member.isfile() and name.endswith(".pt") and not name.startswith("."):
                    source = tar.extractfile(member)
                    if source is not None:
                        (staging / name).write_bytes(source.read())
        staging.rename(target)  # atomic: another process unpacking at once loses the race harmlessly
        log.info("unpacked %s into %s", archive, target)
    except (tarfile.TarError, OSError) as exc:
        if not target.is_dir():
            raise CheckpointError(f"cannot unpack {archive}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _refused(ref: RepoRef, exc: Exception) -> CheckpointError:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status == 403:
        return CheckpointError(f"{ref.repo_id}: access denied (403): the account of HF_TOKEN has not accepted the "
                               f"licence at {ref.url}, or the token lacks read access to gated repositories")
    return CheckpointError(f"cannot download {ref}: {_first_line(exc)}")


def _token_state() -> str:
    from huggingface_hub import get_token

    return "HF_TOKEN is set but has no access" if get_token() else "HF_TOKEN is not set"


def _endpoint() -> str:
    # Read at each call (huggingface_hub reads HF_ENDPOINT once, at its import).
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _cache_dir(cache_dir: str | Path | None) -> str:
    if cache_dir is not None:
        return str(cache_dir)
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _first_line(exc: BaseException) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
