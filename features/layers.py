"""Keras building blocks over the features both stages share."""
from __future__ import annotations

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

YEAR_BUCKETS = 32          # 0 unknown, then five-year buckets from 1900


def year_bucket(year: tf.Tensor) -> tf.Tensor:
    """[...] int32 year -> [...] int32 bucket in [0, YEAR_BUCKETS)."""
    bucket = tf.clip_by_value((year - 1900) // 5 + 1, 1, YEAR_BUCKETS - 1)
    return tf.where(year > 0, bucket, 0)


class ItemFeatures(tf.keras.layers.Layer):
    """Catalogue codes -> concatenated item id embedding, year embedding and projected genres.

    Call: codes [...] int64 -> [..., dim + 8 + 16] (genres dropped when the log has none).
    The id embedding is public (`id_embedding`) so a history encoder can share it.
    """

    def __init__(self, item_index: np.ndarray, item_vocab_size: int, item_genres: np.ndarray,
                 item_year: np.ndarray, dim: int, use_features: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.item_index = tf.constant(item_index, tf.int64)                  # [num_items]
        self.item_genres = tf.constant(item_genres, tf.float32)              # [num_items, g]
        self.item_year = tf.constant(item_year, tf.int32)                    # [num_items]
        self.use_features = use_features
        self.id_embedding = tf.keras.layers.Embedding(item_vocab_size, dim)
        self.year_embedding = tf.keras.layers.Embedding(YEAR_BUCKETS, 8)
        self.genre_projection = tf.keras.layers.Dense(16)

    def call(self, codes: tf.Tensor) -> tf.Tensor:
        parts = [self.id_embedding(tf.gather(self.item_index, codes))]
        if self.use_features:
            parts.append(self.year_embedding(year_bucket(tf.gather(self.item_year, codes))))
            if self.item_genres.shape[1]:
                parts.append(tf.cast(self.genre_projection(tf.gather(self.item_genres, codes)),
                                     parts[0].dtype))
        return tf.concat(parts, axis=-1)
