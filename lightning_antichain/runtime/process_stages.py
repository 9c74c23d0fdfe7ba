"""Stages as ``torch.distributed.pipelining`` runs them: one process each, tensors in, tensors out.

torch's ``PipelineStage`` sends a stage's outputs to the next stage only, and takes only tensors.
The stages the split makes (:func:`~.split.split_stages`) already fit: each takes every value
crossing the cut before it, the ones it does not read included, and returns every value crossing
the cut after it, so a skip tensor is passed through each stage it spans. :class:`FlatStage` is
that stage as a module of tensors, for torch's schedules (GPipe, 1F1B, interleaved, zero-bubble),
which run it in the process of its rank. This is the first piece of the process runtime: the
strategy does not use it yet.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..capture.pytrees import flatten
from .split import StageModule


class CutValueError(TypeError):
    """A value crossing a cut is not a tensor: torch's stages send tensors only."""


class FlatStage(nn.Module):
    """``stage`` as a module whose arguments are the tensors crossing the cut before it, in the
    order of ``stage.inputs``, and whose outputs are those crossing the cut after it, in the order
    of ``stage.outputs`` (one tensor alone where there is one). Its parameters are the stage's own
    modules' (registered here, so torch's stage and optimizers see them)."""

    def __init__(self, stage: StageModule) -> None:
        super().__init__()
        self.stage = stage
        self.graph = stage.module  # registers the stage's modules and parameters

    def forward(self, *values: torch.Tensor) -> Any:
        if len(values) != len(self.stage.inputs):
            raise CutValueError(f"stage {self.stage.index} takes {len(self.stage.inputs)} values "
                                f"({', '.join(self.stage.inputs)}), got {len(values)}")
        leaves, _ = self.stage(*flatten(tuple(values)))
        outside = [(name, type(v).__name__) for name, v in zip(self.stage.outputs, leaves)
                   if not isinstance(v, torch.Tensor)]
        if outside or len(leaves) != len(self.stage.outputs):
            raise CutValueError(
                f"stage {self.stage.index} passes on values that are not single tensors "
                f"({outside or 'nested values'}); torch.distributed.pipelining sends tensors only. Cut "
                "elsewhere (a fixed balance=), or keep the operation that makes them with its readers."
            )
        return leaves[0] if len(leaves) == 1 else tuple(leaves)
