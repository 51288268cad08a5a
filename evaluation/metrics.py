"""Ranks over the full catalogue and the metrics computed from them.

Both stages rank the whole catalogue for each held-out interaction, excluding the items the
user had before it (the held-out item itself is never excluded), and report, for one held-out
item per user, Recall@K (the hit rate) and NDCG@K = 1 / log2(rank + 2) when rank < K. Scoring
is done in batches of users with matrix products; there is no Python loop per user.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import scipy.sparse as sp

from tworec.evaluation.sets import EvalSet

KS = (10, 20, 50, 100)


def target_ranks(scores: np.ndarray, targets: np.ndarray, seen: sp.csr_matrix) -> np.ndarray:
    """Rank of each target among the unseen items (0 is best).

    Args:
        scores: [b, num_items] float. targets: [b] item codes. seen: [b, num_items] CSR.

    Returns:
        [b] int64: how many unseen items score strictly above the target.
    """
    scores = np.array(scores, dtype=np.float32, copy=True)
    target_scores = scores[np.arange(len(targets)), targets]
    rows, cols = seen.nonzero()
    scores[rows, cols] = -np.inf
    return (scores > target_scores[:, None]).sum(1)


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


def evaluate(score_rows: Callable[[np.ndarray], np.ndarray], evalset: EvalSet, ks=KS,
             batch_size: int = 512) -> dict[str, float]:
    """Metrics of a scorer over an evaluation set.

    Args:
        score_rows: maps positions [b] into `evalset` to scores [b, num_items].
        evalset: the held-out rows.
    """
    ranks = np.concatenate([
        target_ranks(score_rows(positions), evalset.targets[positions], evalset.seen[positions])
        for positions in np.array_split(np.arange(len(evalset)),
                                        max(1, -(-len(evalset) // batch_size)))])
    return rank_metrics(ranks, ks)
