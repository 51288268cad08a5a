"""Batch-first `tf.data` input: whole batches are cut from windows of rows.

The TFRS tutorials build `from_tensor_slices` over per-example dicts and `map` a Python-traced
function over every example before batching; on a GPU that pipeline, not the model, sets the
pace. Here rows arrive in windows (dicts of [n, ...] tensors): each window's row order is
shuffled once (a permutation of its rows), cut into batches of row indexes, and one `tf.gather`
per feature produces a whole batch. There is no per-example work.

One path serves every size: an in-memory log is one window per epoch (the whole log, so an
epoch is an exact permutation of its rows); prepared shards on disk (`features.stream`) stream
windows of blocks read from files, shuffled within a bounded number of rows.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import tensorflow as tf

from tworec.features.interactions import DataError


def window_batches(windows: tf.data.Dataset, batch_size: int, *, shuffle: bool = False,
                   seed: int | tf.Tensor = 0, drop_remainder: bool = False) -> tf.data.Dataset:
    """Batches cut from windows of rows.

    Args:
        windows: a dataset of (number, window): `number` a [] int64 that differs between
            windows (it seeds the window's permutation), `window` a dict of [n, ...] tensors.
        batch_size: rows per batch.
        shuffle: permute each window's rows, by `tf.random.experimental.stateless_shuffle`
            seeded with (seed, number): the same seed gives the same batches.
        seed: [] int, a Python int or a tensor (e.g. `training.worker_seed()`).
        drop_remainder: drop the last rows of each window that do not fill a batch.

    Returns:
        A dataset of {name: [batch, ...]} dicts, prefetched.
    """
    def index_batches(number: tf.Tensor, window: dict) -> tf.data.Dataset:
        n = tf.shape(next(iter(window.values())), out_type=tf.int64)[0]
        rows = tf.range(n, dtype=tf.int64)
        if shuffle:
            pair = tf.stack([tf.cast(seed, tf.int64), number])
            rows = tf.random.experimental.stateless_shuffle(rows, seed=pair)
        full = n // batch_size
        parts = tf.data.Dataset.from_tensor_slices(
            tf.reshape(rows[: full * batch_size], [full, batch_size]))    # [full, batch]
        if not drop_remainder:
            rest = tf.data.Dataset.from_tensors(rows[full * batch_size:])
            parts = parts.concatenate(rest.filter(lambda index: tf.size(index) > 0))
        return parts.map(lambda index: (index, window))

    dataset = windows.flat_map(index_batches).map(
        lambda index, window: {name: tf.gather(t, index) for name, t in window.items()},
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return dataset.prefetch(tf.data.AUTOTUNE)


def batches(features: dict[str, np.ndarray], batch_size: int, *, shuffle: bool = False,
            seed: int | tf.Tensor = 0, epochs: int | None = 1, drop_remainder: bool = False,
            select: list[str] | None = None) -> tf.data.Dataset:
    """A dataset of dict-of-tensor batches of in-memory arrays: `window_batches` over one
    window, the whole arrays, per epoch.

    Args:
        features: name -> [n, ...] arrays, all with the same first dimension.
        batch_size: rows per batch.
        shuffle: reshuffle the rows at every epoch (a different permutation per epoch).
        seed: seed of the permutations.
        epochs: number of passes, None for an endless dataset (give Keras `steps_per_epoch`).
        drop_remainder: drop the last, smaller batch of each epoch.
        select: the features a model asks for; all when None.

    Returns:
        A dataset yielding {name: [batch, ...] tensor}.
    """
    names = list(features) if select is None else list(select)
    missing = [name for name in names if name not in features]
    if missing:
        raise DataError(f"batches: no feature(s) {missing}; have {sorted(features)}")
    check_rows({name: features[name] for name in names}, batch_size)
    tensors = {name: tf.constant(features[name]) for name in names}
    epoch_numbers = tf.data.Dataset.counter()
    if epochs is not None:
        epoch_numbers = epoch_numbers.take(epochs)
    return window_batches(epoch_numbers.map(lambda epoch: (epoch, tensors)), batch_size,
                          shuffle=shuffle, seed=seed, drop_remainder=drop_remainder)


def batches_in_order(features: dict[str, np.ndarray], batch_size: int
                     ) -> Iterator[dict[str, tf.Tensor]]:
    """The rows of in-memory arrays in order, `batch_size` a batch, as {name: [batch, ...]}
    tensors, for inference loops: the batches of `batches(features, batch_size)` without the
    `tf.data` pipeline it builds (0.25 s a call on a CPU, more than a tiny model's answer)."""
    rows = check_rows(features, batch_size)
    for start in range(0, rows, batch_size):
        yield {name: tf.constant(values[start:start + batch_size])
               for name, values in features.items()}


def check_rows(features: dict[str, np.ndarray], batch_size: int) -> int:
    """The number of rows of `features`, after checking that every feature has it and that
    `batch_size` is positive."""
    sizes = {name: len(values) for name, values in features.items()}
    if len(set(sizes.values())) != 1:
        raise DataError(f"batches: features have different numbers of rows: {sizes}")
    if batch_size <= 0:
        raise DataError(f"batches: batch_size must be positive, got {batch_size}")
    return next(iter(sizes.values()))


def steps_per_epoch(num_rows: int, batch_size: int, drop_remainder: bool = False) -> int:
    """Batches in one epoch of `batches`."""
    return num_rows // batch_size if drop_remainder else -(-num_rows // batch_size)
