"""SavedModel exports of the retrieval stage, in TF Serving's `BASE/VERSION/` layout.

`retrieval` (brute force, stock TF ops only) and `retrieval_scann` (ScaNN ops) share one
module: string ids at the boundary, the users' state baked in (their latest items and seen
items of the rows the model was fit on), the popular items for users it does not know
(`ModelInputs.popular`: the most frequent in the latest share of the fit rows). It serves the
catalogue of the fit rows (`ModelInputs.catalogue`): an item they do not hold (of the item
table alone, or of held-out rows) is never served. A known
user is never served an item of their state, nor a `with_history` request the items it
passed (a known user's: neither), unless the export is made with `exclude_seen=False`; the top
k of what remains come back (ScaNN over-fetches k plus the most items any user has seen or a
history holds, and refuses a request that skips more). A slot left without an item
(the catalogue exhausted) holds the id "" and the lowest float32 score.

Signatures (batch is dimension 0):
    serving_default: user_id [b] string -> item_ids [b, k] string, scores [b, k] float32
    with_history: user_id [b] string, history [b, L] string (oldest first, "" for padding
        anywhere, any L: the towers read the latest `history_length` items, as the evaluation
        does) -> item_ids, scores; a user it does not know whose latest `history_length`
        items hold none with training rows (any user, when the towers read no history) gets
        the popular items, the given ones skipped
    embed_user: user_id [b] string -> embedding [b, d] float32
    embed_items: item_ids [n] string -> embedding [n, d] float32 (an id neither the log nor
        the item table has: the out-of-vocabulary id row, no features)
    known_users: user_id [b] string -> known [b] bool (fit rows of the user: else popular items)
d is the model's query and candidate width: `embedding_dim` times its members; a user's
embedding dotted with an item's is the score served (with several members, the mean of
theirs: the user's embedding is the members' side by side divided by their number).

`assets.extra/state.json` records the state: the fit rows, their users and items, the last
timestamp, and whether seen items are excluded.
"""
from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from tworec.features.inputs import ModelInputs
from tworec.features.layers import (UserInputs, hold_model, id_lookup, in_row_blocks,
                                    inference_tracing, write_state)
from tworec.features.vocab import FIRST, OOV, PAD
from tworec.retrieval.index import ScannParams, build_index
from tworec.retrieval.model import RetrievalModel
from tworec.retrieval.train import candidate_embeddings
from tworec.serving.layout import save_servable, write_version, write_warmup_requests


# Scores one search block may hold ([rows, I]: 64 MiB of float32; with the masked copy, the
# int32 mask of excluded items and its bool about 210 MiB): a request's memory grows with its
# rows by k, not by the catalogue. At 1M items that is 16 rows a block, between the measured
# 32 rows (512 users: 0.90 to 0.95 s) and 8 (1.01 s), against 0.80 s in one block of 4 GiB.
SCORES_PER_BLOCK = 1 << 24


def scann_fetch(data: ModelInputs, k: int, exclude_seen: bool = True) -> int:
    """How many items the ScaNN export fetches so that k remain once a user's seen (or a
    request's given) items are gone: k plus the most any user has seen or a history holds. A
    `with_history` request of a known user skips both; beyond what the fetch leaves room for,
    the export refuses it in one line (the brute-force export serves it)."""
    most_seen = int(np.diff(data.seen.indptr).max(initial=0))
    return min(int(data.catalogue.sum()), k + max(most_seen, data.history_length) * exclude_seen)


def usable_top_k(scores: tf.Tensor, codes: tf.Tensor, excluded: tf.Tensor, k: int
                 ) -> tuple[tf.Tensor, tf.Tensor]:
    """The best k of ScaNN's answers (scores, codes [b, f]) that are neither `excluded`
    ([b, num_items] bool) nor ScaNN's padding: when the searched leaves hold fewer than f
    items, a batch's answer is as wide as its fullest row (maybe under k), the other rows
    padded with a NaN score and code 0. ([b, k] scores, -inf where none is left; [b, k]
    codes)."""
    short = tf.maximum(k - tf.shape(scores)[1], 0)     # ScaNN may answer fewer columns
    scores = tf.pad(scores, [[0, 0], [0, short]], constant_values=np.nan)
    codes = tf.pad(codes, [[0, 0], [0, short]])
    unusable = tf.logical_or(tf.gather(excluded, codes, batch_dims=1),
                             tf.logical_not(tf.math.is_finite(scores)))
    scores, order = tf.math.top_k(tf.where(unusable, -np.inf, scores), k=k)
    return scores, tf.gather(codes, order, batch_dims=1)


def latest_items(index: tf.Tensor, length: int) -> tf.Tensor:
    """A request's histories as the towers were trained and evaluated on them: [b, L] item
    indexes, oldest first, PAD anywhere -> [b, max(length, 1)] the latest `length` items in
    their order, left-padded (one PAD slot for length 0: no history)."""
    filled = tf.cast(index != PAD, tf.int32)
    index = tf.gather(index, tf.argsort(filled, axis=1, stable=True), batch_dims=1)  # pads first
    if not length:
        return tf.fill([tf.shape(index)[0], 1], tf.constant(PAD, tf.int64))
    index = tf.pad(index, [[0, 0], [tf.maximum(length - tf.shape(index)[1], 0), 0]])
    return index[:, tf.shape(index)[1] - length:]                                  # [b, length]


def traced_query(model: RetrievalModel) -> tf.types.experimental.PolymorphicFunction:
    """`model.query` as one `tf.function` a model, kept on the model (untracked): the
    signatures of every export of the model call it, so the query tower is traced once for
    each history shape ([b, L] baked in, [b, None] given), not once for each signature of each
    export (a tiny two-member model: 2.4 s a trace)."""
    # Set past Keras's tracking (checkpoints skip it), in a dict: a SavedModel holding the
    # whole model (`hold_model`) saves every function attribute with its traces.
    functions = model.__dict__.setdefault("_tworec_functions", {})
    if "query" not in functions:
        functions["query"] = tf.function(model.query)
    return functions["query"]


class RetrievalModule(tf.Module):
    """The servable: lookups, the user state, the query tower and a top-k search."""

    def __init__(self, model: RetrievalModel, data: ModelInputs, k: int,
                 scann: ScannParams | None = None, exclude_seen: bool = True):
        super().__init__()
        interactions = data.interactions
        hold_model(self, model)
        self.k, self.exclude_seen = k, exclude_seen
        reads_history = model.config.history_encoder != "none"          # one member or more
        self.history_length = data.history_length if reads_history else 0
        self.num_items = interactions.num_items
        self.users = UserInputs(data)
        self.item_codes = id_lookup(interactions.item_ids)                              # id -> code
        self.item_ids = tf.constant(np.append(interactions.item_ids, ""))               # [I + 1]
        self.item_index = tf.constant(data.item_index)                                  # [I]
        popular = data.popular["test"]
        self.popular_order = tf.constant(popular.order, tf.int64)                       # [I]
        self.popular_place = tf.constant(np.argsort(popular.order), tf.int64)           # [I]
        self.popular_share = tf.constant(popular.share)                                 # [I]
        self.block_rows = max(SCORES_PER_BLOCK // self.num_items, 1)
        candidates = candidate_embeddings(model, interactions.num_items)                # [I, d]
        catalogue = data.catalogue
        self.catalogue_size = int(catalogue.sum())
        self.outside = tf.constant(~catalogue)                                          # [I]
        if scann is None:
            self.candidates, self.index = tf.constant(candidates), None
        else:
            self.fetch = scann_fetch(data, k, exclude_seen)
            codes = np.flatnonzero(catalogue)                                           # [C]
            self.index = build_index(candidates[codes], self.fetch, scann, codes=codes)

    def _top_k(self, features, known, excluded=None):
        """Top k codes of the query tower's scores, `excluded` ((row [n], code [n]) pairs,
        rows ascending) skipped, the popular items for rows not `known` (theirs skipped too).
        Rows are searched `block_rows` at a time (`in_row_blocks`): a [rows, I] score matrix
        and mask per block, never per request."""
        query = traced_query(self.model)(features)                                      # [b, d]
        batch = tf.shape(query)[0]
        rows, items = excluded if excluded is not None else (
            tf.zeros([0], tf.int64), tf.zeros([0], tf.int64))

        def block(start, end):
            bounds = tf.cast([[start, end]], tf.int64)
            lo, hi = tf.unstack(tf.searchsorted(rows[None, :], bounds)[0])   # its pairs
            pairs = tf.stack([rows[lo:hi] - tf.cast(start, tf.int64), items[lo:hi]], axis=1)
            mask = tf.scatter_nd(pairs, tf.ones([hi - lo], tf.int32),
                                 tf.cast([end - start, self.num_items], tf.int64)) > 0   # [r, I]
            return self._search(query[start:end], mask)
        specs = (tf.TensorSpec([None, self.k], tf.float32), tf.TensorSpec([None, self.k], tf.int64))
        scores, codes = tf.cond(batch <= self.block_rows, lambda: block(0, batch),
                                lambda: in_row_blocks(block, batch, self.block_rows, specs))
        unknown = tf.gather(tf.logical_not(known), rows)     # only their pairs matter here
        popular_scores, popular_codes = self._popular(
            batch, tf.boolean_mask(rows, unknown), tf.boolean_mask(items, unknown))
        scores = tf.where(known[:, None], scores, popular_scores)
        codes = tf.where(known[:, None], codes, popular_codes)
        empty = tf.math.is_inf(scores)                       # fewer than k items remained
        codes = tf.where(empty, tf.constant(self.num_items, tf.int64), codes)
        scores = tf.where(empty, tf.float32.min, scores)
        return {"item_ids": tf.gather(self.item_ids, codes), "scores": scores}

    def _popular(self, batch, rows, items):
        """([b, k] scores, [b, k] codes) of the popular items in their served order, each
        row's excluded (row [n], code [n]) pairs skipped: the first k free places of the first
        k + (the most pairs a row has) places; -inf scores where fewer than k remain. Given
        the pairs of unknown users alone (none in `serve`, a request's items in
        `with_history`), it costs [b, k + the request's width] at most."""
        pairs = tf.math.bincount(tf.cast(rows, tf.int32), minlength=batch, maxlength=batch,
                                 dtype=tf.int64)                                          # [b]
        width = tf.minimum(self.k + tf.reduce_max(tf.concat([pairs, [0]], 0)),
                           self.catalogue_size)            # the fit rows' items come first
        places = tf.gather(self.popular_place, items)                                   # [n]
        near = places < width
        taken = tf.scatter_nd(
            tf.stack([tf.boolean_mask(rows, near), tf.boolean_mask(places, near)], axis=1),
            tf.ones_like(tf.boolean_mask(places, near), tf.int32),
            tf.stack([tf.cast(batch, tf.int64), width])) > 0                        # [b, width]
        free, place = tf.math.top_k(tf.where(taken, -np.inf, -tf.cast(                 # [b, k]
            tf.range(width), tf.float32)[None, :]), k=self.k)
        codes = tf.gather(self.popular_order, place)
        return tf.where(tf.math.is_inf(free), -np.inf, tf.gather(self.popular_share, codes)), codes

    def _search(self, query, mask):
        """([r, k] scores, [r, k] int64 codes) of queries [r, d], the items `mask` ([r, I]
        bool) marks and those outside the catalogue skipped; -inf scores where fewer than k
        remain."""
        if self.index is None:
            skipped = tf.logical_or(mask, self.outside[None, :])                        # [r, I]
            scores, codes = tf.math.top_k(tf.where(skipped, -np.inf, tf.matmul(
                query, self.candidates, transpose_b=True)), k=self.k)                  # [r, k]
        else:                                 # the index holds the catalogue's items alone
            if self.fetch < self.catalogue_size:              # k must remain of those fetched
                most = self.fetch - self.k
                indexed = tf.logical_and(mask, tf.logical_not(self.outside)[None, :])  # [r, I]
                tf.debugging.assert_less_equal(
                    tf.reduce_sum(tf.cast(indexed, tf.int32), 1), most,
                    message=f"a request excludes more than {most} items, the most the ScaNN "
                            "export skips while still returning k; use the retrieval export")
            scores, codes = usable_top_k(*self.index(query, k=self.fetch), mask, self.k)
        return scores, tf.cast(codes, tf.int64)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id")])
    def serve(self, user_id):
        features, known = self.users(user_id)
        excluded = self.users.seen(*self.users.codes(user_id)) if self.exclude_seen else None
        return self._top_k(features, known, excluded)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id"),
                                  tf.TensorSpec([None, None], tf.string, name="history")])
    def with_history(self, user_id, history):
        codes = self.item_codes.lookup(history)                                          # [b, L]
        index = tf.where(codes >= 0, tf.gather(self.item_index, tf.maximum(codes, 0)),
                         tf.where(history == "", tf.constant(PAD, tf.int64), OOV))
        index = latest_items(index, self.history_length)                            # [b, L']
        features, known = self.users(user_id, index)
        # the towers answer a user they know, or one whose history holds an item they learned
        known = tf.logical_or(known, tf.reduce_any(index >= FIRST, axis=1))
        excluded = None
        if self.exclude_seen:
            given = tf.where(codes >= 0)                      # [n, 2] (row, slot) of known items
            rows, items = (tf.concat(pairs, 0) for pairs in zip(
                self.users.seen(*self.users.codes(user_id)),
                (given[:, 0], tf.gather_nd(codes, given))))
            order = tf.argsort(rows, stable=True)                  # rows ascending, as `_top_k`
            excluded = tf.gather(rows, order), tf.gather(items, order)
        return self._top_k(features, known, excluded)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id")])
    def known_users(self, user_id):
        """user_id [b] -> known [b] bool: whether the user has rows the model was fit on
        (`serve` answers the others with the popular list)."""
        return {"known": self.users.codes(user_id)[1]}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id")])
    def embed_user(self, user_id):
        features, _ = self.users(user_id)
        return {"embedding": traced_query(self.model)(features)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="item_ids")])
    def embed_items(self, item_ids):
        """item_ids [b] -> embedding [b, d]; an id neither the log nor the item table has
        gets the embedding of an item without training rows or features (the out-of-vocabulary row)."""
        return {"embedding": self.model.candidate(self.item_codes.lookup(item_ids))}


def warmup_requests(user_ids: np.ndarray, item_ids: np.ndarray) -> dict[str, dict]:
    """Warmup inputs of every signature (`layout.write_warmup_requests`), a row per user: its
    id, an empty `with_history` history (the user's own state), an item id each (of one or
    more `item_ids`)."""
    if not len(item_ids):
        raise ValueError("warmup requests need an item id for embed_items; got none")
    users = np.asarray(user_ids, dtype=object)                                         # [w]
    items = np.resize(np.asarray(item_ids, dtype=object), len(users))                  # [w]
    return {"serving_default": {"user_id": users},
            "with_history": {"user_id": users, "history": np.full((len(users), 1), "", object)},
            "embed_user": {"user_id": users}, "embed_items": {"item_ids": items},
            "known_users": {"user_id": users}}


def export(model: RetrievalModel, data: ModelInputs, base_path: str, k: int,
           scann: ScannParams | None = None, version: int | None = None,
           warmup_users: np.ndarray | None = None) -> str:
    """Writes a new version of the retrieval SavedModel, answering the top `k` items, under
    `base_path`; returns its folder.

    With `scann` the index is ScaNN and the model needs ScaNN's ops to serve. With
    `warmup_users` ([w] str) the version carries TF Serving warmup requests of every
    signature for them (`warmup_requests`).

    Raises:
        ValueError: k exceeds the catalogue.
    """
    size = int(data.catalogue.sum())
    if not 1 <= k <= size:
        raise ValueError(f"k={k}: the export answers 1 to {size} items a user (the catalogue: "
                         f"the items of the fit rows); pass a k in that range")
    module = RetrievalModule(model, data, k, scann, exclude_seen=data.exclude_seen)
    signatures = {"serving_default": module.serve, "with_history": module.with_history,
                  "embed_user": module.embed_user, "embed_items": module.embed_items,
                  "known_users": module.known_users}
    options = tf.saved_model.SaveOptions(namespace_whitelist=["Scann"] if scann else None)

    def write(path: str) -> None:
        with inference_tracing():
            save_servable(module, path, signatures, options)
        write_state(path, data)
        if warmup_users is not None:
            write_warmup_requests(path, os.path.basename(os.path.normpath(base_path)),
                                  warmup_requests(warmup_users, data.interactions.item_ids))
    return write_version(base_path, write, version=version)
