"""Candidate lists, training, and evaluation of the ranking stage (alone and over retrieval)."""
from __future__ import annotations

import numpy as np
import scipy.optimize
import scipy.special
import tensorflow as tf

from tworec.evaluation import MISS, rank_metrics
from tworec.features.batches import batches, batches_in_order, steps_per_epoch
from tworec.features.inputs import EMPTY_SLOT, ModelInputs
from tworec.features.interactions import interaction_matrix
from tworec.features.training import Float32Twin, Float32Validation, mixed_precision, train
from tworec.ranking.config import RankingConfig
from tworec.ranking.features import RankingSignals, list_examples
from tworec.ranking.model import RankingModel


def candidate_lists(data: ModelInputs, part: str, num_negatives: int, hard_share: float,
                    hard: np.ndarray | None = None, seed: int = 0) -> np.ndarray:
    """[m, 1 + num_negatives] catalogue codes: the positive in slot 0, then negatives.

    Args:
        data: model inputs. part: train, validation or test.
        hard: [m, H] retrieval candidates per row (hard negatives; `EMPTY_SLOT` past the
            catalogue's end, never drawn), or None for random only.
        hard_share: share of the negatives taken from `hard`: never the positive, and the
            user's other training items only when the pool holds too few others (they are
            picked last: a later item of the same session is a poor negative). What a pool
            lacks is drawn at random. Only rows whose positive is among `hard` get hard
            negatives, as at serving time (the ranker sees retrieved lists that hold the
            target); elsewhere, hard negatives all outscore the positive in retrieval and the
            ranker would learn to invert it.
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
        keys[hard == positives[:, None]] = np.inf                             # the positive never
        keys[hard == EMPTY_SLOT] = np.inf             # nor a slot past the candidates there are
        order = np.argsort(keys, axis=1)[:, :num_hard]                        # [m, num_hard]
        retrieved = (hard == positives[:, None]).any(1, keepdims=True)          # [m, 1]
        usable = retrieved & np.isfinite(np.take_along_axis(keys, order, axis=1))
        negatives.append(np.where(usable, np.take_along_axis(hard, order, axis=1),
                                  _random_items(data, rng, positives, num_hard)))
    negatives.append(_random_items(data, rng, positives, num_negatives - num_hard))
    return np.concatenate([positives[:, None]] + negatives, axis=1).astype(np.int64)


def _random_items(data: ModelInputs, rng: np.random.Generator, positives: np.ndarray,
                  count: int) -> np.ndarray:
    """[m, count] items drawn uniformly from those seen in training, never the row's positive."""
    trained = np.flatnonzero(data.item_probability > 0)
    random = trained[rng.integers(0, len(trained), (len(positives), count))]
    return np.where(random == positives[:, None],
                    trained[(np.searchsorted(trained, random) + 1) % len(trained)], random)


def build_model(config: RankingConfig, data: ModelInputs, signals: RankingSignals) -> RankingModel:
    model = RankingModel(config, num_users=data.users.size, item_index=data.item_index,
                         item_vocab_size=data.items.size, item_genres=data.item_genres,
                         item_year=data.item_year, history_length=data.history_length,
                         user_feature_sizes={n: v.size for n, v in data.user_feature_vocabs.items()},
                         has_ratings=data.interactions.rating is not None,
                         use_retrieval=signals.has_retrieval,
                         use_titles=signals.titles is not None)
    model.compile(optimizer=tf.keras.optimizers.Adam(config.learning_rate),
                  jit_compile=config.jit_compile)
    return model


def fit(data: ModelInputs, config: RankingConfig, signals: RankingSignals,
        hard: dict[str, np.ndarray] | None = None, run_dir: str | None = None,
        verbose: int = 1, served_validation: np.ndarray | None = None
        ) -> tuple[RankingModel, dict]:
    """Trains a ranking model on lists of one positive and its negatives, then, with
    `config.calibrate`, a ranking task (not regression), validation rows and
    `served_validation`, refits its logit's balance on those lists (`calibrate`).

    Args:
        data: model inputs (`features.inputs.prepare`).
        config: checked before anything trains.
        signals: the retrieval embeddings, transition counts, co-occurrence similarities,
            period popularity and title similarities the ranker reads
            (`ranking.features.signals`), as `config` asks for them.
        hard: part -> [m, H] retrieval candidates per row, the source of hard negatives.
        served_validation: [m, C] the candidates served for the validation rows, retrieval's
            and the title candidates (`EMPTY_SLOT` where fewer remain).

    Returns:
        (model, summary) with per-epoch logs, seconds, examples per second and, when it ran,
        "calibration". The model computes in float32 even when it trained under mixed
        precision, and so does its validation (`features.training.Float32Twin`).
    """
    config.validate(has_ratings=data.interactions.rating is not None,
                    history_length=data.history_length)
    built = signals.cooccurrence
    if signals.has_retrieval and not config.use_retrieval_score:
        raise ValueError("use_retrieval_score is False but the signals carry the retrieval "
                         "score: build them with ranking.features.signals(data, config)")
    for setting, wanted, signal in (
            ("use_transitions", config.use_transitions, signals.transitions),
            ("cooccurrence_neighbors", config.cooccurrence_neighbors, built),
            (f"popularity_periods read by a {config.task} ranker", config.held_out_periods,
             signals.popularity)):
        if bool(wanted) != (signal is not None):
            raise ValueError(f"{setting} is {wanted} but the signals "
                             f"{'lack' if wanted else 'carry'} it: build them with "
                             "ranking.features.signals(data, config)")
    if built is not None and (built.neighbors, len(built.folds), built.seed) != (
            config.cooccurrence_neighbors, config.cooccurrence_folds, config.seed):
        raise ValueError(f"the signals' co-occurrence was built with {built.neighbors} "
                         f"neighbours, {len(built.folds)} folds, seed {built.seed}, not as the "
                         "config says: build them with ranking.features.signals(data, config)")
    titles = signals.titles       # None also where the items' titles share no word it reads
    if titles is not None and titles.neighbors != config.held_out_title_neighbors:
        raise ValueError(f"the signals' title similarity keeps {titles.neighbors} neighbours, "
                         f"title_neighbors read by a {config.task} ranker is "
                         f"{config.held_out_title_neighbors}: build them with "
                         "ranking.features.signals(data, config)")
    if signals.popularity is not None and signals.popularity.periods != config.held_out_periods:
        raise ValueError(f"the signals' popularity has {signals.popularity.periods} periods, "
                         f"the config {config.held_out_periods}: build them with "
                         "ranking.features.signals(data, config)")
    tf.keras.utils.set_random_seed(config.seed)
    hard = hard or {}
    negatives = 0 if config.task == "regression" else config.num_negatives
    lists = {part: candidate_lists(data, part, negatives, config.hard_negative_share,
                                   hard.get(part), seed=config.seed + i)
             for i, part in enumerate(("train", "validation"))}
    with mixed_precision(config.mixed_precision):
        model = build_model(config, data, signals)
    dataset = batches(list_examples(data, signals, "train", lists["train"]), config.batch_size,
                      shuffle=True, seed=config.seed, epochs=None)
    float32 = Float32Twin(lambda: build_model(config, data, signals), dataset)
    callbacks, validation = [], None
    if len(data.split.validation):
        validation = batches(list_examples(data, signals, "validation", lists["validation"]), 4096)
        if config.mixed_precision:            # else Keras's own (TensorBoard logs it too)
            callbacks.append(Float32Validation(validation, float32))
            validation = None
        if config.early_stopping_patience:
            callbacks.append(tf.keras.callbacks.EarlyStopping(
                "val_total_loss", patience=config.early_stopping_patience,
                restore_best_weights=True))
    summary = train(model, dataset, stage="ranking", config=config,
                    steps_per_epoch=steps_per_epoch(len(lists["train"]), config.batch_size),
                    examples_per_epoch=len(lists["train"]), callbacks=callbacks,
                    validation=validation, run_dir=run_dir, verbose=verbose)
    model = float32(model)
    if calibrates(config) and served_validation is not None and len(data.split.validation):
        summary["calibration"] = calibrate(model, data, signals, "validation", served_validation)
    return model, summary


def calibrates(config: RankingConfig) -> bool:
    """Whether `fit` calibrates: asked for, and a ranking task (a regression ranker has no
    logit to rebalance)."""
    return config.calibrate and config.task != "regression"


def calibrate(model: RankingModel, data: ModelInputs, signals: RankingSignals, part: str,
              candidates: np.ndarray, fit_rows: np.ndarray | None = None) -> dict:
    """Refits the balance of the ranker's logit on held-out lists as served, and applies it.

    The logit is `head + sum_k w_k * signal_k`; the ranker learnt it on training lists of
    1 + num_negatives items, where the retrieval score and the transition counts come from
    models fitted on those same rows (retrieval finds training positives more often than
    held-out ones). Here the scale `a` of the whole logit and one added weight `d_k` per signal
    are refitted, `a * logit + sum_k d_k * signal_k`, by listwise softmax cross-entropy over
    the rows of `part` whose served list holds the positive, for users known before `part`:
    no model learnt from these rows (validation also chose the epochs kept and ScaNN's
    setting; test stays untouched). The loss is convex in those 1 + k numbers (L-BFGS-B,
    `a` >= 0). The model's head and signal weights are rewritten, so the export serves
    exactly the refitted scores; a fit that fails or is not finite changes nothing.

    Args:
        candidates: [m, C] the served candidates of every row of `part` (`EMPTY_SLOT` pads).
        fit_rows: [m] bool, the rows it may fit on (default: every row), e.g. one fold of
            users when the other is scored with the refitted model.

    Returns:
        {"rows": lists fitted on, "scale": a, "weights": signal -> its new weight,
         "loss_before", "loss_after": the mean cross-entropy on those lists}; {"rows": r,
        "skipped": why} when nothing was changed.
    """
    if model.score_head is None:
        raise ValueError("calibrate: a regression ranker has no logit to rebalance; "
                         "calibrate a listwise or binary ranker")
    names = model.logit_signals
    rows = data.known_in(part) & (candidates == data.examples[part]["item"][:, None]).any(1)
    if fit_rows is not None:
        rows &= fit_rows
    if not rows.any():
        return {"rows": 0, "skipped": "no served validation list holds its positive" + (
            "" if fit_rows is None else " among the rows it may fit on")}
    examples = list_examples(data, signals, part, np.maximum(candidates, 0))
    logits = np.concatenate([model(b).numpy()
                             for b in batches_in_order(examples, 1024)])[rows]         # [r, C]
    signal = (np.stack([examples[name][rows] for name in names], -1) if names    # [r, C, k]
              else np.zeros(logits.shape + (0,), np.float32))
    lists = candidates[rows]
    positive = (lists == data.examples[part]["item"][rows, None]).argmax(1)      # [r]
    usable = lists != EMPTY_SLOT
    logits, signal = logits.astype(np.float64), signal.astype(np.float64)

    def loss_and_gradient(theta: np.ndarray) -> tuple[float, np.ndarray]:
        refit = np.where(usable, theta[0] * logits + signal @ theta[1:], -np.inf)  # [r, C]
        log_norm = scipy.special.logsumexp(refit, axis=1)                           # [r]
        loss = np.mean(log_norm - refit[np.arange(len(refit)), positive])
        error = np.exp(refit - log_norm[:, None])                                  # softmax
        error[np.arange(len(refit)), positive] -= 1.0
        error /= len(refit)
        return loss, np.concatenate([[np.sum(error * logits)],
                                     np.einsum("rc,rck->k", error, signal)])

    start = np.concatenate([[1.0], np.zeros(len(names))])
    best = scipy.optimize.minimize(loss_and_gradient, start, jac=True, method="L-BFGS-B",
                                   bounds=[(0.0, None)] + [(None, None)] * len(names))
    if not (best.success and np.isfinite(best.x).all() and np.isfinite(best.fun)):
        return {"rows": int(rows.sum()), "skipped": f"the fit did not converge: {best.message}"}
    scale = best.x[0]
    model.score_head.kernel.assign(model.score_head.kernel * scale)
    model.score_head.bias.assign(model.score_head.bias * scale)
    for name, added in zip(names, best.x[1:]):
        model.signal_weights[name].assign(scale * model.signal_weights[name] + added)
    return {"rows": int(rows.sum()), "scale": float(scale),
            "weights": {name: float(model.signal_weights[name].numpy()) for name in names},
            "loss_before": float(loss_and_gradient(start)[0]), "loss_after": float(best.fun)}


def score_lists(model: RankingModel, data: ModelInputs, signals: RankingSignals, part: str,
                items: np.ndarray, batch_size: int = 1024) -> np.ndarray:
    """[m, n] scores of candidate lists [m, n] for the rows of `part`, as the export scores
    them: the ranker's for users known before the part, the items' share of what the others
    are served (`ModelInputs.popular`), and an `EMPTY_SLOT` one below the lowest of its row.

    Raises:
        ValueError: a list holds a NaN or infinite score.
    """
    empty = items == EMPTY_SLOT
    items = np.where(empty, 0, items)                       # scored as code 0, as the export
    examples = list_examples(data, signals, part, items)
    scores = np.concatenate([model(b).numpy() for b in batches_in_order(examples, batch_size)]
                            or [np.zeros((0, items.shape[1]), np.float32)])
    finite = np.isfinite(scores).all(1)
    if not finite.all():
        raise ValueError(f"ranking: {int((~finite).sum())} of {len(scores)} scored lists hold "
                         "NaN or infinite scores")
    unknown = ~data.known_in(part)
    if unknown.any():                     # never for training rows
        scores[unknown] = data.popular[part].share[items[unknown]]
    lowest = scores.min(1, keepdims=True) - 1.0 if len(scores) else scores
    return np.where(empty, lowest, scores)


def retrieval_negatives(candidates: np.ndarray, positives: np.ndarray, count: int) -> np.ndarray:
    """[m, count] the first `count` of each row's retrieval candidates [m, H] that are not the
    row's positive [m], in retrieval's order; `EMPTY_SLOT` past the candidates there are."""
    unusable = (candidates == positives[:, None]) | (candidates == EMPTY_SLOT)
    order = np.argsort(unusable, axis=1, kind="stable")[:, :count]
    return np.where(np.take_along_axis(unusable, order, 1), EMPTY_SLOT,
                    np.take_along_axis(candidates, order, axis=1))


def evaluate(model: RankingModel, data: ModelInputs, signals: RankingSignals, part: str = "test",
             hard: np.ndarray | None = None) -> dict[str, float | None]:
    """RMSE of the rating head (None without one: no ratings, or rating_weight 0) and AUC: the
    share of (positive, negative) pairs that the model's scores (a regression ranker's: its
    predicted ratings, by which it orders candidates) order correctly, a tie counting as wrong,
    each row's negatives being the first `num_negatives` of its retrieval candidates `hard`
    [m, H] (retrieval's, then any title candidates) other than the positive, for every row
    alike (the items the ranker must beat when serving); random negatives when `hard` is None.
    With `hard`, also "auc_retrieved": the AUC over the rows whose positive is among their
    candidates, the lists the ranker re-orders when served (a positive the candidates missed is
    never served, whatever its score), "retrieved_rows", their number, and "retrieved_among",
    H."""
    config = model.config
    result = {"rmse": None, "auc": None}
    if len(getattr(data.split, part)) == 0:
        return result
    count = max(config.num_negatives, 1)
    positives = data.examples[part]["item"]
    if hard is None:
        lists = candidate_lists(data, part, count, 0.0, seed=config.seed + 7)
    else:
        lists = np.concatenate([positives[:, None], retrieval_negatives(hard, positives, count)], 1)
    scores = score_lists(model, data, signals, part, lists)   # regression: predicted ratings
    pairs = lists[:, 1:] != EMPTY_SLOT
    result["auc"] = pair_auc(scores, pairs)
    if hard is not None:
        retrieved = (hard == positives[:, None]).any(axis=1)                            # [m]
        result.update(auc_retrieved=pair_auc(scores[retrieved], pairs[retrieved]),
                      retrieved_rows=int(retrieved.sum()), retrieved_among=int(hard.shape[1]))
    if model.use_rating:
        examples = list_examples(data, signals, part, lists[:, :1])
        predicted = np.concatenate([model.predict_rating(b).numpy()
                                    for b in batches_in_order(examples, 4096)])
        result["rmse"] = float(np.sqrt(np.mean((predicted - examples["rating"]) ** 2)))
    return result


def pair_auc(scores: np.ndarray, pairs: np.ndarray) -> float | None:
    """The share of the (positive, negative) pairs that `scores` [m, 1 + n] (the positive in
    slot 0) order correctly, over the negatives `pairs` [m, n] marks; a tie counts as wrong,
    as a tie never favours the held-out item in the report. None without pairs."""
    if not pairs.any():
        return None
    return float((scores[:, :1] > scores[:, 1:])[pairs].mean())


def rerank(model: RankingModel, data: ModelInputs, signals: RankingSignals, part: str,
           candidates: np.ndarray, top_n: int = 10) -> np.ndarray:
    """[m, top_n] the best `top_n` of each row's retrieval candidates [m, K] by ranking score."""
    scores = score_lists(model, data, signals, part, candidates)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :top_n]
    return np.take_along_axis(candidates, order, axis=1)


def reranked_ranks(scores: np.ndarray, candidates: np.ndarray, targets: np.ndarray,
                   in_order: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Where each row's target lands when its candidates [m, C] are ordered by the ranker's
    scores [m, C]: how many other candidates score at least as high, ties counting against
    the target as in `evaluation.target_ranks` (served, ties keep the candidates' order, so
    a served position is at most this rank; the served check allows the difference at a
    float tie alone). Rows `in_order` ([m] bool: users the models do not know, whose
    candidates are the popular items in their strict served order and whose scores, the
    items' shares, tie) rank by that order on ties, as retrieval's `popular_order` ranks them.

    Returns:
        ([m] 0-based ranks, `MISS` for a target not among the candidates; [m] the target's
        score, -inf where it is missing).
    """
    found = candidates == targets[:, None]                                           # [m, C]
    present, position = found.any(1), found.argmax(1)
    target_scores = np.where(present, scores[np.arange(len(scores)), position], -np.inf)
    ahead = (scores >= target_scores[:, None]).sum(1) - 1                # the target itself
    if in_order is not None:
        listed_before = np.arange(candidates.shape[1])[None, :] < position[:, None]  # [m, C]
        tied_before = (scores == target_scores[:, None]) & listed_before
        ahead = np.where(in_order, (scores > target_scores[:, None]).sum(1)
                         + tied_before.sum(1), ahead)
    return np.where(present, ahead, MISS), target_scores


def two_stage_metrics(model: RankingModel, data: ModelInputs, signals: RankingSignals, part: str,
                      candidates: np.ndarray, ks=(10,)) -> dict[str, float]:
    """Recall@K and NDCG@K of the re-ranked candidate lists; a target missing from the
    candidates is a miss."""
    scores = score_lists(model, data, signals, part, candidates)
    ranks, _ = reranked_ranks(scores, candidates, data.examples[part]["item"],
                              in_order=~data.known_in(part))
    return rank_metrics(ranks, ks)
