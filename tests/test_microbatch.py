"""Scattering batches into micro-batches and gathering outputs back."""

from collections import namedtuple

import pytest
import torch

from lightning_antichain.runtime import microbatch

Pair = namedtuple("Pair", "left right")


def test_nested_structures_round_trip():
    batch = {"x": torch.arange(10).view(10, 1), "pair": Pair(torch.ones(10, 2), [torch.zeros(10), 7]), "tag": "a"}
    parts = microbatch.scatter(batch, 4)
    assert [p["x"].shape[0] for p in parts] == [3, 3, 2, 2]
    assert all(p["tag"] == "a" and p["pair"].right[1] == 7 for p in parts)
    assert isinstance(parts[0]["pair"], Pair)
    back = microbatch.gather(parts)
    assert torch.equal(back["x"], batch["x"])
    assert torch.equal(back["pair"].left, batch["pair"].left)
    assert back["pair"].right[1] == 7 and back["tag"] == "a"


def test_uneven_and_small_batches():
    assert [p.shape[0] for p in microbatch.scatter(torch.zeros(10, 3), 8)] == [2, 2, 1, 1, 1, 1, 1, 1]
    assert len(microbatch.scatter(torch.zeros(3, 3), 8)) == 3  # fewer samples than chunks: fewer chunks


def test_zero_dim_tensors_and_constants_are_shared():
    parts = microbatch.scatter((torch.zeros(6, 2), torch.tensor(2.0), 3.5), 3)
    assert all(p[1].item() == 2.0 and p[2] == 3.5 for p in parts)


def test_mismatched_batch_sizes_are_a_clear_error():
    with pytest.raises(microbatch.MicroBatchError, match=r"different batch sizes \(\[5, 6\]\).*batch_dim="):
        microbatch.scatter((torch.zeros(6, 2), torch.zeros(5, 2)), 2)


def test_scalar_outputs_cannot_be_gathered():
    with pytest.raises(microbatch.MicroBatchError, match="0-dim"):
        microbatch.gather([torch.tensor(1.0), torch.tensor(2.0)])


def test_empty_batch_is_rejected():
    with pytest.raises(microbatch.MicroBatchError, match="empty"):
        microbatch.scatter(torch.zeros(0, 3), 2)
