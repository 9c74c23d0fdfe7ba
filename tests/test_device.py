"""The device layer's CPU behaviour, and the worker pool's hand-back of work to the waiting caller
(what a GPU stage's backward needs while the caller is the GPU's autograd thread)."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_antichain import device as dev
from lightning_antichain.in_process.worker import WorkerPool


def test_cpu_stages_have_no_streams_and_the_caller_none_to_wait_for():
    streams = dev.stage_streams("cpu")
    assert (streams.compute, streams.send, streams.receive) == (None, None, None)
    assert dev.caller_streams(["cpu", torch.device("cpu")]) == {}
    with dev.computing(streams):
        dev.wait_for_caller(streams, {})
    dev.release_to_caller({}, [streams], [torch.ones(2)])


def test_ship_between_cpu_stages_detaches_and_needs_no_event():
    x = torch.ones(3, requires_grad=True) * 2
    moved, event = dev.ship([x, 5, None], dev.stage_streams("cpu"), dev.stage_streams("cpu"))
    assert event is None and moved[1:] == (5, None)
    assert not moved[0].requires_grad and torch.equal(moved[0], x.detach())


def test_arrive_makes_flagged_floating_tensors_gradient_leaves():
    a, b, n = torch.ones(2), torch.zeros(2), torch.arange(2)
    ready = dev.arrive([a, b, n, "text"], None, dev.stage_streams("cpu"), [True, False, False, False])
    assert ready[0].requires_grad and ready[0].is_leaf and ready[0] is not a
    assert not ready[1].requires_grad and ready[3] == "text"


def test_the_autograd_thread_is_the_first_device_other_than_the_cpu():
    assert dev.autograd_thread_device([None, torch.ones(1)]) is None
    meta = torch.empty(1, device="meta")
    assert dev.autograd_thread_device([torch.ones(1), None, meta]) == torch.device("meta")


def test_timed_on_the_cpu_is_wall_time_and_returns_the_result():
    seconds, result = dev.timed("cpu", lambda: sum(range(10000)))
    assert result == sum(range(10000)) and 0 < seconds < 1


def test_device_names_and_kinds():
    assert dev.shares_host("cpu") and not dev.is_accelerator("cpu")
    assert not dev.shares_host("fast")  # a planner's named device is a device of its own
    assert dev.same_device("cuda", "cuda:0") and not dev.same_device("cuda:0", "cuda:1")
    assert dev.memory_gb("cpu") is None
    dev.synchronize(["cpu", torch.device("cpu")])


def test_call_on_caller_runs_on_the_thread_waiting_in_run():
    pool = WorkerPool(2)
    ran_on: list[int] = []

    def task() -> None:
        pool.call_on_caller(lambda: ran_on.append(threading.get_ident()))

    try:
        pool.run([task, task], on_interrupt=lambda: None)
    finally:
        pool.shutdown()
    assert ran_on == [threading.get_ident()] * 2


def test_a_failing_call_raises_in_the_worker_that_asked():
    pool = WorkerPool(1)

    def boom() -> None:
        raise ValueError("from the caller's thread")

    try:
        with pytest.raises(ValueError, match="caller's thread"):
            pool.run([lambda: pool.call_on_caller(boom)], on_interrupt=lambda: None)
    finally:
        pool.shutdown()


def test_call_on_caller_outside_a_run_is_refused():
    with pytest.raises(RuntimeError, match="while the pool runs"):
        WorkerPool(1).call_on_caller(lambda: None)
