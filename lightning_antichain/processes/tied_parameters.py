"""Parameters that the stages of several ranks use, kept as one parameter across the processes.

Tied weights (an input embedding shared with the output layer: GPT-2, Gemma, Llama 3.2, T5) put
one parameter in the first and the last stage. With one process per stage each rank that uses it
holds a copy. As Megatron's embedding group and DeepSpeed's ``TiedLayerSpec`` do, the copies start
equal (the lowest rank's values), and before each optimizer step their gradients are summed over
the ranks that hold them, so each rank's optimizer takes the same step from the same state and the
copies stay equal, to the bit, as the one parameter of plain training.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class TiedParameters:
    """This rank's share of the parameters used by several ranks (``holders``: the ranks using each
    parameter, by its id; ``params``: the parameters, by id; ``names``: their names, which order
    them alike in every process). Every rank must build it at once: it makes a process group per
    set of ranks sharing parameters (each waiting at most ``timeout``)."""

    def __init__(self, holders: dict[int, tuple[int, ...]], params: dict[int, nn.Parameter],
                 names: dict[int, str], rank: int, timeout: timedelta | None = None) -> None:
        by_ranks: dict[tuple[int, ...], list[nn.Parameter]] = {}
        for key, ranks in holders.items():
            if len(ranks) > 1:
                by_ranks.setdefault(ranks, []).append(params[key])
        self.rank = rank
        self.groups: list[tuple[tuple[int, ...], list[nn.Parameter], Any]] = []
        for ranks in sorted(by_ranks):
            group = dist.new_group(list(ranks), timeout=timeout)  # every rank makes every group, in one order
            if rank in ranks:
                self.groups.append((ranks, sorted(by_ranks[ranks], key=lambda p: names[id(p)]), group))

    def share_values(self) -> None:
        """Give every copy the lowest holding rank's values."""
        with torch.no_grad():
            for ranks, params, group in self.groups:
                for param in params:
                    dist.broadcast(param.data, src=ranks[0], group=group)

    def sum_gradients(self) -> None:
        """Sum each copy's gradient over the ranks that hold it (a rank whose stages did not reach it
        adds zeros)."""
        for _, params, group in self.groups:
            for param in params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=group)

    def counted_elsewhere(self) -> set[int]:
        """The ids of the copies whose gradient a lower rank counts in a norm over every rank."""
        return {id(p) for ranks, params, _ in self.groups if ranks[0] != self.rank for p in params}
