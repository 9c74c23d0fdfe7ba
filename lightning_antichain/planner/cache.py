"""The one disk cache of measurements: profiles, the runtime's overheads and calibrations.

Every entry is JSON in one directory (``$LIGHTNING_ANTICHAIN_CACHE``, else
``~/.cache/lightning-antichain``), named ``<kind>-<key>.json``. One key scheme: the key hashes the
kind, its format version (bumped whenever what is measured changes, so older entries are measured
again) and everything the measurement depends on. One writer: whole or not at all, and a cache
that cannot be written only costs measuring again. One validation: an entry is used only if the
kind's parser accepts it; a damaged or edited entry is ignored with a warning that names the file,
and measured and written again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

#: the format version of each kind of entry
FORMATS = {
    # 7: gradient accumulation's rate; 6: op times scaled to the measured whole (CPU); 4: parallel capacity and
    # overheads; 3: in-place dependencies
    "profile": 7,
    # 2: gradient accumulation's rate
    "overhead": 2,
    "calibration": 3,
}

NOUNS = {"profile": "profile", "overhead": "runtime overhead", "calibration": "calibration"}


def default_cache_dir() -> Path:
    """``$LIGHTNING_ANTICHAIN_CACHE``, else ``~/.cache/lightning-antichain``."""
    root = os.environ.get("LIGHTNING_ANTICHAIN_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "lightning-antichain"


def entry_key(kind: str, *depends_on: Any) -> str:
    """The key of an entry of ``kind`` measured under ``depends_on`` (JSON-encodable values)."""
    text = json.dumps([kind, FORMATS[kind], *depends_on], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def entry_path(directory: Path, kind: str, key: str) -> Path:
    """Where the entry ``key`` of ``kind`` is kept in ``directory``."""
    return directory / f"{kind}-{key}.json"


def read_entry(directory: Path, kind: str, key: str, parse: Callable[[Any], T]) -> T | None:
    """The entry, as ``parse`` (which raises on anything wrong with it) makes it from its JSON; ``None``
    where there is none, or, with a warning naming the file, where it is damaged."""
    path = entry_path(directory, kind, key)
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        return parse(json.loads(text))
    except Exception as exc:  # noqa: BLE001 - any damage: null, [], strings for numbers, bad JSON, a wrong graph
        problem = str(exc) if isinstance(exc, DamagedEntry) else f"it cannot be read ({type(exc).__name__}: {exc})"
    warnings.warn(f"lightning-antichain: ignoring the cached {NOUNS[kind]} {path}: {problem}. Measuring again.",
                  stacklevel=2)
    return None


class DamagedEntry(ValueError):
    """What is wrong with a cache entry, said as the rest of a warning's sentence."""


def write_entry(directory: Path, kind: str, key: str, data: Any) -> Path | None:
    """Keep ``data`` as the entry ``key`` of ``kind``; returns the file, or ``None`` (with one warning)
    where it could not be written."""
    path = entry_path(directory, kind, key)
    try:
        write_atomically(path, json.dumps(data, indent=1))
    except OSError as exc:
        _warn_once(directory, f"lightning-antichain: cannot write the cache {path} ({exc}); it will be measured "
                              "again next time. Set LIGHTNING_ANTICHAIN_CACHE (or profile_cache=) to a writable "
                              "directory.")
        return None
    return path


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: written to a file of its own beside it, then
    renamed over it, so concurrent writers never mix and readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def usable_cache_dir(directory: Path) -> Path | None:
    """``directory`` if the cache can be written there; else a directory of this user's under the
    system's temporary directory, or ``None`` (no cache), with one warning that says so. Containers
    and clusters often run with a home directory that cannot be written."""
    fallback = Path(tempfile.gettempdir()) / f"lightning-antichain-{_user()}"
    reason = ""
    for candidate in (directory, fallback):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=candidate):
                pass
        except OSError as exc:
            if candidate == directory:
                reason = f"{type(exc).__name__}: {exc}"
            continue
        if candidate != directory:
            _warn_once(directory, f"lightning-antichain: the profile cache {directory} cannot be written ({reason}); "
                                  f"using {candidate} instead. Set LIGHTNING_ANTICHAIN_CACHE (or profile_cache=) to a "
                                  "writable directory to keep profiles across machines' restarts.")
        return candidate
    _warn_once(directory, f"lightning-antichain: neither the profile cache {directory} ({reason}) nor {fallback} can "
                          "be written; profiling without a cache. Set LIGHTNING_ANTICHAIN_CACHE (or profile_cache=) "
                          "to a writable directory.")
    return None


_warned: set[str] = set()


def _warn_once(directory: Path, message: str) -> None:
    if str(directory) not in _warned:
        _warned.add(str(directory))
        warnings.warn(message, stacklevel=3)


def _user() -> str:
    try:
        return str(os.getuid())
    except AttributeError:  # not on POSIX
        return os.environ.get("USERNAME", "user")
