"""Candidate lists, training, and evaluation of the ranking stage (alone and over retrieval)."""
from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import scipy.sparse as sp
import tensorflow as tf

from tworec.features.evaluation import (interaction_matrix, previous_items, rank_metrics,
                                 transition_counts)
from tworec.features.inputs import ModelInputs
from tworec.features.layers import mixed_precision, run_callbacks
from tworec.features.batches import batches, steps_per_epoch
from tworec.ranking.config import RankingConfig
from tworec.ranking.model import RankingModel


def candidate_lists(data: ModelInputs, part: str, num_negatives: int, hard_share: float,
                    hard: np.ndarray | None = None, seed: int = 0) -> np.ndarray:
    """[m, 1 + num_negatives] catalogue codes: the positive in slot 0, then negatives.

    Args:
        data: model inputs. part: train, validation or test.
        hard: [m, H] retrieval candidates per row (hard negatives), or None for random only.
        hard_share: share of the negatives taken from `hard`: never the positive nor any other
            item of the user's training rows (a later item of the same session is no negative).
            Only rows whose positive is among `hard` get hard negatives, as at serving time
            (the ranker sees retrieved lists that hold the target); elsewhere, hard negatives
            all outscore the positive in retrieval and the ranker would learn to invert it.
    """
    rng = np.random.default_rng(seed)
    positives = data.examples[part]["item"]                                   # [m]
    num_hard = 0 if hard is None else min(int(round(hard_share * num_negatives)), hard.shape[1])
    negatives = []
    if num_hard:
        users = data.interactions.user[getattr(data.split, part)]
        own = interaction_matrix(data.interactions, data.split.train)          # [U, I]
        keys = rng.random(hard.shape)
        keys[np.asarray(own[users[:, None], hard].todense()) > 0] = 2.0       # the user's items late
        keys[hard == positives[:, None]] = np.inf                             # the positive last
        picked = np.take_along_axis(hard, np.argsort(keys, axis=1)[:, :num_hard], axis=1)
        retrieved = (hard == positives[:, None]).any(1, keepdims=True)          # [m, 1]
        negatives.append(np.where(retrieved, picked, _random_items(data, rng, positives, num_hard)))
    negatives.append(_random_items(data, rng, positives, num_negatives - num_hard))
    return np.concatenate([positives[:, None]] + negatives, axis=1).astype(np.int64)


def _random_items(data: ModelInputs, rng: np.random.Generator, positives: np.ndarray,
                  count: int) -> np.ndarray:
    """[m, count] items drawn uniformly from those seen in training, never the row's positive."""
    trained = np.flatnonzero(data.item_probability > 0)
    random = trained[rng.integers(0, len(trained), (len(positives), count))]
    return np.where(random == positives[:, None],
                    trained[(np.searchsorted(trained, random) + 1) % len(trained)], random)


@dataclasses.dataclass(frozen=True)
class RetrievalSignal:
    """The retrieval stage's embeddings, handed over as arrays (ranking never imports it).

    Attributes:
        queries: part -> [m, e] query embedding of every row of that part.
        latest: [num_users, e] every user's query embedding from their latest history.
        items: [num_items, e] item embeddings.
    """

    queries: dict[str, np.ndarray]
    latest: np.ndarray
    items: np.ndarray


def transition_matrix(data: ModelInputs) -> sp.csr_matrix:
    """[V, V] CSR over item vocabulary indexes: how often item j directly followed item i in a
    user's time-ordered training rows."""
    counts = transition_counts(data.interactions, data.split.train).tocoo()      # catalogue codes
    size = data.items.size
    return sp.csr_matrix((counts.data, (data.item_index[counts.row], data.item_index[counts.col])),
                         shape=(size, size))


def transition_features(transitions: sp.csr_matrix, data: ModelInputs, part: str,
                        items: np.ndarray) -> np.ndarray:
    """[m, n] float32 log(1 + how often each candidate followed the row's latest history item
    in training). Training rows leave their own transition out, so that the feature means on
    them what it means on held-out rows and at serving time. (A training row's counts still
    include the user's later transitions, which held-out rows cannot see; one count among
    all users' is a small difference, and removing it would need per-user matrices.)"""
    last = data.examples[part]["history"][:, -1]                               # [m] vocab index
    candidates = data.item_index[items]                                        # [m, n]
    counts = np.asarray(transitions[last[:, None], candidates].todense(), np.float32)
    if part == "train":
        own = (items == data.examples[part]["item"][:, None]) & counted_from(data, last)[:, None]
        counts -= own
    return np.log1p(counts)


def counted_from(data: ModelInputs, last: np.ndarray) -> np.ndarray:
    """[m] bool per training row: whether `transition_matrix` counted the row's own
    transition from `last` (its latest history item): the user's previous training row
    exists and holds that item. Under the temporal split that holds for all but each user's
    first row; under the random split the previous row in time may be a test row."""
    previous = previous_items(data.interactions, data.split.train)             # codes, -1: none
    return (previous >= 0) & (data.item_index[np.maximum(previous, 0)] == last)


def list_examples(model: RankingModel, data: ModelInputs, part: str,
                  items: np.ndarray) -> dict[str, np.ndarray]:
    """The inputs of `model` for candidate lists `items` [m, n] of the rows of `part`, with
    the signals it was built with (retrieval embeddings, item transitions)."""
    examples = {k: v for k, v in data.examples[part].items() if k != "item"}
    examples["items"] = items
    if model.retrieval is not None:
        examples["retrieval_query"] = model.retrieval.queries[part]
    if model.transitions is not None:
        examples["transitions"] = transition_features(model.transitions, data, part, items)
    rating = data.interactions.rating
    rows = getattr(data.split, part)
    examples["rating"] = (np.zeros(len(rows), np.float32) if rating is None else rating[rows])
    return examples


def build_model(config: RankingConfig, data: ModelInputs,
                retrieval: RetrievalSignal | None = None) -> RankingModel:
    model = RankingModel(config, num_users=data.users.size, item_index=data.item_index,
                         item_vocab_size=data.items.size, item_genres=data.item_genres,
                         item_year=data.item_year,
                         user_feature_sizes={n: v.size for n, v in data.user_feature_vocabs.items()},
                         has_ratings=data.interactions.rating is not None,
                         retrieval_items=None if retrieval is None else retrieval.items,
                         transitions=transition_matrix(data) if config.use_transitions else None)
    model.retrieval = retrieval
    model.compile(optimizer=tf.keras.optimizers.Adam(config.learning_rate),
                  jit_compile=config.jit_compile)
    return model


def fit(data: ModelInputs, config: RankingConfig, hard: dict[str, np.ndarray] | None = None,
        run_dir: str | None = None, verbose: int = 1, retrieval: RetrievalSignal | None = None):
    """Trains a ranking model on lists of one positive and its negatives.

    Args:
        data: model inputs (`features.inputs.prepare`) with the same history length.
        config: checked before anything trains.
        hard: part -> [m, H] retrieval candidates per row, the source of hard negatives.
        retrieval: the retrieval stage's embeddings, to use its scores as a feature.

    Returns:
        (model, summary) with per-epoch logs, seconds and examples per second.
    """
    config.validate(has_ratings=data.interactions.rating is not None)
    if data.latest.shape[1] != max(config.history_length, 1):
        raise ValueError(f"history_length {config.history_length} does not match the inputs "
                         f"({data.latest.shape[1]})")
    tf.keras.utils.set_random_seed(config.seed)
    hard = hard or {}
    negatives = 0 if config.task == "regression" else config.num_negatives
    lists = {part: candidate_lists(data, part, negatives, config.hard_negative_share,
                                   hard.get(part), seed=config.seed + i)
             for i, part in enumerate(("train", "validation"))}
    with mixed_precision(config.mixed_precision):
        model = build_model(config, data, retrieval)
    train = list_examples(model, data, "train", lists["train"])
    steps = steps_per_epoch(len(lists["train"]), config.batch_size)
    dataset = batches(train, config.batch_size, shuffle=True, seed=config.seed, epochs=None)
    callbacks, validation = [], None
    if len(data.split.validation):
        validation = batches(list_examples(model, data, "validation", lists["validation"]), 4096)
        if config.early_stopping_patience:
            callbacks.append(tf.keras.callbacks.EarlyStopping(
                "val_total_loss", patience=config.early_stopping_patience,
                restore_best_weights=True))
    callbacks += run_callbacks(run_dir, "ranking", config.to_json())
    start = time.perf_counter()
    history = model.fit(dataset, epochs=config.epochs, steps_per_epoch=steps,
                        validation_data=validation, callbacks=callbacks, verbose=verbose)
    seconds = time.perf_counter() - start
    epochs = len(history.history["loss"])
    summary = {"seconds": seconds, "epochs": epochs,
               "examples_per_second": epochs * len(lists["train"]) / max(seconds, 1e-9),
               "history": {k: [float(v) for v in vs] for k, vs in history.history.items()}}
    if run_dir:
        with open(os.path.join(run_dir, "ranking_train.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return model, summary


def score_lists(model: RankingModel, data: ModelInputs, part: str, items: np.ndarray,
                batch_size: int = 1024) -> np.ndarray:
    """[m, n] scores of candidate lists [m, n] for the rows of `part`."""
    examples = list_examples(model, data, part, items)
    return np.concatenate([model(b).numpy() for b in batches(examples, batch_size)])


def evaluate(model: RankingModel, data: ModelInputs, part: str = "test",
             hard: np.ndarray | None = None) -> dict[str, float | None]:
    """RMSE of the rating head (None without ratings) and AUC: the share of (positive,
    negative) pairs of each list that the model orders correctly, ties counting half."""
    config = model.config
    result = {"rmse": None, "auc": None}
    if len(getattr(data.split, part)) == 0:
        return result
    lists = candidate_lists(data, part, max(config.num_negatives, 1), config.hard_negative_share,
                            hard, seed=config.seed + 7)
    if config.task != "regression":
        scores = score_lists(model, data, part, lists)
        positive, negative = scores[:, :1], scores[:, 1:]
        result["auc"] = float(((positive > negative) + 0.5 * (positive == negative)).mean())
    if model.use_rating:
        examples = list_examples(model, data, part, lists[:, :1])
        predicted = np.concatenate([model.predict_rating(b).numpy()
                                    for b in batches(examples, 4096)])
        result["rmse"] = float(np.sqrt(np.mean((predicted - examples["rating"]) ** 2)))
    return result


def rerank(model: RankingModel, data: ModelInputs, part: str, candidates: np.ndarray,
           top_n: int = 10) -> np.ndarray:
    """[m, top_n] the best `top_n` of each row's retrieval candidates [m, K] by ranking score."""
    scores = score_lists(model, data, part, candidates)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :top_n]
    return np.take_along_axis(candidates, order, axis=1)


def two_stage_metrics(model: RankingModel, data: ModelInputs, part: str,
                      candidates: np.ndarray, ks=(10,)) -> dict[str, float]:
    """Recall@K and NDCG@K of the re-ranked candidate lists; a target missing from the
    candidates is a miss."""
    ranked = rerank(model, data, part, candidates, top_n=candidates.shape[1])
    targets = data.examples[part]["item"]
    found = ranked == targets[:, None]
    ranks = np.where(found.any(1), found.argmax(1), candidates.shape[1] + max(ks))
    return rank_metrics(ranks, ks)
