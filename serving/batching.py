"""Server-side batching: concurrent predicts of one model version and signature share a run.

The first request of a batch waits up to `batch_timeout_micros` (or until `max_batch_size` rows
are queued), concatenates every queued request along dimension 0, runs the signature once and
hands each request its rows. Requests are checked one by one first, so a bad request fails
alone; if the merged run fails, or an output lacks the batch dimension, each request of the
batch is run on its own instead.
"""
from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from tworec.serving.errors import ServingError, from_tf_error
from tworec.serving.model import DEFAULT_SIGNATURE, LoadedModel


def run_directly(model: LoadedModel, inputs: dict[str, np.ndarray], signature_name: str = "",
                 output_filter: tuple[str, ...] | list[str] = ()) -> dict[str, np.ndarray]:
    """One session run per request (batching off)."""
    return model.run(inputs, signature_name, output_filter)


@dataclasses.dataclass
class _Task:
    inputs: dict[str, np.ndarray]
    rows: int
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    outputs: dict[str, np.ndarray] | None = None
    error: ServingError | None = None

    def result(self) -> dict[str, np.ndarray]:
        if self.error is not None:
            raise self.error
        return self.outputs


class Batcher:
    """A drop-in for `run_directly` that merges concurrent requests.

    Args:
        max_batch_size: a batch closes once it has this many rows.
        batch_timeout_micros: how long the first request of a batch waits for others.
    """

    def __init__(self, max_batch_size: int = 32, batch_timeout_micros: int = 1000):
        self.max_batch_size = max_batch_size
        self.timeout_seconds = batch_timeout_micros / 1e6
        self._cond = threading.Condition()
        self._queues: dict[tuple, list[_Task]] = {}

    def __call__(self, model: LoadedModel, inputs: dict[str, np.ndarray],
                 signature_name: str = "",
                 output_filter: tuple[str, ...] | list[str] = ()) -> dict[str, np.ndarray]:
        inputs = model.check_inputs(inputs, signature_name)
        if any(value.ndim == 0 for value in inputs.values()):
            return model.run(inputs, signature_name, output_filter)
        key = (id(model), signature_name or DEFAULT_SIGNATURE, tuple(output_filter),
               tuple(sorted((name, value.dtype.str, value.shape[1:])
                            for name, value in inputs.items())))
        task = _Task(inputs, rows=len(next(iter(inputs.values()))))
        batch = self._enqueue(key, task)
        if batch:
            _run_batch(model, batch, signature_name, output_filter)
        task.done.wait()
        return task.result()

    def _enqueue(self, key: tuple, task: _Task) -> list[_Task]:
        """Queues the task; the first of a batch collects it and gets it back, others get []."""
        with self._cond:
            queue = self._queues.setdefault(key, [])
            queue.append(task)
            self._cond.notify_all()
            if len(queue) > 1:
                return []
            deadline = time.monotonic() + self.timeout_seconds
            while (sum(t.rows for t in queue) < self.max_batch_size
                   and (left := deadline - time.monotonic()) > 0):
                self._cond.wait(left)
            return self._queues.pop(key)


def _run_batch(model: LoadedModel, batch: list[_Task], signature_name: str,
               output_filter) -> None:
    """Runs the tasks as one batch, or one by one when the merged run fails or cannot split."""
    if len(batch) > 1:
        try:
            return _run_merged(model, batch, signature_name, output_filter)
        except Exception:  # noqa: BLE001  (each request then gets its own answer)
            pass
    for task in batch:
        try:
            task.outputs = model.run(task.inputs, signature_name, output_filter)
        except Exception as error:
            task.error = from_tf_error(error)
        finally:
            task.done.set()


def _run_merged(model: LoadedModel, batch: list[_Task], signature_name: str,
                output_filter) -> None:
    merged = {name: np.concatenate([t.inputs[name] for t in batch])
              for name in batch[0].inputs}                                    # [sum rows, ...]
    outputs = model.run(merged, signature_name, output_filter)
    ends = np.cumsum([t.rows for t in batch])
    for name, value in outputs.items():
        if np.ndim(value) == 0 or len(value) != ends[-1]:
            raise ServingError("INTERNAL", f"output {name} of shape {np.shape(value)} has no "
                               f"batch dimension of {ends[-1]}")
    for task, end in zip(batch, ends):
        task.outputs = {name: value[end - task.rows:end] for name, value in outputs.items()}
        task.done.set()
