"""Read a checkpoint file, or a directory of shards, into a model that may be on the meta device.

People bring weights as a ``torch.save`` file (``.pt``, ``.bin``, ``.pth``, ``.ckpt``), a
safetensors file, or a directory of safetensors (or ``.bin``) shards with an index file
(``model.safetensors.index.json``), as Hugging Face saves a large model, or a directory of
``torch.distributed.checkpoint`` shards, as a run with one process per stage saves. Every format is read
lazily: the files are memory-mapped, and a tensor is read from disk only when its stage makes it
real on its own device (:mod:`.materialize`), so no device and no host ever holds the whole model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .materialize import IncompatibleKeys, Read, load_lazily
from .sharded_checkpoint import ShardedCheckpoint

Entries = dict[str, tuple[tuple[int, ...], Read]]

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
INDEX_NAMES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def load_checkpoint(model: nn.Module, path: str | Path, strict: bool = True) -> IncompatibleKeys:
    """Load the weights at ``path`` into ``model``, lazily where ``model`` is on meta.

    ``path`` is a ``torch.save`` file of a state dict (or of a Lightning checkpoint, whose
    ``state_dict`` is taken), a ``.safetensors`` file, or a directory holding one of them,
    shards with an index (``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``),
    or ``torch.distributed.checkpoint`` shards (a checkpoint saved with ``schedule=``).
    Returns the missing and unexpected keys, as ``Module.load_state_dict`` does; ``strict`` refuses
    either. A tied weight counts as loaded when any of its names is in the file (Hugging Face
    saves ``lm_head.weight`` tied to the embedding under one name only), and stays tied. Values are
    cast to each tensor's dtype.
    """
    return load_lazily(model, checkpoint_entries(Path(path)), strict)


def checkpoint_entries(path: Path) -> Entries:
    """Each key's shape and how to read it, from the file or directory at ``path``."""
    if path.is_dir():
        return _directory_entries(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}: give a .pt/.bin/.safetensors file, or a directory of "
                                "shards with their index file")
    if path.suffix == ".safetensors":
        return _safetensors_entries(path)
    if path.suffix in TORCH_SUFFIXES:
        return _torch_entries(path)
    raise ValueError(f"{path.name}: not a checkpoint format this reads ({', '.join(TORCH_SUFFIXES)}, .safetensors, "
                     "or a directory of shards with an index file)")


def _directory_entries(directory: Path) -> Entries:
    if (directory / ".metadata").is_file():  # torch.distributed.checkpoint shards, as process-mode runs save
        return ShardedCheckpoint(directory).state_dict().entries()
    for name in INDEX_NAMES:
        index = directory / name
        if index.exists():
            weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
            entries: Entries = {}
            for shard in sorted(set(weight_map.values())):
                found = checkpoint_entries(directory / shard)
                entries.update((k, v) for k, v in found.items() if weight_map.get(k) == shard)
            return entries
    singles = sorted(p for p in directory.iterdir() if p.suffix == ".safetensors") or sorted(
        p for p in directory.iterdir() if p.suffix in TORCH_SUFFIXES)
    if len(singles) != 1:
        raise FileNotFoundError(
            f"{directory} holds no index file ({' or '.join(INDEX_NAMES)}) and "
            f"{'no' if not singles else len(singles)} weight files; give the file itself, or add the index")
    return checkpoint_entries(singles[0])


def _safetensors_entries(path: Path) -> Entries:
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise ImportError(f"reading {path.name} needs the safetensors package: pip install safetensors") from exc
    handle = safe_open(str(path), framework="pt", device="cpu")  # memory-mapped; kept open by the readers
    return {key: (tuple(handle.get_slice(key).get_shape()), _reader(handle.get_tensor, key)) for key in handle.keys()}


def _torch_entries(path: Path) -> Entries:
    try:
        loaded: Any = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError:  # written before torch's zip format, which memory-mapping needs
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]  # a Lightning checkpoint
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ValueError(f"{path.name} does not hold a state dict (a mapping of names to tensors)")
    return {key: (tuple(value.shape), _reader(loaded.__getitem__, key)) for key, value in loaded.items()}


def _reader(get: Callable[[str], torch.Tensor], key: str) -> Read:
    return lambda: get(key)
