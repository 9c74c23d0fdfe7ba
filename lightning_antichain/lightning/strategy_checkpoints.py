"""How the strategy saves and loads Lightning checkpoints: the plain module's names as CPU tensors,
as a directory of shards each rank writes its part of
(:mod:`~lightning_antichain.weights.sharded_checkpoint`), or as one file. Where ranks hold shares,
the one file is made from such shards: each rank writes its own beside the file, and rank 0 joins
them (``benchmarks/one_file_save.py``: faster than gathering the shares through the process group,
and rank 0 holds no rank's pickled share on top of the whole).

Loading waits where it must: weights for a model still on meta go straight into their stages when
those are made real, and optimizer state is loaded once the stages are placed, when each rank
knows which parameters it steps (from shards it reads only theirs).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..capture.pytrees import map_tensors
from ..processes.replication import full, is_shard
from ..weights.materialize import has_meta_state, load_lazily, load_state_dict
from ..weights.optimizer_state import state_with_parameters
from ..weights.sharded_checkpoint import (
    ShardedCheckpoint,
    ShardedOptimizerStates,
    ShardedStateDict,
    check_checkpoint,
    is_first_rank,
    remove_sharded,
    save_sharded,
)
from .runtime import Holdings

OptimizerStates = list[dict[str, Any]] | ShardedOptimizerStates


class StrategyCheckpoints:
    """The strategy's checkpoint hooks, kept apart from its devices and steps."""

    def __init__(self, holdings: Holdings, sharded: bool) -> None:
        #: what this rank holds (the runtime's)
        self.holdings = holdings
        #: whether a checkpoint is saved as a directory of shards, one share per rank
        self.sharded = sharded
        #: whether each rank saves its own share, as shards (one file too, where ranks hold shares)
        self.by_shares = sharded or holdings.spread
        self._waiting: OptimizerStates | None = None

    def model_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """What this rank saves of the LightningModule's ``state``: all of it (one file, on rank 0)
        or its share (shards). A tensor sharded over replicas (FSDP2's) goes into shards as the
        replicas hold it, each writing its part (``torch.distributed.checkpoint`` records where
        each lies), and into one file whole; either way under its name, so the checkpoint loads
        into any layout."""
        state = type(state)((k, self._saved(v) if isinstance(v, torch.Tensor) and not v.is_meta else v)
                            for k, v in state.items())  # on meta: another rank's stage, saved by that rank
        return self.holdings.own_state(state)

    def whole_model_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The LightningModule's whole ``state``, every tensor whole on the CPU with the value its
        rank trained, on rank 0 (every rank calls it; the others get theirs back as it is)."""
        state = type(state)((k, full(v).detach().cpu() if isinstance(v, torch.Tensor) and not v.is_meta else v)
                            for k, v in state.items())
        return self.holdings.gathered_state(state)

    def _saved(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach() if self.by_shares and is_shard(tensor) else full(tensor).detach().cpu()

    def optimizer_state(self, optimizers: list[Any], optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        """What this rank saves of ``optimizer``'s ``state``; what was loaded, if no step has
        placed the stages to take it yet."""
        if self._waiting is not None:
            i = optimizers.index(optimizer)
            return self._waiting.read(i) if isinstance(self._waiting, ShardedOptimizerStates) else self._waiting[i]
        state = map_tensors(self._saved, state)
        return self.holdings.own_optimizer_state(optimizer, state)

    def one_file(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any,
                 broadcast: Callable[[Any], Any]) -> dict[str, Any] | None:
        """Save ``checkpoint`` (this rank's share) at ``path`` as shards from every rank, if so set
        (``None``); otherwise the whole checkpoint the strategy's ``CheckpointIO`` writes as one
        file from rank 0. Where ranks hold shares, each writes its own as shards in a folder beside
        ``path`` (one every rank sees, as for a checkpoint of shards), which rank 0 joins and
        removes; a failure there stops every rank with rank 0's reason. ``broadcast``: the
        strategy's, rank 0's object to every rank."""
        if self.sharded:
            if storage_options is not None:
                raise TypeError("storage_options= is not taken for a checkpoint of shards; set "
                                "save_distributed_checkpoint=False to save one file through the CheckpointIO")
            save_sharded(checkpoint, Path(path))
            return None
        remove_sharded(path)
        if not self.holdings.spread:
            return checkpoint
        parts = Path(broadcast(str(_parts_folder(path)) if is_first_rank() else None))
        save_sharded(checkpoint, parts)
        whole, failed = checkpoint, None
        if is_first_rank():
            try:
                whole = ShardedCheckpoint(parts).whole()
            except Exception as error:  # noqa: BLE001 - told to every rank below
                failed = f"{type(error).__name__}: {error}"
            finally:
                shutil.rmtree(parts, ignore_errors=True)
        failed = broadcast(failed)
        if failed is not None:
            raise RuntimeError(f"saving the checkpoint {path} as one file failed on rank 0, which joins every "
                               f"rank's share from {parts}: {failed}. Every rank must see that folder: give "
                               "ModelCheckpoint a dirpath on a file system all nodes share")
        return whole

    @staticmethod
    def read(path: str | Path) -> dict[str, Any] | None:
        """The checkpoint at ``path`` if it is a directory of shards, its tensors read when asked
        for; ``None`` for a file. Either is checked whole first (:func:`check_checkpoint`), on
        every rank, so that a damaged one stops every rank with what is wrong, before any reads."""
        if "://" in str(path):  # a remote path: Lightning's CheckpointIO reads it
            return None
        check_checkpoint(path)
        return ShardedCheckpoint(path).lazy() if Path(path).is_dir() else None

    @staticmethod
    def load_model(module: nn.Module, state: Any, strict: bool) -> None:
        """Load the weights; those of a model still on meta wait to go straight into their stages
        (from shards, each read when its stage is made real; for a real model, all at once)."""
        if isinstance(state, ShardedStateDict) and has_meta_state(module):
            load_lazily(module, state.entries(), strict=strict)
        else:
            load_state_dict(module, state.read_all() if isinstance(state, ShardedStateDict) else state, strict=strict)

    def load_optimizers(self, optimizers: list[Any], states: OptimizerStates) -> None:
        """Load ``states`` now, or once the stages are placed (:meth:`stages_placed`): for
        parameters still on meta, which have no device yet, and from shards."""
        # torch puts each state tensor on its parameter's device; Lightning's default would then
        # move all of it to the root device
        if isinstance(states, ShardedOptimizerStates) or any(
                p.is_meta for optimizer in optimizers for g in optimizer.param_groups for p in g["params"]):
            self._waiting = states
            return
        for optimizer, state in zip(optimizers, states):
            optimizer.load_state_dict(state)
        state_with_parameters(optimizers)

    def stages_placed(self, optimizers: list[Any]) -> None:
        """Each stage is real on its device: optimizer state goes beside its parameters (from
        shards, only the state of the parameters this rank steps)."""
        states, self._waiting = self._waiting, None
        for i, optimizer in enumerate(optimizers if states is not None else ()):
            assert states is not None
            state = (states.read(i, self.holdings.stepped(optimizer)) if isinstance(states, ShardedOptimizerStates)
                     else states[i])
            optimizer.load_state_dict(state)
        state_with_parameters(optimizers)


def _parts_folder(path: str | Path) -> Path:
    """Where the ranks' shares of a one-file checkpoint at ``path`` go before rank 0 joins them:
    a hidden folder beside the file, or, for a remote path, a folder of the local disk's."""
    if "://" in str(path):
        return Path(tempfile.mkdtemp(prefix="checkpoint-parts-"))
    path = Path(path)
    return path.with_name(f".{path.name}.parts")
