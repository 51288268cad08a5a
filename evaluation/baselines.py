"""The baselines every report carries, fit on the training rows only: popularity, EASE (closed
form) and first-order item transitions. For a held-out row a baseline may use all of the user's
earlier interactions as history."""
from __future__ import annotations

import numpy as np

from tworec.evaluation.metrics import KS, evaluate_ranks, rank_metrics
from tworec.evaluation.sets import EvalSet
from tworec.features.history import transition_counts
from tworec.features.interactions import Interactions, interaction_matrix
from tworec.features.splits import Split

EASE_MAX_ITEMS = 20_000


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
    history = evalset.history[:, used]

    def score(positions):
        scores = np.full((len(positions), interactions.num_items), -1e9, dtype=np.float32)
        scores[:, used] = history[positions] @ weights                    # [b, u] x [u, u]
        return scores
    return score


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


def baseline_ranks(interactions: Interactions, parts: Split, evalset: EvalSet
                   ) -> dict[str, np.ndarray | None]:
    """[m] rank of every held-out row's target (`evaluate_ranks`) under popularity, EASE (None
    past EASE_MAX_ITEMS items) and item transitions."""
    results = {}
    for name, make in (("popularity", popularity_scorer), ("ease", ease_scorer),
                       ("item_transition", transition_scorer)):
        if name == "ease" and interactions.num_items > EASE_MAX_ITEMS:
            results[name] = None
            continue
        results[name] = evaluate_ranks(make(interactions, parts.train, evalset), evalset, name)
    return results


def baselines(interactions: Interactions, parts: Split, evalset: EvalSet, ks=KS) -> dict:
    """Metrics of popularity, EASE (None past EASE_MAX_ITEMS items) and item transitions."""
    return {name: None if ranks is None else rank_metrics(ranks, ks)
            for name, ranks in baseline_ranks(interactions, parts, evalset).items()}
