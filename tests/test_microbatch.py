"""Scattering batches into micro-batches and gathering outputs back."""

from collections import namedtuple

import pytest
import torch

from lightning_antichain.batches import microbatch

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


def test_per_sample_lists_split_with_the_samples_where_asked():
    """A DataLoader collates per-sample strings into a list: with ``lists=True`` (a step run per
    micro-batch) it is split with the tensors; other lists and plain values reach every part."""
    batch = {"x": torch.arange(10.0).view(10, 1), "names": [f"n{i}" for i in range(10)], "size": (32, 32),
             "pair": Pair(torch.arange(10), [f"m{i}" for i in range(10)])}
    parts = microbatch.scatter(batch, 4, lists=True)
    assert [p["names"] for p in parts] == [["n0", "n1", "n2"], ["n3", "n4", "n5"], ["n6", "n7"], ["n8", "n9"]]
    assert [p["x"].flatten().tolist() for p in parts][2] == [6.0, 7.0] and parts[3]["pair"].right == ["m8", "m9"]
    assert all(p["size"] == (32, 32) for p in parts) and isinstance(parts[0]["pair"], Pair)
    assert all(p["names"] == batch["names"] for p in microbatch.scatter(batch, 4))  # not asked: whole


def test_step_results_join_into_the_whole_batchs():
    """What a step returns per micro-batch, as its whole batch's: tensors on the dim that follows
    the samples, per-sample lists concatenated, a floating-point scalar as the sample-weighted
    mean, the same value once; values that differ and cannot be joined are refused."""
    sizes = [3, 3, 2, 2]
    x = torch.arange(10.0)
    parts = microbatch.scatter({"x": x, "names": [str(i) for i in range(10)]}, 4, lists=True)
    results = [{"y": p["x"].view(-1, 1) * 2, "t": p["x"].view(1, -1), "names": p["names"], "batch": 7,
                "mean": p["x"].mean(), "pair": (p["x"], None)} for p in parts]
    joined = microbatch.join_results(results, sizes)
    assert torch.equal(joined["y"], x.view(-1, 1) * 2) and torch.equal(joined["t"], x.view(1, -1))
    assert joined["names"] == [str(i) for i in range(10)] and joined["batch"] == 7 and joined["pair"][1] is None
    assert joined["mean"].item() == pytest.approx(x.mean().item())
    with pytest.raises(microbatch.MicroBatchError, match="differ between micro-batches"):
        microbatch.join_results([1, 2, 3, 4], sizes)
    with pytest.raises(microbatch.MicroBatchError, match="no dim that follows"):
        microbatch.join_results([torch.ones(5) * i for i in range(4)], sizes)


def test_each_replica_gets_its_share_of_every_batch_in_the_samplers_order():
    """Batches of 5 from 12 samples (5, 5, 2) shared by 2 replicas: 3 and 2, 3 and 2, 1 and 1;
    a last batch smaller than the replicas is refused, saying to drop it."""
    from lightning_antichain.processes.replica_batches import ReplicaBatches

    order = [11, 3, 7, 0, 5, 9, 1, 2, 10, 4, 6, 8]
    shares = [list(ReplicaBatches(order, 5, False, 2, r)) for r in (0, 1)]
    assert shares == [[[11, 3, 7], [9, 1, 2], [6]], [[0, 5], [10, 4], [8]]]
    assert list(ReplicaBatches(order, 5, True, 2, 1)) == [[0, 5], [10, 4]]
    assert len(ReplicaBatches(order, 5, True, 2, 0)) == 2 and len(ReplicaBatches(order, 5, False, 2, 0)) == 3
    with pytest.raises(ValueError, match="cannot be shared by 3 pipeline replicas.*drop_last=True"):
        list(ReplicaBatches(order, 5, False, 3, 0))
