"""The behaviour-sequence transformer layer of BST, with the attention over a user's history
computed once per user instead of once per candidate.

BST runs one transformer layer over the sequence [h_1 .. h_L, t] for every candidate t. Done
literally, a list of n candidates repeats the history n times and the attention scores cost
n * (L + 1)^2 per user. Here the history-to-history scores, their softmax sums and the value
sums are computed once per user; each candidate then adds its own key to every softmax (a
rescaled log-sum-exp merge), which costs n * L scores. The feed-forward block and the norms
still run over all n * (L + 1) positions. The outputs are the literal layer's (up to float
rounding); `tests/test_ranking.py` checks them against Keras' `MultiHeadAttention` on the
repeated sequences. The attention runs in float32 under mixed precision too: a history that
is all padding must not turn its softmax into inf - inf.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

MASKED = -1e9   # what Keras' masked softmax adds to masked float32 logits


class SequenceTransformer(tf.keras.layers.Layer):
    """One post-norm transformer layer over [history; target] per candidate.

    Call: history [b, L, d] (position embeddings added), mask [b, L] bool (True where the
    history holds an item), target [b, n, d] (position added) -> [b, n, L + 1, d].
    Weights have `tf.keras.layers.MultiHeadAttention`'s shapes: query/key/value kernels
    [d, heads, key_dim] with biases [heads, key_dim], output kernel [heads, key_dim, d].
    """

    def __init__(self, heads: int, key_dim: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.key_dim, self.dim = heads, key_dim, dim
        self.feed_forward = tf.keras.Sequential([tf.keras.layers.Dense(2 * dim, "relu"),
                                                 tf.keras.layers.Dense(dim)])
        self.norm1 = tf.keras.layers.LayerNormalization()
        self.norm2 = tf.keras.layers.LayerNormalization()

    def build(self, input_shape):
        d = self.dim
        shape = [d, self.heads, self.key_dim]
        self.kernels = {name: self.add_weight(name=f"{name}_kernel", shape=shape)
                        for name in ("query", "key", "value")}
        self.biases = {name: self.add_weight(name=f"{name}_bias", shape=shape[1:],
                                             initializer="zeros")
                       for name in ("query", "key", "value")}
        self.output_kernel = self.add_weight(name="output_kernel", shape=[self.heads, self.key_dim, d])
        self.output_bias = self.add_weight(name="output_bias", shape=[d], initializer="zeros")
        super().build(input_shape)

    def _project(self, x: tf.Tensor, name: str) -> tf.Tensor:
        """[..., d] float32 -> [..., heads, key_dim] float32."""
        kernel = tf.cast(self.kernels[name], tf.float32)
        return tf.einsum("...d,dhk->...hk", x, kernel) + tf.cast(self.biases[name], tf.float32)

    def call(self, history: tf.Tensor, mask: tf.Tensor, target: tf.Tensor) -> tf.Tensor:
        dtype = history.dtype
        history32, target32 = tf.cast(history, tf.float32), tf.cast(target, tf.float32)
        scale = 1.0 / np.sqrt(self.key_dim)
        q_h = self._project(history32, "query") * scale                          # [b, L, h, k]
        k_h, v_h = self._project(history32, "key"), self._project(history32, "value")
        q_t = self._project(target32, "query") * scale                           # [b, n, h, k]
        k_t, v_t = self._project(target32, "key"), self._project(target32, "value")
        padding = tf.where(mask, 0.0, MASKED)[:, None, None, :]                   # [b, 1, 1, L]

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
        attended = (tf.einsum("bnthk,hkd->bntd", heads, tf.cast(self.output_kernel, tf.float32))
                    + tf.cast(self.output_bias, tf.float32))                      # [b, n, L+1, d]
        attended = tf.cast(attended, dtype)
        n = tf.shape(target)[1]
        x = tf.concat([tf.repeat(history[:, None], n, axis=1), target[:, :, None]], 2)
        x = self.norm1(x + attended)
        return self.norm2(x + self.feed_forward(x))
