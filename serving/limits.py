"""Bounds on the work one request may ask for, checked before anything is allocated."""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator

MAX_RANK = 32
# What one row may cost while it is served: a retrieval row scores the whole catalogue, and the
# composed recommender holds ~0.35 MiB per row (measured), so 1 MiB keeps a margin.
ROW_BYTES = 1 << 20
# One request may use at most this share of physical memory.
MEMORY_SHARE = 4
# What one input element may cost: a string is a Python object (~50 bytes with its pointer) in
# the parsed request, then again in the session's tensor and in what the model derives from it.
ELEMENT_BYTES = 256


def default_max_rows(memory_bytes: int | None = None) -> int:
    """The default `--max_rows_per_request`: a quarter of physical memory at 1 MiB per row,
    between 256 and 65536 rows (6144 on a 24 GiB machine)."""
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(max(memory_bytes // MEMORY_SHARE // ROW_BYTES, 256), 65536))


def default_max_elements(memory_bytes: int | None = None) -> int:
    """The default `--max_elements_per_request` (every input's elements together): a quarter of
    physical memory at 256 bytes an element, between 1 << 20 and 1 << 26 (25165824 on a 24 GiB
    machine). Rows alone do not bound a request whose inputs have a second dimension of any
    size (`item_ids`, `history`)."""
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(max(memory_bytes // MEMORY_SHARE // ELEMENT_BYTES, 1 << 20), 1 << 26))


def check_elements(shapes: dict[str, list[int]], max_elements: int) -> None:
    """Refuses (INVALID_ARGUMENT) inputs whose shapes hold more than `max_elements` elements
    together, or an empty input whose other dimensions alone would hold more (no array of
    such a shape can be made, empty or not); checked on the declared shapes, before any input
    is converted, each shape's rank and signs first (`check_dims`)."""
    from tworec.serving.errors import ServingError

    for name, shape in shapes.items():
        check_dims(name, shape)
    counts = [_product(shape, max_elements) for shape in shapes.values()]
    if sum(counts) > max_elements:
        total = f"more than {max_elements}" if max(counts) > max_elements else sum(counts)
        raise ServingError("INVALID_ARGUMENT", f"The request's inputs have {total} elements; "
                           f"a request may have at most {max_elements} "
                           "(--max_elements_per_request)")
    for name, shape in shapes.items():
        if 0 in shape and _product([size for size in shape if size], max_elements) > max_elements:
            raise ServingError("INVALID_ARGUMENT", f'Input "{name}" has shape {shape}: empty, '
                               f"but its other dimensions hold more than {max_elements} "
                               f"elements; a request may have at most {max_elements} "
                               "(--max_elements_per_request)")


def _product(shape: list[int], bound: int) -> int:
    """The product of the sizes, or `bound + 1` as soon as it passes `bound` (32 sizes of
    2^62 multiply to a 600-digit number; a product never grows past bound × 2^63)."""
    if 0 in shape:
        return 0
    product = 1
    for size in shape:
        product *= size
        if product > bound:
            return bound + 1
    return product


def check_dims(name: str, shape: list[int]) -> None:
    """Refuses (INVALID_ARGUMENT) a shape of too high a rank or with a negative dimension."""
    from tworec.serving.errors import ServingError

    if len(shape) > MAX_RANK:
        raise ServingError("INVALID_ARGUMENT", f'Input "{name}" has rank {len(shape)}; at most '
                           f"{MAX_RANK} dimensions are accepted")
    if any(size < 0 for size in shape):
        raise ServingError("INVALID_ARGUMENT", f'Input "{name}" has a negative dimension in '
                           f"shape {shape}")


def check_shape(name: str, shape: list[int], max_rows: int) -> None:
    """Refuses (INVALID_ARGUMENT) a shape of too high a rank, a negative dimension, or more
    than `max_rows` rows in dimension 0."""
    from tworec.serving.errors import ServingError

    check_dims(name, shape)
    if shape and shape[0] > max_rows:
        raise ServingError("INVALID_ARGUMENT", f'Input "{name}" has {shape[0]} rows; a request '
                           f"may have at most {max_rows} (--max_rows_per_request)")


class BytesInFlight:
    """The request bytes the server holds at once (REST bodies as they arrive, so that a
    client declaring a large body and sending none holds nothing, and gRPC messages, until
    their answer is made or, for a REST run its client left, the run ends; a gRPC request
    under batching, or a request split into parts, releases its bytes when it returns; then
    a REST answer's bytes until at most 64 KiB of it waits in the server for its client to
    read it, and a gRPC answer's until its RPC ends: sent, its client gone, or cancelled at
    the write timeout), bounded by
    `limit`: a request that would pass it is refused
    UNAVAILABLE (retry later; HTTP 503), unless nothing else is held: a lone request of up to
    --max_request_bytes is refused while an answer not yet read holds bytes (it is read or
    given up within --http_write_timeout_seconds), not let past it, or a client reading
    slowly could hold answer after answer. A request costs a multiple of its bytes while it is
    parsed and run (a 63 MB REST ranking request of 8M short ids raised the server's peak
    memory by 1.5 GB, ~24 times, on the tiny preset's export), so the limit bounds the
    server's memory where --max_request_bytes bounds one request's.
    Thread-safe: the REST event loop and the gRPC threads share one."""

    def __init__(self, limit: int):
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reserve(self, size: int = 0) -> Iterator["Reservation"]:
        """Holds `size` bytes (grown by `Reservation.cover`) until the block ends, or, when
        `Reservation.hold_until` handed them to a run, until that run ends."""
        reservation = Reservation(self)
        try:
            reservation.cover(size)
            yield reservation
        finally:
            if reservation.handed_to is None:
                reservation.release()
            else:
                reservation.handed_to.add_done_callback(lambda _: reservation.release())

    @property
    def held(self) -> int:
        return self._held


class Reservation:
    """The bytes one request holds of a `BytesInFlight`."""

    def __init__(self, budget: BytesInFlight):
        self.budget, self.size = budget, 0
        self.handed_to = None                 # a run's future that outlives the request

    def hold_until(self, future) -> None:
        """Keeps the bytes held until `future` is done: a run a request started goes on
        holding its inputs after the request ends (its client gone, its deadline passed)."""
        self.handed_to = future

    def release(self) -> None:
        with self.budget._lock:
            self.budget._held -= self.size
            self.size = 0

    def cover(self, size: int, refuse: bool = True) -> None:
        """Grows the reservation to `size` bytes when it is smaller; raises ServingError
        (UNAVAILABLE) when the others' bytes and these would pass the limit, unless not
        `refuse` (an answer already made: its bytes are held anyway)."""
        from tworec.serving.errors import ServingError

        with self.budget._lock:
            more = size - self.size
            others = self.budget._held - self.size
            if more <= 0:
                return
            if refuse and others and others + size > self.budget.limit:
                raise ServingError("UNAVAILABLE", f"The server holds {others} bytes of other "
                                   f"requests and unread answers; with this one's {size} "
                                   "they would pass "
                                   f"{self.budget.limit} (--max_request_bytes_in_flight); "
                                   "retry later")
            self.budget._held += more
            self.size = size


def default_max_request_bytes_in_flight(max_request_bytes: int,
                                        memory_bytes: int | None = None) -> int:
    """The default --max_request_bytes_in_flight: 1/64 of physical memory (at ~24 times
    their bytes, the requests held then take under 40% of it), and at least one request of
    `max_request_bytes` (384 MiB on a 24 GiB machine)."""
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(memory_bytes // 64, max_request_bytes)
