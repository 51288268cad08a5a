"""Deep ranking models scoring (user, candidate list) pairs: DCN-v2 and a BST-style
behaviour-sequence transformer, with an optional rating head (multitask)."""
from __future__ import annotations

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

from tworec.features.layers import ItemFeatures
from tworec.features.training import TFRSModel
from tworec.ranking.config import RankingConfig
from tworec.ranking.features import POPULARITY_SIGNALS, TITLE_SIGNAL
from tworec.ranking.sequence import SequenceTransformer

def mlp(units: tuple[int, ...]) -> tf.keras.Sequential:
    return tf.keras.Sequential([tf.keras.layers.Dense(u, "relu") for u in units])


class RankingModel(TFRSModel):
    """Scores every item of a candidate list for a user.

    Inputs: {"user": [b], "user_NAME": [b], "history": [b, L] vocabulary indexes (0 pads),
    "items": [b, n] catalogue codes, with `use_retrieval` "retrieval_scores": [b, n] the
    retrieval stage's dot product of each pair, with `config.use_transitions` "transitions":
    [b, n] log(1 + how often the candidate followed the latest history item), with
    `config.cooccurrence_neighbors` "cooccurrence": [b, n] the sum of the candidate's
    co-occurrence similarities to the history items, with `config.held_out_periods` (held-out
    lists only; never for a regression ranker) "recent_popularity" and "user_time_popularity":
    [b, n], with `use_titles` (held-out lists only; never for a regression ranker)
    "title_similarity": [b, n] the candidate's highest title similarity to a history item, and
    for training "rating": [b] of the item in slot 0}.
    `ranking.features.list_examples` builds them, and the export computes them in the graph
    from the same signals.
    Output of `call`: scores [b, n] float32 (logits; a regression ranker's: predicted ratings).

    Each signal (retrieval score, transitions, co-occurrence) enters twice: as a pair feature,
    and through a learnt scalar weight in the logit, so the ranker starts from retrieval's order
    and learns what to change. Transitions carry what a dot product cannot: which items follow
    which; co-occurrence, how close the candidate is to each history item, not to their mean.
    The popularity and title signals (`held_out_signals`) only enter through their weight,
    which stays 0 in training (training lists lack them) and which calibration alone sets.
    The model holds weights only; every signal arrives as an input. A regression ranker has
    no logit: its candidates' scores are the rating head's, and the signals are features only.
    """

    def __init__(self, config: RankingConfig, *, num_users: int, item_index: np.ndarray,
                 item_vocab_size: int, item_genres: np.ndarray, item_year: np.ndarray,
                 history_length: int, user_feature_sizes: dict[str, int], has_ratings: bool,
                 use_retrieval: bool = False, use_titles: bool = False):
        super().__init__()
        self.config = config
        self.history_length = history_length
        self.use_retrieval = use_retrieval
        dim = config.embedding_dim
        self.signal_names = (["retrieval_scores"] if use_retrieval else []) + \
            (["transitions"] if config.use_transitions else []) + \
            (["cooccurrence"] if config.cooccurrence_neighbors else [])
        self.held_out_signals = (list(POPULARITY_SIGNALS) if config.held_out_periods else []) + \
            ([TITLE_SIGNAL] if use_titles and config.held_out_title_neighbors else [])
        self.signal_weights = {       # float32 always; held-out ones set by calibration only
            name: self.add_weight(name=f"{name}_weight", shape=(), initializer="zeros",
                                  autocast=False, trainable=name in self.signal_names)
            for name in self.logit_signals}                 # none for regression: no logit
        self.item_features = ItemFeatures(item_index, item_vocab_size, item_genres, item_year, dim)
        self.user_embedding = tf.keras.layers.Embedding(num_users, dim)
        self.user_feature_embeddings = {
            name: tf.keras.layers.Embedding(size, 8, name=f"user_{name}_embedding")
            for name, size in user_feature_sizes.items()}
        if config.model == "dcn":
            self.cross = [tfrs.layers.dcn.Cross(projection_dim=config.projection_dim,
                                                kernel_initializer="glorot_uniform")
                          for _ in range(config.cross_layers)]
            self.deep = mlp(config.deep_layers)
        else:
            self.positions = tf.keras.layers.Embedding(history_length + 1, dim)
            self.transformer = SequenceTransformer(config.bst_heads,
                                                   max(1, dim // config.bst_heads), dim)
            self.deep = mlp(config.bst_layers)
        # a regression ranker scores candidates by the rating head alone
        self.score_head = (None if config.task == "regression"
                           else tf.keras.layers.Dense(1, dtype="float32"))
        self.use_rating = has_ratings and (config.rating_weight > 0 or config.task == "regression")
        self.rating_head = (tf.keras.Sequential([tf.keras.layers.Dense(64, "relu"),
                                                 tf.keras.layers.Dense(1, dtype="float32")])
                            if self.use_rating else None)
        if config.task == "listwise":
            self.ranking_task = tfrs.tasks.Ranking(
                loss=tf.keras.losses.CategoricalCrossentropy(from_logits=True))
        elif config.task == "binary":
            self.ranking_task = tfrs.tasks.Ranking(
                loss=tf.keras.losses.BinaryCrossentropy(from_logits=True),
                metrics=[tf.keras.metrics.AUC(from_logits=True, name="auc")])
        else:
            self.ranking_task = None
        self.rating_task = (tfrs.tasks.Ranking(
            loss=tf.keras.losses.MeanSquaredError(),
            metrics=[tf.keras.metrics.RootMeanSquaredError(name="rmse")])
            if self.use_rating else None)

    @property
    def logit_signals(self) -> list[str]:
        """Every signal with a weight in the logit: the pair features', then the held-out ones
        (none for a regression ranker, which has no logit)."""
        if self.config.task == "regression":
            return []
        return self.signal_names + self.held_out_signals

    def _user(self, features) -> tf.Tensor:
        """[b, fu]: user id, user features, the mean of the history's item embeddings and the
        latest item's embedding (sessions: the next item depends most on the last one)."""
        history = features["history"]
        embeddings = self.item_features.id_embedding(history)                    # [b, L, d]
        weights = tf.cast(history > 0, embeddings.dtype)[..., None]              # [b, L, 1]
        pooled = tf.reduce_sum(embeddings * weights, 1) / tf.maximum(tf.reduce_sum(weights, 1), 1.0)
        parts = [self.user_embedding(features["user"]), pooled, embeddings[:, -1]]
        parts += [embedding(features[f"user_{name}"])
                  for name, embedding in self.user_feature_embeddings.items()]
        return tf.concat(parts, axis=-1)

    def _sequence(self, history: tf.Tensor, items: tf.Tensor) -> tf.Tensor:
        """BST block: [b, L] history and [b, n] targets -> [b * n, (L + 1) * d]."""
        length = self.history_length
        positions = self.positions(tf.range(length + 1))                          # [L+1, d]
        past = self.item_features.id_embedding(history)                           # [b, L, d]
        target = self.item_features.id_embedding(tf.gather(self.item_features.item_index, items))
        x = self.transformer(past + tf.cast(positions[:length], past.dtype), history > 0,
                             target + tf.cast(positions[length], target.dtype))  # [b, n, L+1, d]
        return tf.reshape(x, [-1, (length + 1) * x.shape[-1]])

    def representation(self, features) -> tf.Tensor:
        """[b, n, h] representation of every (user, candidate) pair."""
        items = features["items"]                                                 # [b, n]
        b, n = tf.shape(items)[0], tf.shape(items)[1]
        user = self._user(features)                                               # [b, fu]
        item = self.item_features(items)                                          # [b, n, fi]
        parts = [tf.repeat(user, n, axis=0), tf.reshape(item, [b * n, item.shape[-1]])]
        for name in self.signal_names:
            parts.append(tf.cast(tf.reshape(features[name], [b * n, 1]), user.dtype))
        pairs = tf.concat(parts, axis=-1)                                         # [b*n, F]
        if self.config.model == "dcn":
            if self.config.cross_structure == "stacked":
                x = pairs
                for cross in self.cross:
                    x = cross(pairs, x)
            else:
                x = tf.concat([cross(pairs) for cross in self.cross], axis=-1)
        else:
            x = tf.concat([pairs, self._sequence(features["history"], items)], axis=-1)
        hidden = self.deep(x)                                                     # [b*n, h]
        return tf.reshape(hidden, [b, n, hidden.shape[-1]])

    def _logits(self, features, hidden: tf.Tensor, held_out: bool = True) -> tf.Tensor:
        """[b, n] scores from the pair representations [b, n, h]; without the held-out signals
        for training lists (`held_out` False), which lack them."""
        logits = tf.squeeze(self.score_head(hidden), -1)
        for name in self.logit_signals if held_out else self.signal_names:
            logits += (tf.cast(self.signal_weights[name], tf.float32) *
                       tf.cast(features[name], tf.float32))
        return logits

    def call(self, features) -> tf.Tensor:
        """[b, n] scores of the candidates: the logit, or a regression ranker's predicted
        ratings."""
        hidden = self.representation(features)                                    # [b, n, h]
        if self.score_head is None:
            return tf.squeeze(self.rating_head(hidden), -1)
        return self._logits(features, hidden)

    def predict_rating(self, features) -> tf.Tensor:
        """[b] predicted rating of the item in slot 0."""
        return tf.squeeze(self.rating_head(self.representation(features)[:, 0]), -1)

    def compute_loss(self, features, training: bool = False) -> tf.Tensor:
        hidden = self.representation(features)                                    # [b, n, h]
        loss = tf.constant(0.0)
        if self.ranking_task is not None:
            scores = self._logits(features, hidden, held_out=False)               # [b, n]
            labels = tf.one_hot(tf.zeros_like(scores[:, 0], tf.int32), tf.shape(scores)[1])
            if self.config.task == "binary":
                labels, scores = tf.reshape(labels, [-1, 1]), tf.reshape(scores, [-1, 1])
            loss += self.config.ranking_weight * self.ranking_task(labels=labels, predictions=scores)
        if self.rating_task is not None:
            rating = tf.squeeze(self.rating_head(hidden[:, 0]), -1)
            weight = 1.0 if self.config.task == "regression" else self.config.rating_weight
            loss += weight * self.rating_task(labels=features["rating"], predictions=rating)
        return loss
