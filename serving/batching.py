"""How checked predict requests reach a model's session: one run each, or merged into batches.

Both schedulers `submit` a request and hand back a `concurrent.futures.Future` at once, so
REST's event loop never holds a thread while a model runs and status and metadata never queue
behind predictions; gRPC's thread-per-call handlers call `run`. A request is dropped before it
starts when its client has gone (its future cancelled, or `cancelled()` true) or its deadline
has passed.

`Batcher` follows TF Serving's batching (`--enable_batching`, BasicBatchScheduler): requests of
one model version, signature and output filter queue together; a batch closes when it holds
`max_batch_size` rows or its first request has waited `batch_timeout_micros`, and runs on one of
`num_batch_threads` threads of its own, so a batch fills however few request threads there are.
Every request is checked alone before it may join a queue (names, dtypes, shapes and one shared
dimension 0) and the merged outputs go back by each request's own row count; when a merged run
fails on its data, its halves run merged in turn, down to the request at fault, so that each
request gets its own answer or error. Like TF Serving's batching, this relies on the model's rows
being independent: a model that mixes the rows of a batch answers a request differently batched.
A merged run is bounded by the latest deadline of its requests, never the earliest, so one
request with a short deadline cannot cut the others' run short. A request larger than
`max_batch_size` is refused ("Task size ... is larger than maximum input batch size ...")
unless `enable_large_batch_splitting` splits it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

import numpy as np

from tworec.serving.errors import ServingError, from_tf_error
from tworec.serving.model import LoadedModel, batch_size
from tworec.serving.protocol import DEFAULT_SIGNATURE

log = logging.getLogger(__name__)


def remaining(deadline: float | None) -> float | None:
    """Seconds left before a `time.monotonic()` deadline (None: no deadline)."""
    return None if deadline is None else deadline - time.monotonic()


def _run(model: LoadedModel, inputs: dict[str, np.ndarray], signature_name: str,
         output_filter: tuple[str, ...], deadline: float | None) -> dict[str, np.ndarray]:
    """One session run, bounded by the deadline; any failure as a client-safe `ServingError`."""
    try:
        return model.run(inputs, signature_name, output_filter, remaining(deadline))
    except Exception as error:
        raise from_tf_error(error) from error


def _never() -> bool:
    return False


def wait_for(future: Future, deadline: float | None) -> dict[str, np.ndarray]:
    """The outputs of a scheduled run, waiting at most until the deadline (then the run is
    cancelled if it has not started, and DEADLINE_EXCEEDED raised)."""
    try:
        return future.result(timeout=remaining(deadline))
    except FutureTimeout as error:
        future.cancel()
        raise ServingError("DEADLINE_EXCEEDED", "Deadline exceeded before the model answered"
                           ) from error
    except CancelledError as error:
        raise ServingError("CANCELLED", "the request was cancelled") from error


class Direct:
    """One session run per request (batching off), at most `num_threads` at a time.

    `submit` runs the request on a thread of its own pool (for event loops); `run` runs it in
    the calling thread once a slot is free (for servers with a thread per call, which saves a
    thread switch per request).

    Args:
        num_threads: model runs at a time.
    """

    def __init__(self, num_threads: int = 8):
        self._slots = threading.BoundedSemaphore(num_threads)
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="predict")

    def submit(self, model: LoadedModel, inputs: dict[str, np.ndarray], signature_name: str = "",
               output_filter: tuple[str, ...] | list[str] = (), deadline: float | None = None,
               cancelled: Callable[[], bool] = _never) -> Future:
        """Checks the request (raising `ServingError`) and queues its run; dropped if
        `cancelled()` by the time it starts."""
        inputs = model.check_inputs(inputs, signature_name)
        return self._pool.submit(self._run, model, inputs, signature_name, tuple(output_filter),
                                 deadline, cancelled)

    def run(self, model: LoadedModel, inputs: dict[str, np.ndarray], signature_name: str = "",
            output_filter: tuple[str, ...] | list[str] = (), deadline: float | None = None,
            cancelled: Callable[[], bool] = _never) -> dict[str, np.ndarray]:
        """Checks the request and runs it in this thread; dropped if `cancelled()` by then."""
        inputs = model.check_inputs(inputs, signature_name)
        return self._run(model, inputs, signature_name, tuple(output_filter), deadline,
                         cancelled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, model, inputs, signature_name, output_filter, deadline,
             cancelled: Callable[[], bool] = _never) -> dict[str, np.ndarray]:
        left = remaining(deadline)
        if not self._slots.acquire(timeout=None if left is None else max(left, 0)):
            raise ServingError("DEADLINE_EXCEEDED", "the request's deadline passed while it "
                               "was queued")
        try:
            if cancelled():
                raise ServingError("CANCELLED", "the client has gone")
            return _run(model, inputs, signature_name, output_filter, deadline)
        finally:
            self._slots.release()


@dataclasses.dataclass
class _Task:
    inputs: dict[str, np.ndarray]
    rows: int
    deadline: float | None
    cancelled: Callable[[], bool] = _never
    arrived: float = dataclasses.field(default_factory=time.monotonic)
    future: Future = dataclasses.field(default_factory=Future)


@dataclasses.dataclass
class _Queue:
    """The waiting requests of one (model, signature, output filter, input shapes)."""
    model: LoadedModel
    signature_name: str
    output_filter: tuple[str, ...]
    tasks: list[_Task] = dataclasses.field(default_factory=list)
    rows: int = 0


class Batcher:
    """Merges concurrent requests of one model version and signature (TF Serving's batching).

    Args:
        max_batch_size: the most rows in a batch; a batch closes once it has them.
        batch_timeout_micros: how long the first request of a batch waits for others.
        num_batch_threads: batches running at a time (TF Serving's default: the cores).
        max_enqueued_batches: queued rows beyond this many full batches are refused
            (UNAVAILABLE), so a burst cannot queue without bound.
        enable_large_batch_splitting: split a request larger than `max_batch_size` instead of
            refusing it.
    """

    def __init__(self, max_batch_size: int = 32, batch_timeout_micros: int = 1000,
                 num_batch_threads: int | None = None, max_enqueued_batches: int = 10,
                 enable_large_batch_splitting: bool = False):
        if max_batch_size < 1 or batch_timeout_micros < 0 or max_enqueued_batches < 1:
            raise ValueError("max_batch_size and max_enqueued_batches must be positive and "
                             "batch_timeout_micros non-negative")
        self.max_batch_size = max_batch_size
        self.timeout_seconds = batch_timeout_micros / 1e6
        self.max_enqueued_batches = max_enqueued_batches
        self.split = enable_large_batch_splitting
        self._cond = threading.Condition()
        self._queues: dict[tuple, _Queue] = {}
        self._closed = False
        self._threads = [threading.Thread(target=self._loop, name=f"batch-{i}", daemon=True)
                         for i in range(num_batch_threads or os.cpu_count() or 1)]
        for thread in self._threads:
            thread.start()

    def run(self, model: LoadedModel, inputs: dict[str, np.ndarray], signature_name: str = "",
            output_filter: tuple[str, ...] | list[str] = (), deadline: float | None = None,
            cancelled: Callable[[], bool] = _never) -> dict[str, np.ndarray]:
        """`submit`, then waits for the answer until the deadline; a request `cancelled()` by
        the time its batch starts is dropped."""
        return wait_for(self.submit(model, inputs, signature_name, output_filter, deadline,
                                    cancelled), deadline)

    def submit(self, model: LoadedModel, inputs: dict[str, np.ndarray], signature_name: str = "",
               output_filter: tuple[str, ...] | list[str] = (), deadline: float | None = None,
               cancelled: Callable[[], bool] = _never) -> Future:
        """Checks the request alone (raising `ServingError`) and queues it for a batch."""
        inputs = model.check_inputs(inputs, signature_name)
        rows = batch_size(inputs)
        key = (id(model), signature_name or DEFAULT_SIGNATURE, tuple(output_filter),
               tuple(sorted((name, value.dtype.str, value.shape[1:])
                            for name, value in inputs.items())))
        if rows is None:          # a scalar input: nothing to batch along, a full batch alone
            key, rows = key + (object(),), self.max_batch_size
        elif rows > self.max_batch_size:
            if not self.split:
                raise ServingError("INVALID_ARGUMENT", f"Task size {rows} is larger than "
                                   f"maximum input batch size {self.max_batch_size}")
            parts = []
            try:
                for part in _split(inputs, rows, self.max_batch_size):
                    parts.append(self.submit(model, part, signature_name, output_filter,
                                             deadline, cancelled))
            except BaseException:         # a part refused: the queued ones must not run
                for queued in parts:
                    queued.cancel()
                raise
            return _gather(parts)
        task = _Task(inputs, rows, deadline, cancelled)
        with self._cond:
            queue = self._queues.get(key) or _Queue(model, signature_name, tuple(output_filter))
            if queue.rows + rows > self.max_enqueued_batches * self.max_batch_size:
                raise ServingError("UNAVAILABLE", "The batch scheduling queue to which this "
                                   "task was submitted is full")
            self._queues[key] = queue
            queue.tasks.append(task)
            queue.rows += rows
            self._cond.notify()
        return task.future

    def close(self) -> None:
        """Stops the batch threads; queued requests are cancelled."""
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                for task in queue.tasks:
                    task.future.cancel()
            self._queues.clear()
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                batch = self._next_batch()
            if batch is None:
                return
            _run_batch(*batch)

    def _next_batch(self) -> tuple[_Queue, list[_Task]] | None:
        """Waits (lock held) for a queue that is full or timed out; takes one batch off it."""
        while not self._closed:
            now = time.monotonic()
            ready = [(key, queue) for key, queue in self._queues.items()
                     if queue.rows >= self.max_batch_size
                     or now - queue.tasks[0].arrived >= self.timeout_seconds]
            if ready:
                key, queue = min(ready, key=lambda item: item[1].tasks[0].arrived)
                return queue, self._take(key, queue)
            oldest = min((q.tasks[0].arrived for q in self._queues.values()), default=None)
            self._cond.wait(None if oldest is None else oldest + self.timeout_seconds - now)
        return None

    def _take(self, key: tuple, queue: _Queue) -> list[_Task]:
        """The first tasks of the queue that fit in one batch, in arrival order."""
        taken, rows = [], 0
        while queue.tasks and rows + queue.tasks[0].rows <= self.max_batch_size:
            task = queue.tasks.pop(0)
            taken.append(task)
            rows += task.rows
        queue.rows -= rows
        if not queue.tasks:
            del self._queues[key]
        return taken


def _split(inputs: dict[str, np.ndarray], rows: int, size: int) -> list[dict[str, np.ndarray]]:
    """The request cut along dimension 0 into parts of at most `size` rows."""
    return [{name: value[start:start + size] for name, value in inputs.items()}
            for start in range(0, rows, size)]


class _Gathered(Future):
    """The future of a split request: cancelling it cancels its parts (those not started yet
    never run)."""

    def __init__(self, parts: list[Future]):
        super().__init__()
        self.parts = parts

    def cancel(self) -> bool:
        if not super().cancel():            # answered already
            return False
        for part in self.parts:
            part.cancel()
        return True


def _gather(parts: list[Future]) -> Future:
    """A future of the parts' outputs concatenated along dimension 0 (the first error wins);
    cancelling it cancels the parts."""
    result = _Gathered(parts)
    left = [len(parts)]
    lock = threading.Lock()

    def part_done(_) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [p.exception() for p in parts if not p.cancelled() and p.exception()]
        if not result.set_running_or_notify_cancel():
            return                                      # cancelled: nobody waits for it
        if errors or any(p.cancelled() for p in parts):
            result.set_exception(errors[0] if errors else ServingError(
                "CANCELLED", "the request was cancelled"))
            return
        outputs = [p.result() for p in parts]
        result.set_result({name: np.concatenate([o[name] for o in outputs])
                           for name in outputs[0]})
    for part in parts:
        part.add_done_callback(part_done)
    return result


def _start(tasks: list[_Task]) -> list[_Task]:
    """The tasks still wanted: cancelled ones are dropped, expired ones answered."""
    started = []
    for task in tasks:
        if task.cancelled():
            task.future.cancel()
        if not task.future.set_running_or_notify_cancel():
            continue
        error = _unwanted(task, "while it was queued")
        if error is None:
            started.append(task)
        else:
            task.future.set_exception(error)
    return started


def _unwanted(task: _Task, when: str) -> ServingError | None:
    """Why `task` is not to run (its client has gone, or its deadline passed `when`), or
    None."""
    if task.cancelled():
        return ServingError("CANCELLED", "the client has gone")
    left = remaining(task.deadline)
    if left is not None and left <= 0:
        return ServingError("DEADLINE_EXCEEDED", f"the request's deadline passed {when}")
    return None


# Failures of a merged run that say nothing about its data: every request gets the same one
# instead of a run of its own (DEADLINE_EXCEEDED: the latest deadline of the batch has passed).
_NOT_DATA_ERRORS = ("DEADLINE_EXCEEDED", "CANCELLED", "UNAVAILABLE")


def _run_batch(queue: _Queue, tasks: list[_Task]) -> None:
    """Runs the tasks still wanted (`_start`) as one merged batch (`_run_halving`)."""
    _run_halving(queue, _start(tasks))


def _run_halving(queue: _Queue, tasks: list[_Task]) -> None:
    """Runs started tasks as one merged batch; when a merged run fails on its data (or its
    outputs cannot be split), runs each half merged in turn, halving again only a half that
    fails, so that each request gets its own answer or error and one bad request among n
    costs 2·ceil(log2 n) more runs, not n (the good ones batched with it meet their
    deadlines). Tasks whose client left or deadline passed meanwhile are not run again."""
    if not tasks:
        return
    if len(tasks) == 1:
        try:
            tasks[0].future.set_result(_run(queue.model, tasks[0].inputs, queue.signature_name,
                                            queue.output_filter, tasks[0].deadline))
        except ServingError as error:
            tasks[0].future.set_exception(error)
        return
    try:
        return _run_merged(queue, tasks)
    except ServingError as error:
        if error.code in _NOT_DATA_ERRORS:
            for task in tasks:
                task.future.set_exception(error)
            return
        log.info("a merged batch of %d requests failed (%s); running its halves", len(tasks),
                 error)
    for half in (tasks[:len(tasks) // 2], tasks[len(tasks) // 2:]):
        _run_halving(queue, _still_wanted(half))


def _still_wanted(tasks: list[_Task]) -> list[_Task]:
    """The started tasks to run again: those whose client has gone or whose deadline has
    passed are answered instead."""
    wanted = []
    for task in tasks:
        error = _unwanted(task, "before the model answered")
        if error is None:
            wanted.append(task)
        else:
            task.future.set_exception(error)
    return wanted


def _run_merged(queue: _Queue, tasks: list[_Task]) -> None:
    """One run of the tasks' rows, bounded by the latest deadline among them (none if one has
    none), so that a request with a short deadline never cuts the run of the others short;
    the requests whose own deadline passed meanwhile are answered DEADLINE_EXCEEDED."""
    merged = {name: np.concatenate([t.inputs[name] for t in tasks])
              for name in tasks[0].inputs}                                    # [sum rows, ...]
    deadlines = [t.deadline for t in tasks]
    outputs = _run(queue.model, merged, queue.signature_name, queue.output_filter,
                   None if None in deadlines else max(deadlines))
    ends = np.cumsum([t.rows for t in tasks])
    for name, value in outputs.items():
        if np.ndim(value) == 0 or len(value) != ends[-1]:
            raise ServingError("INTERNAL", f"output {name} of shape {np.shape(value)} has no "
                               f"batch dimension of {ends[-1]}")
    for task, end in zip(tasks, ends):
        left = remaining(task.deadline)
        if left is not None and left <= 0:
            task.future.set_exception(ServingError(
                "DEADLINE_EXCEEDED", "the request's deadline passed before the model answered"))
        else:
            task.future.set_result({name: value[end - task.rows:end]
                                    for name, value in outputs.items()})
