"""Checkpoints as a directory of ``torch.distributed.checkpoint`` shards, each rank writing its own.

With one process per stage no rank holds the whole model, so none should gather it to save. Each
rank writes its stages' weights and optimizer state under the plain module's names and indices;
rank 0 adds ``meta.pt`` with the rest of Lightning's checkpoint (epoch, loops, callbacks,
hyper-parameters), laid out as Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy`` lay
theirs. Reading goes by name, so a checkpoint written by one stage count, schedule or runtime loads
into any other: each rank reads only the tensors its stages hold, and a model on meta reads each
one only when its stage makes it real.

Plain Lightning loads a file, not a directory: ``lightning-antichain consolidate DIR`` writes the
same checkpoint as one ``.ckpt``.
"""

from __future__ import annotations

import shutil
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from ..torch_private import load_state_dict_planned

META_FILE = "meta.pt"
"""Lightning's name for the file beside the shards that holds everything but weights and optimizer
state (``lightning.fabric.utilities.load._METADATA_FILENAME``)."""

SHARDED_KEYS = ("state_dict", "optimizer_states")
"""The parts of a Lightning checkpoint that every rank writes its own share of."""


INDEX_FILE = ".metadata"
"""torch.distributed.checkpoint's index of the shards, written last."""


class DamagedCheckpointError(ValueError):
    """A checkpoint is not whole: a file it needs is missing, cut short or unreadable."""


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory of shards written by :func:`save_sharded`."""
    path = Path(path)
    return path.is_dir() and (path / META_FILE).is_file() and (path / INDEX_FILE).is_file()


def check_checkpoint(path: str | Path) -> None:
    """Make sure the checkpoint at ``path`` is whole before anything reads it, naming what is not:
    for a directory of shards, its index (``.metadata``) and ``meta.pt`` are there and readable,
    and every shard file the index points into holds the bytes it points at; a file must not be
    cut short. Cheap: sizes and the ends of zip archives, no tensor is read."""
    path = Path(path)
    if not path.exists():
        raise DamagedCheckpointError(f"there is no checkpoint at {path}: give the path of a .ckpt file or of a "
                                     "directory of shards a run with schedule= saved")
    if path.is_file():
        _check_file(path, "the checkpoint")
        return
    missing = [name for name in (INDEX_FILE, META_FILE) if not (path / name).is_file()]
    if missing:
        raise _damaged(path, f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing: the save did "
                             f"not finish ({INDEX_FILE} is written last, {META_FILE} by rank 0 after it), or "
                             f"{'the file was' if len(missing) == 1 else 'files were'} removed")
    _check_file(path / META_FILE, f"the directory {path}'s")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as error:  # noqa: BLE001 - whatever unpickling a damaged index raises
        raise _damaged(path, f"its index {INDEX_FILE} cannot be read ({type(error).__name__}: {error})") from error
    needed: dict[str, int] = {}
    for info in getattr(metadata, "storage_data", {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise _damaged(path, f"the shard {name} is missing (the index points into it)")
        size = shard.stat().st_size
        if size < end:
            raise _damaged(path, f"the shard {name} is cut short: it holds {size} bytes where the index reads up to "
                                 f"byte {end}")


def _check_file(path: Path, what: str) -> None:
    with open(path, "rb") as file:
        head = file.read(4)
    if head == b"PK\x03\x04" and not zipfile.is_zipfile(path):  # torch.save's zip archive, its end missing
        raise _damaged(path.parent if what != "the checkpoint" else path,
                       f"{path.name} is cut short ({path.stat().st_size} bytes, the end of its archive missing)")


def _damaged(path: Path, what: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(
        f"the checkpoint {path} is damaged: {what}. Nothing was loaded from it. Resume from another checkpoint "
        "(an earlier one, or the last one copied again in full); a checkpoint of shards that is whole loads under "
        "any schedule and layout, and `lightning-antichain consolidate DIR` turns one into a single .ckpt")


def save_sharded(checkpoint: dict[str, Any], path: Path) -> None:
    """Write ``checkpoint`` at ``path`` (a directory): its :data:`SHARDED_KEYS` parts as this
    rank's shards, the rest into ``meta.pt`` from rank 0. Every rank calls it, each with its own
    share (keys another rank also writes must hold the same values there)."""
    first = is_first_rank()
    if first:  # the others' first write waits for rank 0's plan, made after this
        if path.is_file():
            path.unlink()
        path.mkdir(parents=True, exist_ok=True)
    shards = {key: checkpoint[key] for key in SHARDED_KEYS if key in checkpoint}
    with warnings.catch_warnings():  # one process (the in-process runtime) saving alone is meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(shards, checkpoint_id=path, no_dist=not dist.is_initialized())
    if first:
        torch.save({k: v for k, v in checkpoint.items() if k not in SHARDED_KEYS}, path / META_FILE)


def remove_sharded(path: str | Path) -> None:
    """Remove the shards at ``path`` (from rank 0), where one file is saved instead."""
    if is_first_rank() and is_sharded_checkpoint(path):
        shutil.rmtree(path)


def is_first_rank() -> bool:
    """Whether this process writes what every rank holds alike: global rank 0, or the only one."""
    return not dist.is_initialized() or dist.get_rank() == 0


class ShardedCheckpoint:
    """The shards at a directory, read on demand and by name: nothing is read until asked for."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        check_checkpoint(self.path)
        self._metadata: Metadata = FileSystemReader(self.path).read_metadata()
        #: each flat key's place in the nested checkpoint, e.g. ``("state_dict", "layer.0.weight")``
        self.places: dict[str, tuple] = dict(self._metadata.planner_data)

    def keys_under(self, *prefix: Any) -> list[str]:
        """The flat keys whose place starts with ``prefix``."""
        n = len(prefix)
        return [k for k, place in self.places.items() if tuple(place[:n]) == prefix]

    def read(self, keys: list[str]) -> dict[str, Any]:
        """The values of the flat ``keys``: tensors and the other values saved (steps, settings)."""
        if not keys:
            return {}
        target: dict[str, Any] = {}
        for key in keys:
            stored = self._metadata.state_dict_metadata[key]
            if isinstance(stored, TensorStorageMetadata):
                target[key] = torch.empty(stored.size, dtype=stored.properties.dtype)
            else:
                assert isinstance(stored, BytesStorageMetadata)
                target[key] = None
        try:
            load_state_dict_planned(target, storage_reader=FileSystemReader(self.path), no_dist=True)
        except Exception as error:  # torch's CheckpointException names ranks, not files
            files = sorted({self._metadata.storage_data[i].relative_path for i in self._metadata.storage_data
                            if i.fqn in keys})
            said = str(error).strip().splitlines()[-1] if str(error).strip() else ""
            raise _damaged(self.path, f"reading {', '.join(files) or 'its shards'} failed ({type(error).__name__}: "
                                      f"{said})") from error
        return target

    def state_dict(self) -> ShardedStateDict:
        """The model's weights: a mapping of the plain module's names that reads each one lazily."""
        return ShardedStateDict(self)

    def optimizer_states(self) -> ShardedOptimizerStates:
        return ShardedOptimizerStates(self)

    def lazy(self) -> dict[str, Any]:
        """Lightning's checkpoint with its weights and optimizer states still on disk: a
        :class:`ShardedStateDict` and :class:`ShardedOptimizerStates` (where saved) in their places."""
        checkpoint: dict[str, Any] = torch.load(self.path / META_FILE, map_location="cpu", weights_only=False)
        checkpoint["state_dict"] = self.state_dict()
        states = self.optimizer_states()
        if len(states):
            checkpoint["optimizer_states"] = states
        return checkpoint

    def whole(self) -> dict[str, Any]:
        """The whole checkpoint as plain Lightning saves it in one file."""
        checkpoint = self.lazy()
        checkpoint["state_dict"] = checkpoint["state_dict"].read_all()
        states = checkpoint.get("optimizer_states")
        if states is not None:
            checkpoint["optimizer_states"] = [states.read(i) for i in range(len(states))]
        return checkpoint


class ShardedStateDict(Mapping[str, torch.Tensor]):
    """A checkpoint's ``state_dict`` at a directory of shards; a value is read when it is got."""

    def __init__(self, shards: ShardedCheckpoint) -> None:
        self.shards = shards
        self._flat = {shards.places[k][1]: k for k in shards.keys_under("state_dict")}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.shards.read([self._flat[name]])[self._flat[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._flat)

    def __len__(self) -> int:
        return len(self._flat)

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every weight, read at once (one pass over the files, not one per name)."""
        values = self.shards.read(list(self._flat.values()))
        return {name: values[key] for name, key in self._flat.items()}

    def entries(self) -> dict[str, tuple[tuple[int, ...], Callable[[], torch.Tensor]]]:
        """Each name's shape and how to read it, for :func:`~lightning_antichain.weights.materialize.load_lazily`."""
        sizes = self.shards._metadata.state_dict_metadata
        return {name: (tuple(sizes[key].size), _reader(self, name)) for name, key in self._flat.items()}  # type: ignore[union-attr]


class ShardedOptimizerStates:
    """A checkpoint's ``optimizer_states`` at a directory of shards, read per optimizer and per
    parameter index, so a rank reads only the state of the parameters it steps."""

    def __init__(self, shards: ShardedCheckpoint) -> None:
        self.shards = shards
        self._count = len({shards.places[k][1] for k in shards.keys_under("optimizer_states")})

    def __len__(self) -> int:
        return self._count

    def read(self, optimizer: int, indices: set[int] | None = None) -> dict[str, Any]:
        """Optimizer ``optimizer``'s ``state_dict``, with the state of the parameters at ``indices``
        (every one saved when ``None``)."""
        shards = self.shards
        keys = [k for k in shards.keys_under("optimizer_states", optimizer)
                if shards.places[k][2] != "state" or indices is None or int(shards.places[k][3]) in indices]
        values = shards.read(keys)
        state: dict[str, Any] = {"state": {}, "param_groups": []}
        for key, value in values.items():
            _put(state, shards.places[key][2:], value)
        state["state"] = {int(index): per for index, per in sorted(state["state"].items(), key=lambda kv: int(kv[0]))}
        return state


def _put(nested: dict[str, Any], place: tuple, value: Any) -> None:
    """Set ``value`` at ``place`` (dict keys and list indices) in ``nested``, making what is missing."""
    node: Any = nested
    for step, after in zip(place[:-1], place[1:]):
        default: Any = [] if isinstance(after, int) else {}
        if isinstance(node, list):
            while len(node) <= step:
                node.append(None)
            if node[step] is None:
                node[step] = default
            node = node[step]
        else:
            node = node.setdefault(step, default)
    last = place[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _reader(state: ShardedStateDict, name: str) -> Callable[[], torch.Tensor]:
    return lambda: state[name]
