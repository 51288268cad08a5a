"""Serving figures for benchmarks: served models under 1, 8 and 16 concurrent clients.

For every model, the in-process floor (the same SavedModel in a TF-Serving-style session), then
p50/p99 latency and requests/s over REST and gRPC, without and with server-side batching.
"""
from __future__ import annotations

import os

import numpy as np

from tworec.serving.batching import Batcher
from tworec.serving.client import Client
from tworec.serving.latency import measure
from tworec.serving.manager import ModelConfig, ModelManager
from tworec.serving.model import LoadedModel
from tworec.serving.server import ModelServer

CLIENTS = (1, 8, 16)
# Batches of 8 rows: 16 clients fill two at a time, so a batch never waits for its timeout.
BATCHING = {"max_batch_size": 8, "batch_timeout_micros": 100_000, "num_batch_threads": 2}


def serving_figures(models: dict[str, tuple[str, dict[str, np.ndarray]]],
                    clients: tuple[int, ...] = CLIENTS, seconds: float = 3.0,
                    batching: dict | None = None) -> dict:
    """Latency and throughput of every model, in process and served.

    Args:
        models: served name -> (its version folder, the inputs of one request).
        clients: the numbers of concurrent clients to measure.
        seconds: how long each measurement lasts.
        batching: `Batcher` arguments for the batched runs (default `BATCHING`).

    Returns:
        name -> {"in_process": figures, "rest_8": figures, "grpc_batching_16": figures, ...},
        figures as `latency.measure` returns them (rounded), plus "batching": its arguments.
    """
    batching = batching or BATCHING
    results = {name: {"in_process": _in_process(path, inputs, seconds)}
               for name, (path, inputs) in models.items()}
    for suffix, batcher in (("", None), ("_batching", lambda: Batcher(**batching))):
        manager = ModelManager([ModelConfig(name, os.path.dirname(path))
                                for name, (path, _) in models.items()], poll_seconds=0)
        with ModelServer(manager, grpc_port=0, rest_port=0,
                         batcher=batcher() if batcher else None) as server:
            for name, (path, inputs) in models.items():
                version = int(os.path.basename(os.path.normpath(path)))  # REST: no lookup
                for transport, target in (("rest", {"url": f"http://127.0.0.1:"
                                                           f"{server.rest_port}"}),
                                          ("grpc", {"grpc_target": f"127.0.0.1:"
                                                                   f"{server.grpc_port}"})):
                    for count in clients:
                        with Client(**target, timeout=120) as client:
                            results[name][f"{transport}{suffix}_{count}"] = _rounded(measure(
                                lambda: client.predict(name, inputs, version=version), count,
                                seconds))
    return {"batching": batching, **results}


def _in_process(path: str, inputs: dict[str, np.ndarray], seconds: float) -> dict:
    local = LoadedModel(path)
    try:
        return _rounded(measure(lambda: local.run(inputs), 1, seconds))
    finally:
        local.close()


def _rounded(figures: dict) -> dict:
    return {key: round(value, 3) if isinstance(value, float) else value
            for key, value in figures.items()}
