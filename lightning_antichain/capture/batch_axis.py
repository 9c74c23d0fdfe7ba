"""Which dim of a value carries the batch: the one whose size follows the micro-batch sizes."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def batch_dim_candidates(chunks: Sequence[torch.Tensor], sizes: Sequence[int | None]) -> list[int]:
    """The dims of an output whose size follows the micro-batch sizes while the others stay put.
    More than one (a [3, 3] output of 3-sample micro-batches) means the sizes cannot tell."""
    known = [(c, n) for c, n in zip(chunks, sizes) if n is not None]
    first = chunks[0]
    if not known:
        return [0] if first.dim() > 0 else []
    return [
        d for d in range(first.dim())
        if all(c.dim() == first.dim() and c.shape[d] == n for c, n in known)
        and all(c.shape[:d] + c.shape[d + 1:] == first.shape[:d] + first.shape[d + 1:] for c in chunks)
    ]
