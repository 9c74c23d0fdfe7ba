"""A disk cache of cost graphs, so a rerun with the same model and shapes skips profiling.

The key covers everything that changes the measurements: the cache format, the traced graph's code, every parameter
and buffer's name, shape and dtype, the example inputs' shapes and dtypes, the device's name, the
autocast dtype, and the torch version. Weights' values do not change costs and are not part of it.

A file can still be damaged or edited, and a plan from a wrong cost graph is a wrong plan. So an
entry is only used if it describes the captured graph exactly (the same operations, the same
dependencies, numbers where numbers belong); otherwise it is ignored with a warning that names the
file, and profiled and written again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import networkx as nx
import torch
from torch import nn

from ..capture import OpGraph
from ..capture.pytrees import iter_tensors
from ..runtime.device import autocast_settings, device_name
from .cost_graph import cost_graph_from_dict, cost_graph_to_dict

# Bumped whenever what the profiler records changes, so older entries are profiled again.
# 3: dependencies from in-place operations (``OpNode.after``) and the ``together`` groups.
# 4: the parallel capacity of CPU stages and the runtime's overheads.
# 5: op times scaled to the measured whole (CPU).
CACHE_VERSION = 6

_NUMBERS = ("forward_s", "backward_s", "output_bytes", "param_bytes", "buffer_bytes")


def default_cache_dir() -> Path:
    """``$LIGHTNING_ANTICHAIN_CACHE``, else ``~/.cache/lightning-antichain``."""
    root = os.environ.get("LIGHTNING_ANTICHAIN_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "lightning-antichain"


def profile_key(graph: OpGraph, module: nn.Module, example: Any, device: torch.device) -> str:
    """A stable hash of what the costs of ``module`` on ``example`` at ``device`` depend on."""
    digest = hashlib.sha256(f"v{CACHE_VERSION}".encode())
    code = graph.graph_module.code if graph.graph_module is not None else repr([n.name for n in graph.nodes])
    digest.update(code.encode())
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    for tensor in iter_tensors(example):
        digest.update(f"in:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    name = device_name(device)
    autocast = [str(dtype) for _, dtype in autocast_settings()]
    digest.update(f"{name}|{autocast}|{torch.__version__}".encode())
    return digest.hexdigest()[:32]


def cache_file(directory: Path, key: str) -> Path:
    """Where the cost graph of ``key`` is cached in ``directory``."""
    return directory / f"{key}.json"


def load_cached(directory: Path, key: str, graph: OpGraph | None = None) -> nx.DiGraph | None:
    """The cached cost graph of ``key``, if there is one and it describes ``graph`` exactly."""
    path = cache_file(directory, key)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        listed = {node["name"] for node in data["nodes"]}  # edges alone would re-create a missing node
        cost = cost_graph_from_dict(data)
        problem = None if graph is None else (
            "it lists operations that are only named by its edges" if listed != set(cost.nodes) else None
        ) or mismatch(cost, graph, data)
    except Exception as exc:  # noqa: BLE001 - any damage: null, [], strings for numbers, bad JSON
        problem = f"it cannot be read ({type(exc).__name__}: {exc})"
    if problem is None:
        return cost
    warnings.warn(f"lightning-antichain: ignoring the cached profile {path}: {problem}. Profiling again.", stacklevel=2)
    return None


def mismatch(cost: nx.DiGraph, graph: OpGraph, data: dict[str, Any]) -> str | None:
    """Why ``cost`` (read from ``data``) is not the cost graph of ``graph`` (``None`` if it is)."""
    expected_nodes = {n.name for n in graph.nodes}
    nodes = set(cost.nodes)
    if nodes != expected_nodes:
        missing, unknown = sorted(expected_nodes - nodes)[:5], sorted(nodes - expected_nodes)[:5]
        return f"its operations differ from the model's (missing {missing}, unknown {unknown})"
    expected_edges = {(src, n.name) for n in graph.nodes for src in (*n.inputs, *n.after)}
    if set(cost.edges) != expected_edges:
        return "its dependencies differ from the model's"
    for attrs in data["nodes"]:
        name = attrs["name"]
        for field in _NUMBERS:
            value = attrs.get(field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                return f"operation {name!r} has {field} = {value!r}, not a non-negative number"
    if sorted(map(sorted, cost.graph.get("together", []))) != sorted(map(sorted, graph.together)):
        return "its groups of operations that must share a stage differ from the model's"
    return None


def store(directory: Path, key: str, graph: nx.DiGraph) -> Path | None:
    """Cache ``graph`` under ``key``; returns the file, or ``None`` where it could not be written
    (a cache that cannot be written only costs profiling again)."""
    path = cache_file(directory, key)
    try:
        write_atomically(path, json.dumps(cost_graph_to_dict(graph), indent=1))
    except OSError as exc:
        _warn_once(directory, f"lightning-antichain: cannot write the profile cache {path} ({exc}); profiles will be "
                              "measured again next time. Set LIGHTNING_ANTICHAIN_CACHE (or profile_cache=) to a "
                              "writable directory.")
        return None
    return path


def write_measurement(path: Path, data: dict[str, Any]) -> None:
    """Save a measurement as JSON in the cache, whole or not at all; a cache that cannot be written
    only costs measuring again."""
    try:
        write_atomically(path, json.dumps(data))
    except OSError:
        pass


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
