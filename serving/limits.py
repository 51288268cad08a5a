"""Bounds on the work one request may ask for, checked before anything is allocated."""
from __future__ import annotations

import os

MAX_RANK = 32
# What one row may cost while it is served: a retrieval row scores the whole catalogue, and the
# composed recommender holds ~0.35 MiB per row (measured), so 1 MiB keeps a margin.
ROW_BYTES = 1 << 20
# One request may use at most this share of physical memory.
MEMORY_SHARE = 4


def default_max_rows(memory_bytes: int | None = None) -> int:
    """The default `--max_rows_per_request`: a quarter of physical memory at 1 MiB per row,
    between 256 and 65536 rows (6144 on a 24 GiB machine)."""
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(max(memory_bytes // MEMORY_SHARE // ROW_BYTES, 256), 65536))


def check_shape(name: str, shape: list[int], max_rows: int) -> None:
    """Refuses (INVALID_ARGUMENT) a shape of too high a rank, a negative dimension, or more
    than `max_rows` rows in dimension 0."""
    from tworec.serving.errors import ServingError

    if len(shape) > MAX_RANK:
        raise ServingError("INVALID_ARGUMENT", f'Input "{name}" has rank {len(shape)}; at most '
                           f"{MAX_RANK} dimensions are accepted")
    if any(size < 0 for size in shape):
        raise ServingError("INVALID_ARGUMENT", f'Input "{name}" has a negative dimension in '
                           f"shape {shape}")
    if shape and shape[0] > max_rows:
        raise ServingError("INVALID_ARGUMENT", f'Input "{name}" has {shape[0]} rows; a request '
                           f"may have at most {max_rows} (--max_rows_per_request)")
