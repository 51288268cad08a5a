"""Ranks over the full catalogue, the metrics computed from them, and paired bootstrap
intervals for the difference between two models on the same rows.

Both stages rank the whole catalogue (the items with rows known before the held-out part, what
an export of those rows serves) for each held-out interaction, excluding the items the
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
from tworec.features.stream import SCORES_BYTES, PreparedLog

KS = (10, 20, 50, 100)


# The rank of a target that is never served: larger than any K.
MISS = np.iinfo(np.int64).max


def entries(matrix: sp.csr_matrix, rows: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """[n] the values of a sparse matrix at (`rows`, `columns`) [n] (0 where absent), as an
    array for n = 0 too (scipy gives a sparse matrix for no pairs)."""
    if not len(rows):
        return np.zeros(0, matrix.dtype)
    return np.asarray(matrix[rows, columns]).ravel()


def target_ranks(scores: np.ndarray, targets: np.ndarray, excluded: sp.csr_matrix,
                 name: str = "model", catalogue: np.ndarray | None = None) -> np.ndarray:
    """Rank of each target among the items not excluded (0 is best), ties counting against it.

    Args:
        scores: [b, num_items] float. targets: [b] item codes.
        excluded: [b, num_items] CSR of items not ranked (the user's seen items); an excluded
            target is never served, so it is a miss at every K (rank `MISS`), even a K larger
            than the catalogue.
        name: the scorer, named in errors.
        catalogue: [num_items] bool, the items served (None: all); the others are not ranked,
            and a target among them is a miss, as an excluded one.

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
    target_excluded = entries(excluded, rows, targets) > 0
    excluded_rows, excluded_cols = excluded.nonzero()
    scores[excluded_rows, excluded_cols] = -np.inf
    if catalogue is not None:
        scores[:, ~catalogue] = -np.inf
        target_excluded |= ~catalogue[targets]
    ranks = (scores >= target_scores[:, None]).sum(1) - 1                 # the target itself
    return np.where(target_excluded, MISS, ranks)


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


def row_metrics(ranks: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """{"recall@k": [m] 1.0 for a hit else 0.0, "ndcg@k": [m] 1 / log2(rank + 2) for a hit
    else 0.0} of every row's rank [m]: the per-row values `rank_metrics` averages."""
    ranks = np.asarray(ranks)
    hit = ranks < k
    return {f"recall@{k}": hit.astype(np.float64),
            f"ndcg@{k}": np.where(hit, 1.0 / np.log2(ranks + 2.0), 0.0)}


def rank_metrics(ranks: np.ndarray, ks=KS) -> dict[str, float]:
    """Recall@K (hit rate) and NDCG@K for each K, averaged over rows (0.0 without rows)."""
    metrics = {}
    for k in ks:
        for name, values in row_metrics(ranks, k).items():
            metrics[name] = float(values.mean()) if len(values) else 0.0
    return metrics


def paired_bootstrap(a: np.ndarray, b: np.ndarray, samples: int = 2000, seed: int = 0,
                     groups: np.ndarray | None = None) -> dict:
    """How much model `a` beats model `b` on the same rows, with paired bootstrap intervals.

    Each resample draws units with replacement (rows, or with `groups` whole groups: a user's
    held-out rows together, for protocols with several per user) and takes both models' means
    over the same drawn rows, so the interval reflects the paired difference, not each model's
    own spread.

    Args:
        a: [m] a per-row metric of the model (e.g. `row_metrics(ranks, 10)["ndcg@10"]`).
        b: [m] the same metric of the reference model, row for row.
        samples: resamples drawn. seed: the generator's seed (the same seed, the same answer).
        groups: [m] optional unit of each row (e.g. its user code); rows when None.

    Returns:
        {"difference": mean(a) - mean(b), "ratio": mean(a) / mean(b) (None when mean(b) is 0),
        "ci95": [lo, hi] the 2.5 and 97.5 percentiles of the resampled difference,
        "ratio_ci95": the same of the ratio (None when a resample's mean(b) is 0),
        "rows": m, "units": the number of units resampled, "samples": samples}.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or a.shape != b.shape or not len(a):
        raise ValueError(f"paired_bootstrap needs a and b of the same non-empty shape [m], got "
                         f"{a.shape} and {b.shape}")
    groups = np.arange(len(a)) if groups is None else np.asarray(groups)
    if groups.shape != a.shape:
        raise ValueError(f"groups must be [m] = {a.shape}, got {groups.shape}")
    _, unit = np.unique(groups, return_inverse=True)
    units = int(unit.max()) + 1
    sums_a, sums_b = np.bincount(unit, a, units), np.bincount(unit, b, units)      # [units]
    rows = np.bincount(unit, minlength=units).astype(np.float64)                    # [units]
    rng = np.random.default_rng(seed)
    per_chunk = max(1, 2 ** 22 // units)             # [per_chunk, units] draws at a time
    totals = []                                      # [chunk, 3] sums of a, b and rows
    for start in range(0, samples, per_chunk):
        drawn = rng.integers(0, units, (min(per_chunk, samples - start), units))   # [c, units]
        totals.append(np.stack([sums_a[drawn].sum(1), sums_b[drawn].sum(1),
                                rows[drawn].sum(1)], axis=1))
    total_a, total_b, total_rows = np.concatenate(totals).T                        # [samples]
    differences = (total_a - total_b) / total_rows
    ratio, ratio_ci = None, None
    if b.sum() > 0:
        ratio = float(a.sum() / b.sum())
        if (total_b > 0).all():
            ratio_ci = [float(x) for x in np.percentile(total_a / total_b, [2.5, 97.5])]
    return {"difference": float((a.sum() - b.sum()) / len(a)), "ratio": ratio,
            "ci95": [float(x) for x in np.percentile(differences, [2.5, 97.5])],
            "ratio_ci95": ratio_ci, "rows": int(len(a)), "units": units, "samples": samples}


def evaluate_ranks(score_rows: Callable[[np.ndarray], np.ndarray], evalset: EvalSet,
                   name: str = "model", batch_size: int = 512) -> np.ndarray:
    """[m] rank of every held-out row's target (`target_ranks`) under a scorer that maps
    positions [b] into `evalset` to scores [b, num_items]."""
    batches = np.array_split(np.arange(len(evalset)), max(1, -(-len(evalset) // batch_size)))
    return np.concatenate([target_ranks(score_rows(positions), evalset.targets[positions],
                                        evalset.excluded[positions], name, evalset.catalogue)
                           for positions in batches]).astype(np.int64)


def prepared_ranks(scorers: dict[str, Callable[[dict], np.ndarray]], prepared: PreparedLog,
                   part: str = "test", memory_limit: str = "1GB") -> dict[str, np.ndarray]:
    """`evaluate_ranks` for a prepared log, in bounded memory: {name: [m] rank of every
    held-out row of `part`} under each scorer, a function from a batch of
    `PreparedLog.heldout_batches` to scores [b, num_items] (SCORES_BYTES a batch), all
    scored in one read of the held-out rows. A target outside the catalogue (no training
    row) is a miss."""
    batch_rows = int(np.clip(SCORES_BYTES // (4 * max(prepared.num_items, 1)), 1, 4096))
    ranks = {name: [] for name in scorers}
    for rows in prepared.heldout_batches(part, batch_rows, memory_limit):
        outside = rows["target"] < 0
        for name, score in scorers.items():
            found = target_ranks(score(rows), np.where(outside, 0, rows["target"]),
                                 rows["excluded"], name)
            ranks[name].append(np.where(outside, MISS, found))
    return {name: np.concatenate(found) if found else np.zeros(0, np.int64)
            for name, found in ranks.items()}


def evaluate(score_rows: Callable[[np.ndarray], np.ndarray], evalset: EvalSet, ks=KS,
             name: str = "model", batch_size: int = 512) -> dict[str, float]:
    """Recall@K and NDCG@K of a scorer over an evaluation set (see `evaluate_ranks`)."""
    return rank_metrics(evaluate_ranks(score_rows, evalset, name, batch_size), ks)
