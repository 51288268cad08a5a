"""The behaviour-sequence transformer layer of BST, computed once per user instead of once per
candidate.

BST runs one transformer layer over the sequence [h_1 .. h_L, t] for every candidate t. Done
literally, a list of n candidates repeats the history n times and the attention costs
n * (L + 1)^2 per user. Here the history-to-history scores, their softmax sums and the value
sums are computed once per user; each candidate then adds its own key to every softmax (a
rescaled log-sum-exp merge), which costs n * L. The outputs are the same numbers (up to float
rounding) as the literal layer; `tests/test_ranking.py` checks them against Keras'
`MultiHeadAttention` on the repeated sequences.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf



def masked_logit(dtype: tf.DType) -> float:
    """What Keras' masked softmax adds to masked logits: -1e9, or float16's lowest value."""
    return float(tf.float16.min) if dtype == tf.float16 else -1e9


class SequenceTransformer(tf.keras.layers.Layer):
    """One post-norm transformer layer over [history; target] per candidate.

    Call: history [b, L, d] (position embeddings added), mask [b, L] bool (True where the
    history holds an item), target [b, n, d] (position added) -> [b, n, L + 1, d].
    Weights have `tf.keras.layers.MultiHeadAttention`'s shapes: query/key/value kernels
    [d, heads, key_dim] with biases [heads, key_dim], output kernel [heads, key_dim, d].
    """

    def __init__(self, heads: int, key_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.key_dim = heads, key_dim

    def build(self, input_shape):
        d = int(input_shape[-1])
        shape = [d, self.heads, self.key_dim]
        self.kernels = {name: self.add_weight(name=f"{name}_kernel", shape=shape)
                        for name in ("query", "key", "value")}
        self.biases = {name: self.add_weight(name=f"{name}_bias", shape=shape[1:],
                                             initializer="zeros")
                       for name in ("query", "key", "value")}
        self.output_kernel = self.add_weight(name="output_kernel", shape=[self.heads, self.key_dim, d])
        self.output_bias = self.add_weight(name="output_bias", shape=[d], initializer="zeros")
        self.feed_forward = tf.keras.Sequential([tf.keras.layers.Dense(2 * d, "relu"),
                                                 tf.keras.layers.Dense(d)])
        self.norm1 = tf.keras.layers.LayerNormalization()
        self.norm2 = tf.keras.layers.LayerNormalization()
        super().build(input_shape)

    def _project(self, x: tf.Tensor, name: str) -> tf.Tensor:
        """[..., d] -> [..., heads, key_dim]."""
        kernel = tf.cast(self.kernels[name], x.dtype)
        return tf.einsum("...d,dhk->...hk", x, kernel) + tf.cast(self.biases[name], x.dtype)

    def call(self, history: tf.Tensor, mask: tf.Tensor, target: tf.Tensor) -> tf.Tensor:
        dtype = history.dtype
        scale = 1.0 / np.sqrt(self.key_dim)
        q_h = self._project(history, "query") * scale                            # [b, L, h, k]
        k_h, v_h = self._project(history, "key"), self._project(history, "value")
        q_t = self._project(target, "query") * scale                             # [b, n, h, k]
        k_t, v_t = self._project(target, "key"), self._project(target, "value")
        padding = tf.cast(tf.where(mask, 0.0, masked_logit(dtype)), dtype)[:, None, None, :]

        # History queries: history keys (shared by all candidates) plus the candidate's key.
        s_hh = tf.einsum("bihk,blhk->bhil", q_h, k_h) + padding                   # [b, h, L, L]
        top = tf.reduce_max(s_hh, -1)                                             # [b, h, L]
        e_hh = tf.exp(s_hh - top[..., None])
        shared_sum = tf.reduce_sum(e_hh, -1)                                      # [b, h, L]
        shared_values = tf.einsum("bhil,blhk->bhik", e_hh, v_h)                   # [b, h, L, k]
        s_ht = tf.einsum("bihk,bnhk->bnhi", q_h, k_t)                             # [b, n, h, L]
        merged_top = tf.maximum(top[:, None], s_ht)                               # [b, n, h, L]
        keep = tf.exp(top[:, None] - merged_top)                                  # shared part's rescale
        own = tf.exp(s_ht - merged_top)                                           # candidate key's weight
        numerator = (keep[..., None] * shared_values[:, None]
                     + own[..., None] * v_t[:, :, :, None, :])                    # [b, n, h, L, k]
        out_h = numerator / (keep * shared_sum[:, None] + own)[..., None]

        # Target query: an ordinary softmax over the history keys and its own key.
        s_th = tf.einsum("bnhk,blhk->bnhl", q_t, k_h) + padding                  # [b, n, h, L]
        s_tt = tf.reduce_sum(q_t * k_t, -1)[..., None]                           # [b, n, h, 1]
        weights = tf.nn.softmax(tf.concat([s_th, s_tt], -1))                     # [b, n, h, L+1]
        out_t = (tf.einsum("bnhl,blhk->bnhk", weights[..., :-1], v_h)
                 + weights[..., -1:] * v_t)                                       # [b, n, h, k]

        heads = tf.concat([tf.transpose(out_h, [0, 1, 3, 2, 4]), out_t[:, :, None]], 2)
        attended = (tf.einsum("bnthk,hkd->bntd", heads, tf.cast(self.output_kernel, dtype))
                    + tf.cast(self.output_bias, dtype))                           # [b, n, L+1, d]
        n = tf.shape(target)[1]
        x = tf.concat([tf.repeat(history[:, None], n, axis=1), target[:, :, None]], 2)
        x = self.norm1(x + attended)
        return self.norm2(x + self.feed_forward(x))
