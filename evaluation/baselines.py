"""The baselines every report carries, fit on the training rows only: popularity, EASE (closed
form) and first-order item transitions; and popular now, the list the exports serve users never
seen (from the rows known before the part, as the exports). For a held-out row a baseline may
use all of the user's earlier interactions as history. Also the choice, on validation, of what
users never seen are served (`cold_start_window`)."""
from __future__ import annotations

import numpy as np

import scipy.sparse as sp

from tworec.evaluation.metrics import (KS, MISS, evaluate_ranks, paired_bootstrap,
                                       prepared_ranks, rank_metrics, row_metrics)
from tworec.evaluation.sets import EvalSet
from tworec.features.history import transition_counts
from tworec.features.inputs import COLD_START_WINDOWS, PopularItems, popular_items
from tworec.features.interactions import Interactions, interaction_matrix
from tworec.features.splits import Split
from tworec.features.stream import PreparedLog
from tworec.features.vocab import FIRST

EASE_MAX_ITEMS = 20_000
MIN_COLD_ROWS, MIN_COLD_USERS = 100, 20   # validation rows and users never seen to choose on


def cold_start_window(interactions: Interactions, parts: Split, windows=COLD_START_WINDOWS
                      ) -> dict:
    """The share of the latest known rows whose counts order what users never seen are served
    (`features.inputs.popular_items`), chosen on validation, on the rows of users without
    training rows: all rows (1.0) unless a shorter window beats them there with the paired
    bootstrap 95% interval (over users) of its NDCG@10 gain above zero; then the best such
    window, ties to the larger. All rows with fewer than `MIN_COLD_ROWS` such rows or
    `MIN_COLD_USERS` such users.

    Returns:
        {"window": the window, "rows" and "users": the validation rows of users never seen and
        their number, "validation": {window: {"ndcg@10": its NDCG@10 there, "ci95": the
        interval of its gain over all rows (None for all rows)}}, empty when not chosen}.
    """
    trained = np.bincount(interactions.user[parts.train], minlength=interactions.num_users) > 0
    cold = parts.validation[~trained[interactions.user[parts.validation]]]
    users = interactions.user[cold]
    choice = {"window": 1.0, "rows": int(len(cold)), "users": int(len(np.unique(users))),
              "validation": {}}
    if choice["rows"] < MIN_COLD_ROWS or choice["users"] < MIN_COLD_USERS:
        return choice
    per_row = {}
    for window in sorted(set(windows) | {1.0}, reverse=True):
        popular = popular_items(interactions, parts.train, window)
        position = np.full(len(popular.order), MISS)          # outside the catalogue: a miss
        position[popular.order[:popular.size]] = np.arange(popular.size)
        per_row[window] = row_metrics(position[interactions.item[cold]], 10)["ndcg@10"]
    table = {window: {"ndcg@10": float(ndcg.mean()), "ci95": None if window == 1.0 else
                      paired_bootstrap(ndcg, per_row[1.0], groups=users)["ci95"]}
             for window, ndcg in per_row.items()}
    winners = [window for window, row in table.items() if window == 1.0 or row["ci95"][0] > 0]
    best = max(winners, key=lambda window: (table[window]["ndcg@10"], window))
    return {**choice, "window": best, "validation": table}


def order_scores(order: np.ndarray) -> np.ndarray:
    """[n] float32 scores, strictly decreasing along `order` [n] (a permutation of the item
    codes, best first): a list ranked in a served order, which ties nothing."""
    scores = np.empty(len(order), np.float32)
    scores[order] = -np.arange(len(order))
    return scores


def count_order(counts: np.ndarray, item_ids: np.ndarray) -> np.ndarray:
    """[n] item codes by decreasing `counts` [n], ties by `item_ids` [n]: a baseline of counts
    is scored as a list of them is served, in one strict order, not with every tie against
    its held-out item; by id, so that a log's in-memory and prepared baselines, whose codes
    differ, rank alike."""
    return np.lexsort((np.asarray(item_ids), -np.asarray(counts)))


def popular_list_scorer(popular: PopularItems):
    """Every row scored by the order of `popular` (strictly decreasing: no ties)."""
    scores = order_scores(popular.order)
    return lambda positions: np.broadcast_to(scores, (len(positions), len(scores)))


def popularity_scorer(interactions: Interactions, train: np.ndarray, evalset: EvalSet):
    """Every row scored by the items' training counts, in one strict order (`count_order`)."""
    counts = np.bincount(interactions.item[train], minlength=interactions.num_items)
    scores = order_scores(count_order(counts, interactions.item_ids))
    return lambda positions: np.broadcast_to(scores, (len(positions), len(scores)))


def ease_scorer(interactions: Interactions, train: np.ndarray, evalset: EvalSet,
                regularisation: float = 200.0):
    """EASE (Steck 2019): B = I - P / diag(P) with P = (X'X + lambda I)^-1, over the items that
    occur in training; a user's score is their earlier items times B. A user without any
    training item in their history (one the models serve the popular items) is scored by the
    items' training counts, as the popularity baseline: EASE's score would tie every item."""
    x = interaction_matrix(interactions, train)
    used = np.flatnonzero(np.asarray(x.sum(0)).ravel())
    gram = (x[:, used].T @ x[:, used]).toarray().astype(np.float64)   # [u, u]
    gram[np.diag_indices_from(gram)] += regularisation
    inverse = np.linalg.inv(gram)
    weights = (-inverse / np.diag(inverse)).astype(np.float32)          # [u, u]
    np.fill_diagonal(weights, 0.0)
    history = evalset.history[:, used]
    popular = popularity_scorer(interactions, train, evalset)
    has_history = history.getnnz(axis=1) > 0                              # [m]

    def score(positions):
        scores = np.full((len(positions), interactions.num_items), -1e9, dtype=np.float32)
        scores[:, used] = history[positions] @ weights                    # [b, u] x [u, u]
        without = ~has_history[positions]
        scores[without] = popular(positions[without])
        return scores
    return score


def transition_scorer(interactions: Interactions, train: np.ndarray, evalset: EvalSet):
    """Score of item j = how often j followed the user's last item; popularity breaks ties."""
    score = transition_scores(transition_counts(interactions, train),
                              np.bincount(interactions.item[train],
                                          minlength=interactions.num_items),
                              interactions.item_ids)
    return lambda positions: score(evalset.last_item[positions])


def transition_scores(transitions: sp.csr_matrix, popularity: np.ndarray,
                      item_ids: np.ndarray):
    """last items [b] (-1: none) -> scores [b, num_items]: how often each item followed the
    last item ([num_items, num_items] `transitions`), plus a share below 1 that orders equal
    counts by `popularity` [num_items], then by `item_ids` (`count_order`; distinct to
    float32 precision)."""
    size = len(popularity)
    position = np.empty(size, np.int64)
    position[count_order(popularity, item_ids)] = np.arange(size)
    tie_break = ((size - position) / (size + 1.0)).astype(np.float32)

    def score(last: np.ndarray) -> np.ndarray:
        scores = np.zeros((len(last), len(popularity)), dtype=np.float32)
        has_last = last >= 0
        scores[has_last] = transitions[last[has_last]].toarray()
        return scores + tie_break
    return score


def baseline_ranks(interactions: Interactions, parts: Split, evalset: EvalSet,
                   popular: PopularItems | None = None) -> dict[str, np.ndarray | None]:
    """[m] rank of every held-out row's target (`evaluate_ranks`) under popularity, EASE (None
    past EASE_MAX_ITEMS items) and item transitions, and with `popular` (the list users never
    seen are served, `ModelInputs.popular` of the held-out part) that list for every user as
    `popular_now`."""
    results = {}
    for name, make in (("popularity", popularity_scorer), ("ease", ease_scorer),
                       ("item_transition", transition_scorer)):
        if name == "ease" and interactions.num_items > EASE_MAX_ITEMS:
            results[name] = None
            continue
        results[name] = evaluate_ranks(make(interactions, parts.train, evalset), evalset, name)
    if popular is not None:
        results["popular_now"] = evaluate_ranks(popular_list_scorer(popular), evalset,
                                                      "popular_now")
    return results


def baselines(interactions: Interactions, parts: Split, evalset: EvalSet, ks=KS,
              popular: PopularItems | None = None) -> dict:
    """Metrics of `baseline_ranks`."""
    return {name: None if ranks is None else rank_metrics(ranks, ks)
            for name, ranks in baseline_ranks(interactions, parts, evalset, popular).items()}


def prepared_baseline_ranks(prepared: PreparedLog, part: str = "test",
                            memory_limit: str = "1GB") -> dict[str, np.ndarray | None]:
    """`baseline_ranks` of a prepared log: popularity and item transitions fit on its
    training rows, counted by DuckDB (`PreparedLog.item_counts`, `transition_counts`), scored
    batch by batch in one read of the held-out rows (`prepared_ranks`); a held-out row's last
    item is its `previous` item, whatever the history length (item transitions are None for
    a folder an earlier version prepared without history, whose shards do not tell it). EASE,
    a dense inverse over the catalogue, is None. Memory holds the counts, one pass of held-out
    rows with their users' known items, and one batch's scores. A held-out item without
    training rows is a miss (in memory too, but for a test row's item that has validation rows,
    which the baselines of training counts rank below every trained item the user has not
    seen)."""
    item_ids = prepared.item_ids()
    popular = order_scores(count_order(prepared.item_counts, item_ids))
    scorers = {"popularity": lambda rows: np.broadcast_to(popular, (len(rows["user"]),
                                                                    len(popular)))}
    if prepared.knows_previous_items:
        transitions = transition_scores(prepared.transition_counts(memory_limit),
                                        prepared.item_counts, item_ids)
        scorers["item_transition"] = lambda rows: transitions(
            rows["previous"].astype(np.int64) - FIRST)
    ranks = prepared_ranks(scorers, prepared, part, memory_limit)
    return {"popularity": ranks["popularity"], "ease": None,
            "item_transition": ranks.get("item_transition")}


def prepared_baselines(prepared: PreparedLog, part: str = "test", ks=KS,
                       memory_limit: str = "1GB") -> dict:
    """Metrics of `prepared_baseline_ranks`, as `baselines` gives them."""
    return {name: None if ranks is None else rank_metrics(ranks, ks)
            for name, ranks in prepared_baseline_ranks(prepared, part, memory_limit).items()}
