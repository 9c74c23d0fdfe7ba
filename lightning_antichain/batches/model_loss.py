"""A loss the model computes itself, joined over micro-batches into exactly the whole batch's loss.

Hugging Face users call ``model(input_ids, labels=labels)`` and train on ``.loss``: a mean over
the label tokens that are not ``-100``. A mean per micro-batch, averaged, is not the whole batch's
mean when micro-batches hold different numbers of such tokens (padding). Hugging Face's own
Trainer meets the same problem in gradient accumulation, and passes ``num_items_in_batch``: each
micro-batch's loss is then its sum over tokens divided by the whole batch's count, and the
micro-batch losses add up to the whole batch's loss. :func:`with_items_in_batch` does the same.

Any other loss (a mean over samples) is joined by :class:`WeightedSum` weights that the pipeline
finds and checks on the first call (:func:`join_weights`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..capture.signature import original_forward
from ..weights.initialization import is_hugging_face_model

IGNORE_INDEX = -100
COUNTED_LOSSES = {"ForCausalLMLoss": 1, "ForMaskedLMLoss": 0, "ForTokenClassification": 0}
"""Hugging Face loss functions that divide by ``num_items_in_batch``, by name, with how far labels
are shifted before they are counted (a causal LM predicts token t + 1 from token t)."""

ITEMS = "num_items_in_batch"


@dataclass(frozen=True)
class WeightedSum:
    """How a 0-dim output (a loss) of each micro-batch joins: ``sum(w * value)``; the gradient
    of micro-batch m is ``w[m]`` times the whole output's."""

    weights: tuple[float, ...]


def with_items_in_batch(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args, kwargs`` with ``num_items_in_batch`` added, where ``module`` is a Hugging Face model
    (or a peft model around one) whose loss divides by it and the call gives ``labels`` (and not
    the count already): the number of label tokens of the whole batch that count, as a 0-dim
    tensor every micro-batch receives."""
    if ITEMS in kwargs:
        return args, kwargs
    counted = counted_items(module, args, kwargs)
    return (args, kwargs) if counted is None else (args, {**kwargs, ITEMS: counted})


def counted_items(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The number of label tokens that count in a call of ``module`` (a 0-dim tensor), where it is
    a Hugging Face model (or a peft model around one) whose loss is their mean (it divides by
    ``num_items_in_batch``) and the call gives ``labels``; ``None`` for any other module or call."""
    base = getattr(module, "get_base_model", None)  # peft's PeftModel passes its keywords on
    model = base() if callable(base) and not is_hugging_face_model(module) else module
    if not isinstance(model, nn.Module) or not is_hugging_face_model(model):
        return None
    try:
        loss = getattr(model.loss_function, "__name__", None)  # by loss_type, or the causal LM's by default
    except Exception:  # a model without Hugging Face's loss mapping
        return None
    if loss not in COUNTED_LOSSES:
        return None
    labels = kwargs.get("labels")
    if labels is None:
        try:
            labels = inspect.signature(original_forward(module)).bind(*args, **kwargs).arguments.get("labels")
        except TypeError:
            return None
    takes_more = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(original_forward(module))
                     .parameters.values())
    if not isinstance(labels, torch.Tensor) or not takes_more:
        return None
    shift = COUNTED_LOSSES[loss]
    shifted = kwargs.get("shift_labels")
    counted = shifted if isinstance(shifted, torch.Tensor) else labels[..., shift:]
    return (counted != IGNORE_INDEX).sum()


def is_items_in_batch(value: Any, kwargs: dict) -> bool:
    """Whether ``value`` is the count :func:`with_items_in_batch` put into ``kwargs``."""
    return ITEMS in kwargs and value is kwargs[ITEMS]


def join_weights(sizes: Sequence[int | None], summed: bool) -> WeightedSum:
    """The weights of micro-batch losses: 1 each where each is already divided by the whole
    batch's count (``summed``), else each micro-batch's share of the samples (a mean over samples)."""
    if summed:
        return WeightedSum(tuple(1.0 for _ in sizes))
    total = sum(n or 0 for n in sizes)
    return WeightedSum(tuple((n or 0) / total for n in sizes))


def joins_as(parts: Sequence[torch.Tensor], whole: torch.Tensor, weights: WeightedSum) -> bool:
    """Whether ``whole`` (one run on the parts' samples together) is ``parts`` joined by ``weights``,
    to the rounding of its dtype."""
    joined = sum(w * p.to(whole.device, torch.float64) for w, p in zip(weights.weights, parts))
    rtol = 1e-9 if whole.dtype == torch.float64 else 1e-4
    return bool(torch.isclose(joined, whole.to(torch.float64), rtol=rtol, atol=1e-12))
