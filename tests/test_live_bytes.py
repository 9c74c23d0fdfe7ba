"""The test helper that counts live bytes per device counts what it must (tests/live_bytes.py)."""

import gc

import torch
from live_bytes import LiveBytes
from torch import nn


def test_a_layer_built_under_it_is_counted_until_freed():
    with LiveBytes() as live:
        layer = nn.Linear(1000, 500)
        built = live.live["cpu"]
        del layer
        gc.collect()
        after = live.live["cpu"]
    assert built == (1000 * 500 + 500) * 4
    assert after == 0 and live.peak["cpu"] >= built


def test_views_share_their_storage_and_meta_tensors_hold_nothing():
    with LiveBytes() as live:
        x = torch.randn(1000)
        y = x[10:].view(10, 99)
        z = torch.empty(10**9, device="meta")
        assert live.live["cpu"] == 4000 and "meta" not in live.live
    del x, y, z


def test_tensors_made_before_are_counted_when_included():
    model = nn.Linear(100, 100)
    with LiveBytes().include(model.parameters()) as live:
        out = model(torch.randn(8, 100))
        assert live.live["cpu"] >= (100 * 100 + 100 + 8 * 100) * 4
    del out
