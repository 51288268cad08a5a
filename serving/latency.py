"""Latency and throughput of a request function under concurrent clients (for benchmarks)."""
from __future__ import annotations

import threading
import time
from typing import Callable

import numpy as np


def measure(call: Callable[[], object], clients: int = 1, seconds: float = 3.0,
            warmup: int = 3) -> dict:
    """Calls `call` from `clients` threads for about `seconds`.

    Args:
        call: one request (e.g. `lambda: client.predict(...)`); an exception counts as an error.
        clients: concurrent callers.
        seconds: how long to keep calling.
        warmup: calls made first and not counted (a failure there raises).

    Returns:
        {"clients", "requests", "errors", "rps", "p50_ms", "p99_ms"}.
    """
    for _ in range(warmup):
        call()
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    deadline = time.perf_counter() + seconds

    def loop(index: int) -> None:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            try:
                call()
            except Exception:  # counted, the benchmark goes on
                errors[index] += 1
                continue
            latencies[index].append(time.perf_counter() - start)

    started = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    all_ms = np.concatenate([np.asarray(l, float) for l in latencies]) * 1e3
    p50, p99 = np.percentile(all_ms, [50, 99]) if all_ms.size else (float("nan"),) * 2
    return {"clients": clients, "requests": int(all_ms.size), "errors": int(sum(errors)),
            "rps": all_ms.size / elapsed, "p50_ms": float(p50), "p99_ms": float(p99)}
