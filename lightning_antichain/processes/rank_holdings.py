"""What a rank of the process runtime holds, and what it writes to a checkpoint.

A rank trains its own stages only: the other stages' parameters are released to the meta device
(reading one fails loudly, instead of giving a value training never changed). Each rank saves its
own share of a checkpoint (its stages' tensors and optimizer state) as shards, which rank 0 joins
where one file is asked for; a stage's replicas hold the same values, and the first replica writes
them. :meth:`RankHoldings.gathered_state` gathers the weights whole on rank 0 instead, for
``strategy.full_state_dict()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..capture.pytrees import iter_tensors
from ..lightning.runtime import Holdings, Host
from ..plans.layout import Layout
from ..weights.held_elsewhere import equal_by_identity, mark_held_by
from ..weights.materialize import release_tensors
from .process_pipeline import ProcessPipeline
from .replication import is_shard


class HeldBy(Protocol):
    """The runtime whose rank holds the state: its strategy, its stages (``pipeline``, once
    built), its steps (``steps.module``: the LightningModule) and its ranks' layout."""

    strategy: Host
    steps: Any

    @property
    def pipeline(self) -> ProcessPipeline | None: ...

    @property
    def layout(self) -> Layout: ...


class RankHoldings(Holdings):
    """What a rank of :class:`~.process_runtime.ProcessRuntime` trains and what it saves."""

    sharded_by_default = True
    spread = True

    def __init__(self, runtime: HeldBy) -> None:
        self.runtime = runtime

    @property
    def strategy(self) -> Host:
        return self.runtime.strategy

    @property
    def pipeline(self) -> ProcessPipeline | None:
        return self.runtime.pipeline

    @property
    def steps(self) -> Any:
        return self.runtime.steps

    @property
    def layout(self) -> Layout:
        return self.runtime.layout

    def gathered_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The LightningModule's ``state`` (keys of its ``state_dict``) whole on rank 0: each
        stage's tensors from the rank that trains them. Every rank calls it."""
        if self.pipeline is None or self.steps is None:
            return state  # no step yet: every rank holds the same values
        parts = gathered({key: state[key] for key in self._owned_keys() if key in state and self._writes()})
        merged = dict(state)
        for part in parts:
            merged.update(part)
        return type(state)(merged) if parts else state

    def own_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's share of ``state`` (keys of the LightningModule's ``state_dict``) in a
        checkpoint: what its stages train, and on rank 0 also what no stage holds."""
        if self.pipeline is None or self.steps is None:
            return state if self.strategy.global_rank == 0 else type(state)()
        owned = self._owned_keys()
        keeps = self._share(owned)
        # a replica's part of a sharded tensor is its own to write, whichever replica it is
        return type(state)((k, v) for k, v in state.items() if keeps(k) or (k in owned and is_shard(v)))

    def own_optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's share of ``optimizer``'s ``state_dict`` in a checkpoint: the state of the
        parameters it steps, on rank 0 also of those no stage holds."""
        mine = self.stepped(optimizer)
        if mine is None:
            return state if self.strategy.global_rank == 0 else {**state, "state": {}}
        keeps = self._share(mine)
        return {**state, "state": {i: v for i, v in state["state"].items()
                                   if keeps(i) or (i in mine and any(is_shard(t) for t in iter_tensors(v)))}}

    def stepped(self, optimizer: Any) -> set[int] | None:
        """The indices in ``optimizer``'s ``state_dict`` of the parameters this rank steps
        (``None`` before the stages are built: every rank holds every one alike)."""
        if self.pipeline is None:
            return None
        owned = self._mine()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {i for i, p in enumerate(params) if id(p) in owned}

    def _owned_keys(self) -> set[str]:
        """The LightningModule's ``state_dict`` keys whose tensors this rank trains (:meth:`_mine`)."""
        assert self.pipeline is not None and self.steps is not None
        owned = self._mine()
        return {key for key, value in self.steps.module.state_dict(keep_vars=True).items()
                if isinstance(value, torch.Tensor) and id(value) in owned}

    def _mine(self) -> set[int]:
        """The ids of the LightningModule's parameters and buffers this rank trains and saves: those
        its stages use, and, on the rank of the last stage, those no stage uses (a head or a loss
        outside ``module=``, which the step uses after the module's call, there)."""
        assert self.pipeline is not None and self.steps is not None
        mine = self.pipeline.owned()
        if self.pipeline.holds_last:
            module = self.steps.module
            mine |= {id(t) for t in [*module.parameters(), *module.buffers()] if id(t) not in self.pipeline.staged}
        return mine

    def hold_own_only(self) -> None:
        """Free what this rank does not train: the parameters and buffers of other ranks' stages,
        and, but on the last stage's rank, the trainable parameters no stage uses. They go to the
        meta device in place, so that reading one fails loudly instead of giving a value training
        never changed; their optimizer state goes too. (Buffers and frozen parameters outside the
        stages stay: the step may read them before it calls the module.)"""
        assert self.pipeline is not None and self.steps is not None
        module, mine, staged = self.steps.module, self._mine(), self.pipeline.staged
        named = [*module.named_parameters(), *module.named_buffers()]
        holders: dict[str, int] = {}
        for rank, names in enumerate(everyone(sorted(n for n, t in named if id(t) in mine))):
            for name in names:
                holders.setdefault(name, rank)
        others = [(n, t) for n, t in named if id(t) not in mine and not t.is_meta and (
            id(t) in staged or (isinstance(t, nn.Parameter) and t.requires_grad))]
        gone = {id(t) for _, t in others}
        for optimizer in self.strategy.optimizers:
            for param in [p for p in optimizer.state if id(p) in gone]:
                del optimizer.state[param]
        release_tensors([t for _, t in others], module)
        for name, tensor in others:
            if name in holders:
                mark_held_by(tensor, holders[name])
        equal_by_identity()

    def _share(self, mine: set[Any]) -> Callable[[Any], bool]:
        """Which keys this rank writes to a checkpoint: ``mine``, and on rank 0 those no rank's
        stages hold. Every rank calls it (it gathers every rank's ``mine``)."""
        staged = set().union(*everyone(mine))
        first, writes = self.strategy.global_rank == 0, self._writes()
        return lambda key: (writes and key in mine) or (first and key not in staged)

    def _writes(self) -> bool:
        """Whether this rank's stages go into checkpoints: the first replica's do, the others hold
        the same values (each stage's replicas are kept in step)."""
        return self.layout.replica(self.strategy.global_rank) == 0


def gathered(part: Any) -> list[Any]:
    """Every rank's ``part``, on rank 0; an empty list elsewhere."""
    parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part, parts, dst=0)
    return parts or []


def everyone(part: Any, group: Any = None) -> list[Any]:
    """Every rank's ``part`` (of ``group``, default all), on every rank, by rank."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, part, group=group)
    return parts
