"""The `recommender` SavedModel: retrieval and ranking composed, one request for both stages.

Built from the two SavedModels alone (no training code), with stock ops only, so TF Serving
serves it:
    serving_default: user_id [b] string -> item_ids [b, n] string, scores [b, n] float32
    known_users: user_id [b] string -> known [b] bool (the retrieval model's, when it has one)
It returns what `serving.recommender.Recommender` returns when no seen items are given.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from tworec.serving.layout import save_servable, write_warmup_requests

USER_IDS = tf.TensorSpec([None], tf.string, name="user_id")


class ComposedRecommender(tf.Module):
    """Calls the retrieval signature, adds the ranking model's own candidates (its `candidates`
    signature, when it has one), ranks them all, keeps the top n."""

    def __init__(self, retrieval_dir: str, ranking_dir: str, top_n: int):
        super().__init__()
        self.retrieval = tf.saved_model.load(retrieval_dir)
        self.ranking = tf.saved_model.load(ranking_dir)
        self.top_n = top_n
        if "known_users" in self.retrieval.signatures:
            self.known_users = tf.function(self.retrieval.signatures["known_users"],
                                           input_signature=[USER_IDS])

    @tf.function(input_signature=[USER_IDS])
    def serve(self, user_id: tf.Tensor) -> dict[str, tf.Tensor]:
        candidates = self.retrieval.signatures["serving_default"](
            user_id=user_id)["item_ids"]                                              # [b, k]
        if "candidates" in self.ranking.signatures:    # the ranking stage's own: [b, k + E]
            candidates = self.ranking.signatures["candidates"](
                user_id=user_id, item_ids=candidates)["item_ids"]
        scores = self.ranking.signatures["serving_default"](
            user_id=user_id, item_ids=candidates)["scores"]                      # [b, k + E]
        n = tf.minimum(self.top_n, tf.shape(scores)[1])
        best, order = tf.math.top_k(scores, k=n)                                     # [b, n]
        return {"item_ids": tf.gather(candidates, order, batch_dims=1), "scores": best}


def compose_recommender(retrieval_dir: str, ranking_dir: str, out_dir: str, top_n: int,
                        warmup_user_ids: list[str] | None = None,
                        model_name: str = "recommender") -> str:
    """Saves the composed SavedModel to `out_dir` (e.g. inside `layout.write_version`).

    Args:
        retrieval_dir: a retrieval SavedModel version folder.
        ranking_dir: a ranking SavedModel version folder.
        out_dir: the folder to write.
        top_n: items per user.
        warmup_user_ids: when given, a warmup request per user and signature is written with
            the model.
        model_name: the served name recorded in the warmup requests.

    Returns:
        `out_dir`.
    """
    module = ComposedRecommender(retrieval_dir, ranking_dir, top_n)
    signatures = {"serving_default": module.serve}
    if hasattr(module, "known_users"):
        signatures["known_users"] = module.known_users
    save_servable(module, out_dir, signatures)
    if warmup_user_ids:
        users = {"user_id": np.array(warmup_user_ids, dtype=object)}
        write_warmup_requests(out_dir, model_name, {name: users for name in signatures})
    return out_dir
