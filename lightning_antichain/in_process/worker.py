"""Long-lived worker threads, one per pipeline stage.

A thread that is new for every pass is measurably slower on CPU (about 20% for a CNN step here:
fresh threads start on cold allocator memory), so a pipeline keeps its workers between passes.
They are started on first use and stopped by :meth:`WorkerPool.shutdown`, which the pipeline calls
when it is closed or collected and after any failed pass, so an error never leaves a thread behind.

On CPU, the pipeline has malloc keep freed memory for the threads to reuse
(:func:`~lightning_antichain.cpu_allocator.keep_freed_memory`).
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

_STOP = object()


class WorkerPool:
    """``size`` daemon threads; :meth:`run` gives thread i the i-th task and waits for all of them.
    With ``threads`` given, each computes with that many intra-op threads (``torch.set_num_threads``
    is per thread); else with the count new threads get."""

    def __init__(self, size: int, name: str = "antichain-stage", threads: int | None = None) -> None:
        self.size = size
        self.name = name
        self.threads = threads
        self._inboxes: list[queue.Queue] = []
        self._threads: list[threading.Thread] = []
        # reentrant: an interrupt that lands as ``with`` leaves ``run`` can leave the lock taken
        # (Python's ``with`` is not signal-safe there); the same thread's ``shutdown`` must still get it
        self._lock = threading.RLock()
        #: tasks done, by (stage, identity of the thread that did it), since the pool was made: the
        #: evidence that work really ran on the workers, spread over stages and threads
        self.tasks_run: Counter[tuple[int, int]] = Counter()
        # while ``run`` waits: where workers hand it calls. Swapped by plain assignment, no lock: an
        # interrupt can land between any two lines, and a lock it left taken would hang the next run
        self._calls: queue.Queue | None = None

    def count_task(self, stage: int) -> None:
        """Note that the calling thread finished one task of ``stage``."""
        self.tasks_run[stage, threading.get_ident()] += 1

    def _start(self) -> None:
        self._inboxes = [queue.Queue() for _ in range(self.size)]
        self._threads = [
            threading.Thread(target=_serve, args=(inbox, self.threads), name=f"{self.name}-{i}", daemon=True)
            for i, inbox in enumerate(self._inboxes)
        ]
        for thread in self._threads:
            thread.start()

    def run(self, tasks: list[Callable[[], None]], on_interrupt: Callable[[], None]) -> None:
        """Run ``tasks[i]`` on worker i and wait until all have returned.

        A task that raises does not take its worker down: the first exception is raised here once
        every task has returned. If the caller is interrupted (Ctrl-C) at any point, while handing
        out the tasks or while waiting, ``on_interrupt`` is called to make the tasks finish early,
        the workers are stopped and joined once their tasks have returned (further interrupts
        meanwhile are held back), and the interrupt propagates.
        """
        if len(tasks) != self.size:
            raise ValueError(f"{len(tasks)} tasks for {self.size} workers")
        with self._lock:
            done: queue.Queue = queue.Queue()
            pending = 0
            failures: list[BaseException] = []
            try:
                self._calls = done
                if not self._threads:
                    self._start()
                for inbox, task in zip(self._inboxes, tasks):
                    inbox.put((task, done))
                    pending += 1
                while pending:
                    item = done.get()
                    if isinstance(item, _Call):
                        item.run()
                        continue
                    if item is not None:
                        failures.append(item)
                    pending -= 1
            except BaseException:
                _uninterrupted(lambda: self._stop_calls(done))
                _uninterrupted(on_interrupt)
                self._stop()  # each worker ends its task, told to finish early, then stops
                raise
            self._stop_calls(done)
            if failures:
                raise failures[0]

    def call_on_caller(self, function: Callable[[], object]) -> None:
        """Run ``function`` on the thread waiting in :meth:`run`, from a worker's task, and return
        once it has (raising what it raised). For work only that thread can do: the backward of a
        GPU stage while that thread is the GPU's autograd thread, waiting inside a backward node."""
        calls = self._calls
        if calls is None:
            raise RuntimeError("call_on_caller is for a worker's task while the pool runs it")
        call = _Call(function)
        calls.put(call)
        while not call.finished.wait(0.05):
            if self._calls is not calls:  # the pass stopped taking calls; this one may never be run
                if not call.finished.wait(0.05):
                    raise RuntimeError("the pipeline pass was stopped")
        if call.error is not None:
            raise call.error

    def _stop_calls(self, done: queue.Queue) -> None:
        """Stop taking calls; any still queued fail, so no worker waits for them (one that hands
        its call in after this sees that the pass stopped taking them)."""
        self._calls = None
        left: list[Any] = []
        while not done.empty():
            left.append(done.get())
        for item in left:
            if isinstance(item, _Call):
                item.error = RuntimeError("the pipeline pass was stopped")
                item.finished.set()
            else:
                done.put(item)

    def shutdown(self) -> None:
        """Stop and join every worker; the next :meth:`run` starts new ones."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        """Stop and join every worker, even if interrupted meanwhile (the interrupt is raised after)."""
        interrupted: BaseException | None = None
        for inbox in self._inboxes:
            inbox.put(_STOP)
        for thread in self._threads:
            while thread.is_alive():
                try:
                    thread.join()
                except BaseException as exc:  # noqa: BLE001 - raised once every worker has ended
                    interrupted = interrupted or exc
        self._inboxes, self._threads = [], []
        if interrupted is not None:
            raise interrupted


class _Call:
    """A function a worker asks the waiting caller to run, and what came of it."""

    def __init__(self, function: Callable[[], object]) -> None:
        self.function = function
        self.finished = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.function()
        except BaseException as exc:  # noqa: BLE001 - raised in the worker that asked
            self.error = exc
        finally:
            self.finished.set()


def _uninterrupted(call: Callable[[], object]) -> None:
    """``call()``, repeated until it returns without being interrupted."""
    while True:
        try:
            call()
            return
        except BaseException:  # noqa: BLE001 - the first interrupt is already on its way to the caller
            continue


def _serve(inbox: queue.Queue, threads: int | None) -> None:
    if threads is not None:
        torch.set_num_threads(threads)
    while True:
        item = inbox.get()
        if item is _STOP:
            return
        task, done = item
        try:
            task()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller; the worker stays for the next task
            done.put(exc)
        else:
            done.put(None)
