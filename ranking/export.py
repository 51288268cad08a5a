"""SavedModel export of the ranking stage in TF Serving's `BASE/VERSION/` layout.

Signatures (batch is dimension 0):
    serving_default: user_id [b] string, item_ids [b, n] string -> scores [b, n] float32
    candidates: user_id [b] string, item_ids [b, n] string -> item_ids [b, n + E] string: the
        given list (retrieval's), then the user's E title candidates
        (`ranking.features.title_candidates`), "" where fewer remain; E is 0 without them
The users' state of the fit rows is baked in, with the signals (the transition and
co-occurrence tables of the training rows, the items' popularity in the fit rows' periods and
each user's latest period, the title similarities of the item table); users it does not know
are scored by the share the retrieval export serves them (`ModelInputs.popular`, so every
model serves them the popular order), and unknown items score below every other item of their
list, without failing. Stock TF ops only.
`assets.extra/state.json` records the state, as the retrieval export does.
"""
from __future__ import annotations

import os

import numpy as np
import scipy.sparse as sp
import tensorflow as tf

from tworec.features.inputs import ModelInputs
from tworec.features.layers import (UserInputs, hold_model, id_lookup, in_row_blocks,
                                    write_state)
from tworec.ranking.features import TITLE_SIGNAL, RankingSignals, pair_keys, sum_in_order
from tworec.ranking.model import RankingModel
from tworec.serving.layout import save_servable, write_version, write_warmup_requests


# (user, item) pairs scored at once: the ranker's intermediates take a few KiB a pair (3.3 KiB
# for the default DCN), so a block of them tens of MiB.
PAIRS_PER_BLOCK = 1 << 13


def pair_table(matrix: sp.csr_matrix) -> tf.lookup.StaticHashTable:
    """(row * V + column vocabulary index) int64 -> float32 value of a [V, V] matrix (transition
    counts, similarities), 0 when absent. The keys and values of `pair_keys`: their last key,
    which no lookup reaches, gives a matrix without entries (no user with two training rows:
    no transitions) a table TF can build, as it imports no table of no keys."""
    keys, values = pair_keys(matrix)
    return tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(tf.constant(keys), tf.constant(values)),
        default_value=0.0)


def neighbor_arrays(matrix: sp.csr_matrix) -> tuple[np.ndarray, np.ndarray]:
    """([V, W] int64 column codes, -1 past a row's entries; [V, W] float32 values, 0 there)
    of a CSR matrix whose rows hold at most W entries: each row's neighbours."""
    per_row = np.diff(matrix.indptr)
    width = int(per_row.max(initial=0))
    row = np.repeat(np.arange(matrix.shape[0]), per_row)
    slot = np.arange(matrix.nnz) - matrix.indptr[row]
    codes = np.full((matrix.shape[0], width), -1, np.int64)
    values = np.zeros((matrix.shape[0], width), np.float32)
    codes[row, slot], values[row, slot] = matrix.indices, matrix.data
    return codes, values


def in_rows(rows: tf.Tensor, items: tf.Tensor, codes: tf.Tensor, num_items: int) -> tf.Tensor:
    """[b, M] bool: whether each of `codes` [b, M] (>= 0) is among its row's items, given as
    (batch row [s], item code [s] >= 0) pairs; memory grows with s, not with b times a row's
    most."""
    keys = tf.concat([[-1], tf.sort(rows * num_items + items)], axis=0)           # [s + 1]
    wanted = tf.range(tf.shape(codes, out_type=tf.int64)[0])[:, None] * num_items + codes
    at = tf.searchsorted(keys[None, :], tf.reshape(wanted, [1, -1]))[0]             # [b * M]
    found = tf.gather(keys, tf.minimum(at, tf.size(keys) - 1)) == tf.reshape(wanted, [-1])
    return tf.reshape(found, tf.shape(codes))


class RankingModule(tf.Module):
    """The servable: lookups, the signals baked in as tables, and the ranker."""

    def __init__(self, model: RankingModel, data: ModelInputs, signals: RankingSignals):
        super().__init__()
        hold_model(self, model)
        self.users = UserInputs(data)
        self.item_codes = id_lookup(data.interactions.item_ids)
        self.retrieval_latest, self.retrieval_items = (
            (tf.constant(signals.retrieval_latest), tf.constant(signals.retrieval_items))  # [U, e], [I, e]
            if signals.has_retrieval else (None, None))
        self.item_index = tf.constant(data.item_index, tf.int64)                         # [I]
        self.popularity = tf.constant(data.popular["test"].share)                       # [I]
        self.vocab_size = data.items.size
        self.transitions = (None if signals.transitions is None
                            else pair_table(signals.transitions))
        self.cooccurrence = (None if signals.cooccurrence is None
                             else pair_table(signals.cooccurrence.full))
        popularity = signals.popularity
        # (period * I + item) -> popularity: only the non-zero entries, and a lookup per
        # candidate (a gathered [b, I] table row would cost the catalogue per served row).
        self.period_popularity, self.user_period, self.periods = (
            (None, None, 0) if popularity is None else
            (pair_table(sp.csr_matrix(popularity.tables["test"])),
             tf.constant(popularity.user_period["test"]), popularity.periods))    # [U]
        self.num_items = data.num_items
        self.titles = None if signals.titles is None else pair_table(signals.titles.matrix)
        self.title_candidates = (signals.titles.candidates if signals.titles is not None else 0)
        if self.title_candidates:
            self.exclude_seen = data.exclude_seen
            self.item_ids = tf.constant(np.append(data.interactions.item_ids, ""))      # [I + 1]
            self.latest_for_candidates = signals.titles.candidate_history               # L'
            codes, values = neighbor_arrays(signals.titles.candidate_matrix)            # [V, W]
            self.neighbor_codes, self.neighbor_values = tf.constant(codes), tf.constant(values)
            self.similar_width = self.latest_for_candidates * codes.shape[1]   # M = L' * W

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id"),
                                  tf.TensorSpec([None, None], tf.string, name="item_ids")])
    def serve(self, user_id, item_ids):
        """Scores at most PAIRS_PER_BLOCK (user, item) pairs at a time (`in_row_blocks`; a row
        longer than that in segments of it): a request's memory grows with its pairs by their
        inputs and scores, not by the ranker's intermediates."""
        items = self.item_codes.lookup(item_ids)                                         # [b, n]
        scores = tf.cond(tf.size(items) <= PAIRS_PER_BLOCK,
                         lambda: self._scores(user_id, items),
                         lambda: self._scores_in_blocks(user_id, items))                  # [b, n]
        lowest = tf.reduce_min(scores, axis=1, keepdims=True) - 1.0      # [b, 1] per row
        return {"scores": tf.where(items >= 0, scores, lowest)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id"),
                                  tf.TensorSpec([None, None], tf.string, name="item_ids")])
    def candidates(self, user_id, item_ids):
        """item_ids [b, n] -> item_ids [b, n + E]: the given candidates, then the user's E title
        candidates (`ranking.features.title_candidates`: the training rows' items most
        title-similar to one of their latest items, neither given nor seen; "" where fewer
        remain, and for a user it does not know)."""
        if not self.title_candidates:
            return {"item_ids": item_ids}
        features, known = self.users(user_id)
        batch = tf.shape(user_id)[0]
        latest = features["history"][:, -self.latest_for_candidates:]                  # [b, L']
        similar = tf.reshape(tf.gather(self.neighbor_codes, latest),
                             [batch, self.similar_width])                               # [b, M]
        values = tf.reshape(tf.gather(self.neighbor_values, latest), [batch, self.similar_width])
        # Codes ascending, each code's highest similarity first: by similarity, then (stable)
        # by code; top_k below then breaks ties of similarity to the lower code.
        by_similarity = tf.argsort(-values, axis=1, stable=True)
        similar = tf.gather(similar, by_similarity, batch_dims=1)
        values = tf.gather(values, by_similarity, batch_dims=1)
        by_code = tf.argsort(similar, axis=1, stable=True)
        similar = tf.gather(similar, by_code, batch_dims=1)
        values = tf.gather(values, by_code, batch_dims=1)
        repeated = tf.concat([tf.zeros([batch, 1], tf.bool),
                              similar[:, 1:] == similar[:, :-1]], axis=1)               # [b, M]
        given = self.item_codes.lookup(item_ids)                                    # [b, n]
        listed = tf.where(given >= 0)                          # [s, 2] (row, slot) of known ids
        rows, items = listed[:, 0], tf.gather_nd(given, listed)
        if self.exclude_seen:                                  # and the users' seen items
            seen_rows, seen_items = self.users.seen(*self.users.codes(user_id))
            rows, items = tf.concat([rows, seen_rows], 0), tf.concat([items, seen_items], 0)
        usable = (similar >= 0) & ~repeated & known[:, None] & ~in_rows(
            rows, items, similar, self.num_items)
        width = min(self.title_candidates, self.similar_width)
        best, slot = tf.math.top_k(tf.where(usable, values, -1.0), k=width)            # [b, E']
        found = tf.where(best > 0, tf.gather(similar, slot, batch_dims=1), self.num_items)
        found = tf.pad(found, [[0, 0], [0, self.title_candidates - width]],
                       constant_values=self.num_items)                                   # [b, E]
        return {"item_ids": tf.concat([item_ids, tf.gather(self.item_ids, found)], axis=1)}

    def _scores_in_blocks(self, user_id, items):
        """`_scores` of blocks of rows, each row longer than a block cut in segments."""
        width = tf.shape(items)[1]
        columns = tf.clip_by_value(width, 1, PAIRS_PER_BLOCK)
        per_row = tf.maximum((width + columns - 1) // columns, 1)   # 1 unless a row is long
        segments = tf.reshape(tf.pad(items, [[0, 0], [0, per_row * columns - width]],
                                     constant_values=-1), [-1, columns])        # [b * per_row, c]
        owners = tf.repeat(user_id, per_row)                                     # [b * per_row]
        (scores,) = in_row_blocks(
            lambda start, end: (self._scores(owners[start:end], segments[start:end]),),
            tf.shape(segments)[0], PAIRS_PER_BLOCK // columns,
            (tf.TensorSpec([None, None], tf.float32),))
        return tf.reshape(scores, [-1, per_row * columns])[:, :width]                   # [b, n]

    def _scores(self, user_id, items):
        """[b, n] scores of users `user_id` [b] for catalogue codes `items` [b, n] (-1 for an
        unknown item, scored as code 0: `serve` places it last)."""
        features, known = self.users(user_id)
        codes, _ = self.users.codes(user_id)                               # [b], 0 if unknown
        features["items"] = tf.maximum(items, 0)
        if self.retrieval_latest is not None:
            query = tf.gather(self.retrieval_latest, codes) * tf.cast(known, tf.float32)[:, None]
            features["retrieval_scores"] = tf.einsum(                                    # [b, n]
                "be,bne->bn", query, tf.gather(self.retrieval_items, features["items"]))
        if self.transitions is not None:
            last = features["history"][:, -1:]                                          # [b, 1]
            keys = last * self.vocab_size + tf.gather(self.item_index, features["items"])
            features["transitions"] = tf.math.log1p(self.transitions.lookup(keys))      # [b, n]
        if self.cooccurrence is not None:
            candidates = tf.gather(self.item_index, features["items"])[:, None]         # [b, 1, n]
            keys = features["history"][:, :, None] * self.vocab_size + candidates       # [b, L, n]
            features["cooccurrence"] = sum_in_order(self.cooccurrence.lookup(keys))      # [b, n]
        if self.period_popularity is not None:
            features.update(self.popularity_signals(codes, features["items"]))
        if self.titles is not None:
            keys = features["history"][:, :, None] * self.num_items + features["items"][:, None]
            features[TITLE_SIGNAL] = tf.reduce_max(self.titles.lookup(keys), axis=1)    # [b, n]
        return tf.where(known[:, None], self.model(features),                            # [b, n]
                        tf.gather(self.popularity, features["items"]))

    def popularity_signals(self, codes, items):
        """The held-out popularity signals of users `codes` [b] and `items` [b, n]: each
        item's popularity in the last period and in the user's latest period, [b, n] each."""
        with tf.name_scope("period_popularity"):     # groups their ops in the saved graph
            last = tf.constant((self.periods - 1) * self.num_items, tf.int64)
            period = tf.gather(self.user_period, codes)[:, None]                         # [b, 1]
            return {"recent_popularity": self.period_popularity.lookup(last + items),
                    "user_time_popularity": self.period_popularity.lookup(
                        period * self.num_items + items)}


def export(model: RankingModel, data: ModelInputs, signals: RankingSignals, base_path: str,
           version: int | None = None, warmup: dict[str, np.ndarray] | None = None) -> str:
    """Writes a new version of the ranking SavedModel under `base_path`; returns its folder.

    With `warmup` ({"user_id": [w], "item_ids": [w, n]} strings) the version carries TF
    Serving warmup requests of both signatures.
    """
    module = RankingModule(model, data, signals)

    def write(path: str) -> None:
        save_servable(module, path, {"serving_default": module.serve,
                                     "candidates": module.candidates})
        write_state(path, data)
        if warmup is not None:
            inputs = {k: np.asarray(v, dtype=object) for k, v in warmup.items()}
            write_warmup_requests(path, os.path.basename(os.path.normpath(base_path)),
                                  {"serving_default": inputs, "candidates": inputs})
    return write_version(base_path, write, version=version)
