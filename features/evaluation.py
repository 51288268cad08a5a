"""Full-catalogue evaluation and the baselines every report carries.

Both stages rank the whole catalogue for each held-out interaction, excluding the items the
user had before it (the held-out item itself is never excluded), and report, for one held-out
item per user, Recall@K (the hit rate) and NDCG@K = 1 / log2(rank + 2) when rank < K. Scoring
is done in batches of users with matrix products; there is no Python loop per user.

Baselines, fit on the training rows only: popularity, EASE (closed form) and first-order item
transitions. For a held-out row, a model or baseline may use all of the user's earlier
interactions as history.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import scipy.sparse as sp

from tworec.features.interactions import DataError, Interactions
from tworec.features.splits import Split

KS = (10, 20, 50, 100)
EASE_MAX_ITEMS = 20_000


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """Held-out rows of one split part and what each user had before them.

    Attributes:
        rows: [m] rows of the log being predicted.
        users: [m] user codes. targets: [m] item codes.
        seen: [m, num_items] CSR 0/1 of the items each user had before the row (excluded).
        last_item: [m] item code of the user's interaction just before the row, -1 if none.
    """

    rows: np.ndarray
    users: np.ndarray
    targets: np.ndarray
    seen: sp.csr_matrix
    last_item: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


def eval_set(interactions: Interactions, parts: Split, part: str = "test",
             exclude_seen: bool = True) -> EvalSet:
    """The rows of `part` with, for each, the user's earlier items (for `test`: train and
    validation rows; for `validation`: train rows). With `exclude_seen` False (the random
    protocol, several rows per user) nothing is excluded."""
    rows = {"test": parts.test, "validation": parts.validation}.get(part)
    if rows is None:
        raise DataError(f"unknown evaluation part {part!r}; use 'test' or 'validation'")
    before = parts.train if part == "validation" else np.concatenate([parts.train, parts.validation])
    known = interactions.take(before)
    order = known.time_order()
    last = np.full(interactions.num_users, -1)
    last[known.user[order]] = known.item[order]                # later rows overwrite earlier
    users = interactions.user[rows]
    if not exclude_seen:
        seen = sp.csr_matrix((len(rows), interactions.num_items), dtype=np.float32)
        return EvalSet(rows=rows, users=users, targets=interactions.item[rows], seen=seen,
                       last_item=last[users])
    row_of_user = np.full(interactions.num_users, -1)
    row_of_user[interactions.user[rows]] = np.arange(len(rows))
    if (np.bincount(interactions.user[rows], minlength=interactions.num_users) > 1).any():
        raise DataError(f"{part}: evaluation expects one held-out row per user")
    mask = row_of_user[known.user] >= 0
    seen = sp.csr_matrix((np.ones(int(mask.sum()), dtype=np.float32),
                          (row_of_user[known.user[mask]], known.item[mask])),
                         shape=(len(rows), interactions.num_items))
    seen.data[:] = 1.0                                        # duplicates summed: back to 0/1
    return EvalSet(rows=rows, users=users, targets=interactions.item[rows], seen=seen,
                   last_item=last[users])


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


# ------------------------------------------------------------------ baselines


def interaction_matrix(interactions: Interactions, rows: np.ndarray) -> sp.csr_matrix:
    """[num_users, num_items] 0/1 CSR of the interactions at `rows`."""
    matrix = sp.csr_matrix((np.ones(len(rows), dtype=np.float32),
                            (interactions.user[rows], interactions.item[rows])),
                           shape=(interactions.num_users, interactions.num_items))
    matrix.data[:] = 1.0
    return matrix


def popularity_scorer(interactions: Interactions, train: np.ndarray, evalset: EvalSet):
    counts = np.bincount(interactions.item[train], minlength=interactions.num_items)
    counts = counts.astype(np.float32)
    return lambda positions: np.broadcast_to(counts, (len(positions), len(counts)))


def ease_scorer(interactions: Interactions, train: np.ndarray, evalset: EvalSet,
                regularisation: float = 200.0):
    """EASE (Steck 2019): B = I - P / diag(P) with P = (X'X + lambda I)^-1, over the items that
    occur in training; a user's score is their earlier items times B."""
    x = interaction_matrix(interactions, train)
    used = np.flatnonzero(np.asarray(x.sum(0)).ravel())
    gram = (x[:, used].T @ x[:, used]).toarray().astype(np.float64)   # [u, u]
    gram[np.diag_indices_from(gram)] += regularisation
    inverse = np.linalg.inv(gram)
    weights = (-inverse / np.diag(inverse)).astype(np.float32)          # [u, u]
    np.fill_diagonal(weights, 0.0)
    history = evalset.seen[:, used]

    def score(positions):
        scores = np.full((len(positions), interactions.num_items), -1e9, dtype=np.float32)
        scores[:, used] = history[positions] @ weights                    # [b, u] x [u, u]
        return scores
    return score


def previous_items(interactions: Interactions, rows: np.ndarray) -> np.ndarray:
    """[len(rows)] int64: for each of `rows`, the item of the same user's previous row among
    `rows` in time order, or -1 for a user's first."""
    part = interactions.take(rows)
    order = part.time_order()
    users, items = part.user[order], part.item[order]
    previous = np.full(len(rows), -1, dtype=np.int64)
    previous[order[1:]] = np.where(users[1:] == users[:-1], items[:-1], -1)
    return previous


def transition_counts(interactions: Interactions, rows: np.ndarray) -> sp.csr_matrix:
    """[num_items, num_items] CSR: how often item j directly followed item i in a user's
    time-ordered sequence of `rows` (the training rows)."""
    previous = previous_items(interactions, rows)
    followed = previous >= 0
    return sp.csr_matrix((np.ones(int(followed.sum()), dtype=np.float32),
                          (previous[followed], interactions.item[rows][followed])),
                         shape=(interactions.num_items, interactions.num_items))


def transition_scorer(interactions: Interactions, train: np.ndarray, evalset: EvalSet):
    """Score of item j = how often j followed the user's last item; popularity breaks ties."""
    transitions = transition_counts(interactions, train)
    popularity = np.bincount(interactions.item[train], minlength=interactions.num_items)
    tie_break = (popularity / (popularity.max() + 1.0)).astype(np.float32)   # < 1

    def score(positions):
        last = evalset.last_item[positions]
        scores = np.zeros((len(positions), interactions.num_items), dtype=np.float32)
        has_last = last >= 0
        scores[has_last] = transitions[last[has_last]].toarray()
        return scores + tie_break
    return score


def baselines(interactions: Interactions, parts: Split, evalset: EvalSet, ks=KS) -> dict:
    """Metrics of popularity, EASE (None past EASE_MAX_ITEMS items) and item transitions."""
    results = {}
    for name, make in (("popularity", popularity_scorer), ("ease", ease_scorer),
                       ("item_transition", transition_scorer)):
        if name == "ease" and interactions.num_items > EASE_MAX_ITEMS:
            results[name] = None
            continue
        results[name] = evaluate(make(interactions, parts.train, evalset), evalset, ks)
    return results
