"""Ranks over the full catalogue and the metrics computed from them.

Both stages rank the whole catalogue for each held-out interaction, excluding the items the
user had before it as the exports do (a held-out item the user already had is never served, so
it is a miss), and report Recall@K (the hit rate of the held-out item) and NDCG@K =
1 / log2(rank + 2) when rank < K, averaged over held-out rows. Ranks cannot flatter: an item
scoring the same as the target ranks above it, and a NaN or infinite score is an error.
Scoring is done in batches of rows with matrix products; there is no Python loop per user.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import scipy.sparse as sp

from tworec.evaluation.sets import EvalSet

KS = (10, 20, 50, 100)


def target_ranks(scores: np.ndarray, targets: np.ndarray, excluded: sp.csr_matrix,
                 name: str = "model") -> np.ndarray:
    """Rank of each target among the items not excluded (0 is best), ties counting against it.

    Args:
        scores: [b, num_items] float. targets: [b] item codes.
        excluded: [b, num_items] CSR of items not ranked (the user's seen items); an excluded
            target is never served, so it is a miss (rank num_items).
        name: the scorer, named in errors.

    Returns:
        [b] int64: how many other ranked items score at least as high as the target.

    Raises:
        ValueError: a row holds a NaN or infinite score (it could rank the target anywhere).
    """
    scores = np.array(scores, dtype=np.float32, copy=True)
    finite = np.isfinite(scores).all(1)
    if not finite.all():
        raise ValueError(f"{name}: {int((~finite).sum())} of {len(scores)} scored rows hold "
                         "NaN or infinite scores")
    rows = np.arange(len(targets))
    target_scores = scores[rows, targets]
    target_excluded = np.asarray(excluded[rows, targets]).ravel() > 0
    excluded_rows, excluded_cols = excluded.nonzero()
    scores[excluded_rows, excluded_cols] = -np.inf
    ranks = (scores >= target_scores[:, None]).sum(1) - 1                 # the target itself
    return np.where(target_excluded, scores.shape[1], ranks)


def top_k_rows(scores: np.ndarray, k: int) -> np.ndarray:
    """[b, k] column indexes of the k highest scores of every row of `scores` [b, n], best
    first, ties to the lower index: what `tf.math.top_k` returns, without sorting whole rows."""
    kth = -np.partition(-scores, k - 1, axis=1)[:, k - 1:k]                   # [b, 1]
    above, ties = scores > kth, scores == kth
    wanted_ties = k - above.sum(1, keepdims=True)                              # [b, 1]
    chosen = above | (ties & (np.cumsum(ties, axis=1) <= wanted_ties))         # k per row
    columns = np.nonzero(chosen)[1].reshape(len(scores), k)                    # increasing
    order = np.argsort(-np.take_along_axis(scores, columns, 1), axis=1, kind="stable")
    return np.take_along_axis(columns, order, 1)


def rank_metrics(ranks: np.ndarray, ks=KS) -> dict[str, float]:
    """Recall@K (hit rate) and NDCG@K for each K, averaged over rows."""
    ranks = np.asarray(ranks)
    metrics = {}
    for k in ks:
        hit = ranks < k
        metrics[f"recall@{k}"] = float(hit.mean()) if len(ranks) else 0.0
        metrics[f"ndcg@{k}"] = float(np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0).mean()) \
            if len(ranks) else 0.0
    return metrics


def evaluate_ranks(score_rows: Callable[[np.ndarray], np.ndarray], evalset: EvalSet,
                   name: str = "model", batch_size: int = 512) -> np.ndarray:
    """[m] rank of every held-out row's target (`target_ranks`) under a scorer that maps
    positions [b] into `evalset` to scores [b, num_items]."""
    batches = np.array_split(np.arange(len(evalset)), max(1, -(-len(evalset) // batch_size)))
    return np.concatenate([target_ranks(score_rows(positions), evalset.targets[positions],
                                        evalset.excluded[positions], name)
                           for positions in batches]).astype(np.int64)


def evaluate(score_rows: Callable[[np.ndarray], np.ndarray], evalset: EvalSet, ks=KS,
             name: str = "model", batch_size: int = 512) -> dict[str, float]:
    """Recall@K and NDCG@K of a scorer over an evaluation set (see `evaluate_ranks`)."""
    return rank_metrics(evaluate_ranks(score_rows, evalset, name, batch_size), ks)
