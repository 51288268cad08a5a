"""SavedModel exports of the retrieval stage, in TF Serving's `BASE/VERSION/` layout.

`retrieval` (brute force, stock TF ops only) and `retrieval_scann` (ScaNN ops) share one
module: string ids at the boundary, every user's latest history baked in, the popular items
for users the model has never seen.

Signatures (batch is dimension 0):
    serving_default: user_id [b] string -> item_ids [b, k] string, scores [b, k] float32
    with_history: user_id [b] string, history [b, L] string -> item_ids, scores
    embed_user: user_id [b] string -> embedding [b, d] float32
    embed_items: item_ids [n] string -> embedding [n, d] float32
"""
from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from tworec.features.inputs import ModelInputs
from tworec.features.layers import UserInputs, id_lookup
from tworec.retrieval.index import ScannParams, build_index
from tworec.retrieval.model import TwoTower
from tworec.retrieval.train import candidate_embeddings
from tworec.serving.layout import write_version, write_warmup_requests


class RetrievalModule(tf.Module):
    """The servable: lookups, the query tower and a top-k index."""

    def __init__(self, model: TwoTower, data: ModelInputs, k: int,
                 scann: ScannParams | None = None):
        super().__init__()
        interactions = data.interactions
        self.model = model
        self.k = k
        self.users = UserInputs(data)
        self.item_codes = id_lookup(interactions.item_ids)            # item id -> code
        self.item_ids = tf.constant(interactions.item_ids)                 # [num_items]
        self.item_index = tf.constant(data.item_index)                                  # [I]
        popular = np.argsort(-data.item_probability, kind="stable")[:k]
        self.popular_codes = tf.constant(popular, tf.int64)                             # [k]
        self.popular_scores = tf.constant(np.sort(data.item_probability)[::-1][:k])
        self.index = build_index(candidate_embeddings(model, interactions.num_items), k, scann)

    def _top_k(self, features, known):
        scores, codes = self.index(self.model.query(features))                          # [b, k]
        batch = tf.shape(codes)[0]
        fallback_codes = tf.tile(self.popular_codes[None, :], [batch, 1])
        fallback_scores = tf.tile(self.popular_scores[None, :], [batch, 1])
        codes = tf.where(known[:, None], codes, fallback_codes)
        scores = tf.where(known[:, None], scores, fallback_scores)
        return {"item_ids": tf.gather(self.item_ids, codes), "scores": scores}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id")])
    def serve(self, user_id):
        return self._top_k(*self.users(user_id))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id"),
                                  tf.TensorSpec([None, None], tf.string, name="history")])
    def with_history(self, user_id, history):
        codes = self.item_codes.lookup(history)                                          # [b, L]
        index = tf.where(codes >= 0, tf.gather(self.item_index, tf.maximum(codes, 0)),
                         tf.where(history == "", tf.constant(0, tf.int64), 1))
        features, _ = self.users(user_id, index)
        known = tf.ones_like(user_id, tf.bool)       # history given: the towers can answer
        return self._top_k(features, known)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id")])
    def embed_user(self, user_id):
        features, _ = self.users(user_id)
        return {"embedding": self.model.query(features)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="item_ids")])
    def embed_items(self, item_ids):
        codes = self.item_codes.lookup(item_ids)
        return {"embedding": self.model.candidate(tf.maximum(codes, 0))}


def export(model: TwoTower, data: ModelInputs, base_path: str, k: int,
           scann: ScannParams | None = None, version: int | None = None,
           warmup_users: np.ndarray | None = None) -> str:
    """Writes a new version of the retrieval SavedModel, answering the top `k` items, under
    `base_path`; returns its folder.

    With `scann` the index is ScaNN and the model needs ScaNN's ops to serve. With
    `warmup_users` ([w] str) the version carries TF Serving warmup requests for them.
    """
    module = RetrievalModule(model, data, k, scann)
    signatures = {"serving_default": module.serve, "with_history": module.with_history,
                  "embed_user": module.embed_user, "embed_items": module.embed_items}
    options = tf.saved_model.SaveOptions(namespace_whitelist=["Scann"] if scann else None)

    def write(path: str) -> None:
        tf.saved_model.save(module, path, signatures=signatures, options=options)
        if warmup_users is not None:
            write_warmup_requests(path, os.path.basename(os.path.normpath(base_path)),
                                  {"user_id": np.asarray(warmup_users, dtype=object)})
    return write_version(base_path, write, version=version)
