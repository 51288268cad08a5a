"""The two-tower retrieval model: a query tower over the user and their recent items, a
candidate tower over the item and its features, trained with TFRS's in-batch softmax."""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

from tworec.features.layers import ItemFeatures, year_bucket
from tworec.features.training import TFRSModel
from tworec.retrieval.config import RetrievalConfig


def right_align(history: tf.Tensor) -> tf.Tensor:
    """Moves the padding (0) of left-padded rows to the right, so a masked GRU can use cuDNN.

    Args:
        history: [batch, L] int, left-padded, oldest first.

    Returns:
        [batch, L] the same items, oldest first, padding at the end.
    """
    length = tf.shape(history)[1]
    pads = tf.reduce_sum(tf.cast(history == 0, tf.int32), axis=1, keepdims=True)   # [batch, 1]
    positions = (tf.range(length)[None, :] + pads) % length                       # [batch, L]
    return tf.gather(history, positions, batch_dims=1)


class HistoryEncoder(tf.keras.layers.Layer):
    """Encodes [batch, L, d] item embeddings of a left-padded history into [batch, d]."""

    def __init__(self, kind: str, dim: int, length: int, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind
        if kind == "gru":
            self.gru = tf.keras.layers.GRU(dim)
        elif kind == "transformer":
            self.positions = tf.keras.layers.Embedding(length, dim)
            self.attention = tf.keras.layers.MultiHeadAttention(num_heads=2, key_dim=dim // 2)
            self.feed_forward = tf.keras.Sequential([tf.keras.layers.Dense(2 * dim, "relu"),
                                                     tf.keras.layers.Dense(dim)])
            self.norm1 = tf.keras.layers.LayerNormalization()
            self.norm2 = tf.keras.layers.LayerNormalization()

    def call(self, embeddings: tf.Tensor, history: tf.Tensor) -> tf.Tensor:
        mask = history > 0                                                   # [batch, L]
        if self.kind == "mean":
            weights = tf.cast(mask, embeddings.dtype)[..., None]             # [batch, L, 1]
            total = tf.reduce_sum(embeddings * weights, axis=1)              # [batch, d]
            return total / tf.maximum(tf.reduce_sum(weights, axis=1), 1.0)
        if self.kind == "gru":
            return self.gru(embeddings, mask=mask)
        x = embeddings + tf.cast(self.positions(tf.range(tf.shape(history)[1])), embeddings.dtype)
        attention_mask = mask[:, None, :]                                    # [batch, 1, L]
        x = self.norm1(x + self.attention(x, x, attention_mask=attention_mask))
        x = self.norm2(x + self.feed_forward(x))                             # [batch, L, d]
        return x[:, -1, :]                                                   # the latest item


def in_batch_softmax_loss(query: tf.Tensor, candidate: tf.Tensor, temperature: float = 1.0,
                          sampling_probability: tf.Tensor | None = None,
                          candidate_ids: tf.Tensor | None = None,
                          num_hard_negatives: int | None = None,
                          offset: tf.Tensor | int = 0) -> tf.Tensor:
    """The loss of TFRS's `tasks.Retrieval` (summed in-batch softmax cross-entropy; logQ
    correction with TFRS's clip; accidental hits pushed to TFRS's MIN_FLOAT; optional hard
    negatives), with integer labels instead of TFRS's identity matrix of labels: the same loss
    and gradients with respect to the embeddings (`tests/test_retrieval.py`; no gradient
    reaches `sampling_probability`) with fewer [b, n] tensors: training at batch 4096 on the
    CPU from the prepared `synthetic:10m` peaked at 1.45 GiB against TFRS's 1.81.

    The queries may be a slice of the batch whose candidates they are scored against (one
    replica's rows, `global_candidates`): query i's positive is candidate `offset + i`, and
    the loss is those queries' share of the batch's; the shares of all slices sum to the loss
    of the whole batch (n == b, offset 0).

    Args:
        query: [b, d] float32; candidate: [n, d] float32, row offset + i the positive of query
            i (one candidate per query, as `TwoTower` trains; TFRS also takes extra candidates).
        sampling_probability: [n] each candidate's probability of being in a batch.
        candidate_ids: [n] ids; other rows' copies of a query's positive are not negatives.
        offset: [] int32 the row of `candidate` that is query 0's positive.

    Returns:
        [] the loss summed over the b queries.
    """
    # One [b, n] product and at most one [b, n] addend that no gradient flows through: every
    # extra elementwise [b, n] op costs 64 MiB at 4096 x 4096, and more kept for its gradient.
    scores = tf.matmul(query / temperature, candidate, transpose_b=True)           # [b, n]
    labels = tf.range(tf.shape(scores)[0]) + offset                                 # [b]
    columns = tf.range(tf.shape(scores)[1])                                          # [n]
    positive = labels[:, None] == columns[None, :]                                   # [b, n]
    addend = None
    if sampling_probability is not None:                                             # [1, n]
        probability = tf.cast(sampling_probability, scores.dtype)
        addend = -tf.math.log(tf.clip_by_value(probability, 1e-6, 1.0))[None, :]
    if candidate_ids is not None:                       # [b, n], one tensor with the logQ
        query_ids = tf.gather(candidate_ids, labels)                                 # [b]
        same = (query_ids[:, None] == candidate_ids[None, :]) & ~positive
        addend = tf.where(same, tf.constant(tfrs.layers.loss.MIN_FLOAT, scores.dtype),
                          tf.zeros([], scores.dtype) if addend is None else addend)
    if addend is not None:
        scores += tf.stop_gradient(addend)
    if num_hard_negatives is not None:    # the positive and the k best-scoring negatives
        keep = tf.minimum(num_hard_negatives + 1, tf.shape(scores)[1])
        ceiling = tf.constant(tfrs.layers.loss.MAX_FLOAT, scores.dtype)
        _, kept = tf.math.top_k(tf.where(positive, ceiling, scores), keep)           # [b, k+1]
        scores, labels = tf.gather(scores, kept, batch_dims=1), tf.zeros_like(labels)
    return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, scores))


def global_candidates(candidate: tf.Tensor, candidate_ids: tf.Tensor | None = None,
                      sampling_probability: tf.Tensor | None = None):
    """The candidates of the global batch, for this replica's queries to be scored against
    under a strategy that splits each batch across synchronous replicas (mirrored,
    multi-worker): without it each replica's in-batch softmax, accidental hits and hard
    negatives would see only its own slice of the batch (512 candidates a query at batch 4096
    on 8 GPUs), another objective on every number of replicas.

    The rows are all-gathered in replica order (`ReplicaContext.all_gather`, whose gradient
    sums every replica's gradient with respect to the gathered rows and hands each replica
    its own rows', so that each candidate tower gets the whole batch's gradient of its rows).
    Each replica's scores are then [b, n]: one device's [n, n] split across the replicas.
    With one replica (one device; a parameter-server worker, which trains on batches of its
    own) nothing is gathered.

    Args:
        candidate: [b, d] this replica's candidate embeddings; candidate_ids,
            sampling_probability: [b] or None (no gradient flows through them).

    Returns:
        (candidate [n, d], candidate_ids [n] or None, sampling_probability [n] or None,
        offset [] int32: the row of this replica's first candidate), n the global batch's rows.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return candidate, candidate_ids, sampling_probability, 0
    sizes = context.all_gather(tf.shape(candidate)[:1], axis=0)                 # [replicas]
    offset = tf.reduce_sum(sizes[:context.replica_id_in_sync_group])
    extras = {name: tf.stop_gradient(x) for name, x in (("ids", candidate_ids),
                                                        ("probability", sampling_probability))
              if x is not None}
    extras = context.all_gather(extras, axis=0) if extras else {}               # [n] each
    return (context.all_gather(candidate, axis=0), extras.get("ids"),             # [n, d]
            extras.get("probability"), offset)


class TwoTower(TFRSModel):
    """Query tower: user id, user features, encoded history. Candidate tower: item id, genres,
    year. Items enter both towers as catalogue codes ([batch] int64). Its loss is the in-batch
    softmax summed over the global batch (`summed_loss`): under a synchronous strategy each
    replica's queries are scored against every replica's candidates (`global_candidates`)."""

    summed_loss = True

    def __init__(self, config: RetrievalConfig, *, num_users: int, item_index: np.ndarray,
                 item_vocab_size: int, item_genres: np.ndarray, item_year: np.ndarray,
                 history_length: int, user_feature_sizes: dict[str, int],
                 item_probability: np.ndarray):
        super().__init__()
        self.config = config
        dim = config.embedding_dim
        self.item_probability = tf.constant(np.maximum(item_probability, 1e-9), tf.float32)
        self.item_features = ItemFeatures(item_index, item_vocab_size, item_genres, item_year,
                                          dim, use_features=config.use_item_features)
        self.user_embedding = tf.keras.layers.Embedding(num_users, dim) if config.use_user_id else None
        self.user_feature_embeddings = {
            name: tf.keras.layers.Embedding(size, 8, name=f"user_{name}_embedding")
            for name, size in (user_feature_sizes.items() if config.use_user_features else [])}
        self.history_encoder = (None if config.history_encoder == "none" else
                                HistoryEncoder(config.history_encoder, dim, history_length))
        self.query_head = self._head(dim)
        self.candidate_head = self._head(dim)

    @staticmethod
    def _head(dim: int) -> tf.keras.Sequential:
        return tf.keras.Sequential([tf.keras.layers.Dense(2 * dim, "relu"),
                                    tf.keras.layers.Dense(dim, dtype="float32")])

    def _finish(self, x: tf.Tensor) -> tf.Tensor:
        x = tf.cast(x, tf.float32)
        return tf.math.l2_normalize(x, axis=-1) if self.config.l2_normalize else x

    def query(self, features: dict[str, tf.Tensor]) -> tf.Tensor:
        """{"user": [b], "history": [b, L], "user_NAME": [b]} -> [b, d] float32."""
        parts = []
        if self.user_embedding is not None:
            parts.append(self.user_embedding(features["user"]))
        for name, embedding in self.user_feature_embeddings.items():
            parts.append(embedding(features[f"user_{name}"]))
        if self.history_encoder is not None:
            history = features["history"]
            if self.config.history_encoder == "gru":
                history = right_align(history)
            embeddings = self.item_features.id_embedding(history)            # [b, L, d]
            parts.append(self.history_encoder(embeddings, history))
        return self._finish(self.query_head(tf.concat(parts, axis=-1)))

    def candidate(self, items: tf.Tensor) -> tf.Tensor:
        """[b] int64 catalogue codes -> [b, d] float32."""
        return self._finish(self.candidate_head(self.item_features(items)))

    def candidate_inputs(self) -> np.ndarray:
        """[num_items, f] float64 what the candidate tower reads of each catalogue code: its
        id's vocabulary index (1 for every item without training rows), then the year bucket
        and genres when the tower uses them. Equal rows are one input, one embedding."""
        features = self.item_features
        columns = [features.item_index.numpy()[:, None]]                      # [I, 1]
        if features.year_embedding is not None:
            columns.append(year_bucket(features.item_year).numpy()[:, None])  # [I, 1]
        if features.genre_projection is not None:
            columns.append(features.item_genres.numpy())                      # [I, g]
        return np.concatenate(columns, axis=1, dtype=np.float64)

    def compute_loss(self, features: dict[str, tf.Tensor], training: bool = False) -> tf.Tensor:
        items = features["item"]
        probability = (tf.gather(self.item_probability, items)
                       if self.config.logq_correction else None)
        # The query tower first: layers build in this order, and an initial weight's seed
        # follows the ops created before it.
        query = self.query(features)
        candidate, ids, probability, offset = global_candidates(
            self.candidate(items), items if self.config.remove_accidental_hits else None,
            probability)
        return in_batch_softmax_loss(query, candidate, self.config.temperature, probability, ids,
                                     self.config.num_hard_negatives, offset)


class TowerEnsemble(TFRSModel):
    """`config.members` two-tower models (`TwoTower`) trained side by side on the same batches,
    each on its own loss from its own initial weights, and served as one model: its query
    embedding is the members' side by side divided by their number, its candidate embedding
    theirs side by side, so that one dot product (and one ScaNN index) gives the mean of the
    members' scores. Each member alone varies with its seed; their mean varies less.

    `query`: features -> [b, members * d] float32; `candidate`: [b] codes -> [b, members * d].
    Each member's loss is its own (its gradients are those it would get alone); the loss
    logged is their sum.
    """

    summed_loss = True

    def __init__(self, config: RetrievalConfig, **towers):
        super().__init__()
        self.config = config
        one = dataclasses.replace(config, members=1)
        self.members = [TwoTower(one, **towers) for _ in range(config.members)]

    def query(self, features: dict[str, tf.Tensor]) -> tf.Tensor:
        return tf.concat([member.query(features) for member in self.members], axis=-1) / \
            float(len(self.members))

    def candidate(self, items: tf.Tensor) -> tf.Tensor:
        return tf.concat([member.candidate(items) for member in self.members], axis=-1)

    def candidate_inputs(self) -> np.ndarray:
        """What every member's candidate tower reads (`TwoTower.candidate_inputs`): the same."""
        return self.members[0].candidate_inputs()

    def compute_loss(self, features: dict[str, tf.Tensor], training: bool = False) -> tf.Tensor:
        return tf.add_n([member.compute_loss(features, training) for member in self.members])


RetrievalModel = TwoTower | TowerEnsemble    # what `retrieval.train.build_model` gives
