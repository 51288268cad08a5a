"""Batch-first `tf.data` input: whole batches are sliced from in-memory arrays.

The TFRS tutorials build `from_tensor_slices` over per-example dicts and `map` a Python-traced
function over every example before batching; on a GPU that pipeline, not the model, sets the
pace. Here each epoch shuffles an index vector once, cuts it into batches of indexes, and one
`tf.gather` per feature produces a whole batch: the per-example work is gone.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tworec.features.interactions import DataError


def batches(features: dict[str, np.ndarray], batch_size: int, *, shuffle: bool = False,
            seed: int = 0, epochs: int | None = 1, drop_remainder: bool = False,
            select: list[str] | None = None) -> tf.data.Dataset:
    """A dataset of dict-of-tensor batches.

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
    sizes = {name: len(features[name]) for name in names}
    if len(set(sizes.values())) != 1:
        raise DataError(f"batches: features have different numbers of rows: {sizes}")
    if batch_size <= 0:
        raise DataError(f"batches: batch_size must be positive, got {batch_size}")
    n = next(iter(sizes.values()))
    full = n // batch_size
    tensors = {name: tf.constant(features[name]) for name in names}

    def epoch_batches(epoch: tf.Tensor) -> tf.data.Dataset:
        rows = tf.range(n, dtype=tf.int64)
        if shuffle:
            rows = tf.random.experimental.stateless_shuffle(rows, seed=tf.stack([seed, epoch]))
        parts = tf.data.Dataset.from_tensor_slices(
            tf.reshape(rows[: full * batch_size], [full, batch_size]))   # [full, batch]
        if not drop_remainder and n > full * batch_size:
            parts = parts.concatenate(tf.data.Dataset.from_tensors(rows[full * batch_size:]))
        return parts

    epoch_ids = tf.data.Dataset.counter()
    if epochs is not None:
        epoch_ids = epoch_ids.take(epochs)
    rows = epoch_ids.flat_map(epoch_batches)
    dataset = rows.map(lambda index: {name: tf.gather(t, index) for name, t in tensors.items()},
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return dataset.prefetch(tf.data.AUTOTUNE)


def steps_per_epoch(num_rows: int, batch_size: int, drop_remainder: bool = False) -> int:
    """Batches in one epoch of `batches`."""
    return num_rows // batch_size if drop_remainder else -(-num_rows // batch_size)
