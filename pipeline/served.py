"""The run proves its own numbers: it serves its exports, asks for every test user's list over
REST and gRPC, scores the served lists against the held-out items, and compares them with the
offline figures row by row.

A row whose served rank differs from its offline rank must be a float tie: the target's
offline score equal (to float32 precision) to the served score at its offline rank. Anything
else fails the run.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

from tworec.evaluation import KS, MISS, rank_metrics
from tworec.evaluation.metrics import entries
from tworec.serving.client import Client
from tworec.serving.protocol import DEFAULT_SIGNATURE

REQUEST_USERS = 200          # users per request: well inside the server's row limit


class ServedMismatch(AssertionError):
    """The served answers disagree with the offline figures beyond float ties."""


@dataclasses.dataclass(frozen=True)
class Offline:
    """What the offline evaluation found for the checked rows of one model.

    Attributes:
        ranks: [m] rank of every row's target (a miss past the list the export serves).
        target_scores: [m] the model's score of the row's target.
    """

    ranks: np.ndarray
    target_scores: np.ndarray

    def at(self, rows: np.ndarray) -> Offline:
        """The figures of `rows` ([c] positions) only."""
        return Offline(ranks=self.ranks[rows], target_scores=self.target_scores[rows])


def strings(values) -> np.ndarray:
    """[...] bytes or str -> [...] str."""
    values = np.asarray(values)
    return np.vectorize(lambda v: v.decode() if isinstance(v, bytes) else str(v))(values) \
        if values.size else values.astype(str)


def ask(client: Client, model: str, user_ids: np.ndarray, history: np.ndarray | None = None
        ) -> dict[str, np.ndarray]:
    """{"item_ids": [u, n] str, "scores": [u, n]} of a served model for every user, in
    requests of `REQUEST_USERS`: its `serving_default` signature's, or given `history` ([u, L]
    str, "" for padding) its `with_history` signature's."""
    def inputs(start: int) -> dict[str, np.ndarray]:
        rows = slice(start, start + REQUEST_USERS)
        return {"user_id": user_ids[rows]} if history is None else \
            {"user_id": user_ids[rows], "history": history[rows]}
    signature = DEFAULT_SIGNATURE if history is None else "with_history"
    answers = [client.predict(model, inputs(start), signature)
               for start in range(0, len(user_ids), REQUEST_USERS)]
    return {"item_ids": strings(np.concatenate([a["item_ids"] for a in answers])),
            "scores": np.concatenate([a["scores"] for a in answers]).astype(np.float32)}


def served_ranks(item_ids: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """[m] position of each target id in its row of served ids [m, n]; n when absent."""
    found = item_ids == targets[:, None]
    return np.where(found.any(1), found.argmax(1), item_ids.shape[1])


def beyond_list_missed(ranks: np.ndarray, length: int) -> np.ndarray:
    """[m] ranks with every one at or past `length`, the number of items an export serves,
    made a miss: a report's K larger than the served list scores only the served list."""
    return np.where(ranks >= length, MISS, ranks)


def describe_rank(rank: int) -> str:
    return "a miss" if rank == MISS else str(rank)


def scored(served: dict[str, np.ndarray], targets: np.ndarray) -> dict:
    """The metrics of served lists ({"item_ids": [m, n], ...}) against the held-out items
    [m]: {"recall@K", "ndcg@K" for every K of the report (past n a miss), "rows": m}."""
    ranks = served_ranks(served["item_ids"], targets)
    return {**rank_metrics(beyond_list_missed(ranks, served["item_ids"].shape[1]), KS),
            "rows": int(len(targets))}


def shared_share(item_ids: np.ndarray, exact_ids: np.ndarray) -> float:
    """The share of the exact lists' items [u, n] ("" for an empty slot) that the lists
    `item_ids` [u, n] also hold, over all users: an approximate index's recall of the exact
    lists as served."""
    real = exact_ids != ""
    held = np.array([np.isin(exact, approximate) for exact, approximate in
                     zip(exact_ids, item_ids)]).reshape(exact_ids.shape)
    return float(held[real].mean()) if real.any() else 1.0


def compare(name: str, served: dict[str, np.ndarray], offline: Offline,
            targets: np.ndarray) -> dict:
    """Served against offline metrics of one model on the same rows.

    Args:
        served: the served lists of each row's user ({"item_ids": [m, n], "scores": [m, n]}).
        offline: the offline ranks and target scores of the rows.
        targets: [m] the held-out item ids.

    Returns:
        {"recall@K": ..., "ndcg@K": ... for every K of the report (an item the list of n
        does not hold is a miss at every K), "rows": m, "float_ties": rows whose ranks differ
        by a float tie}.

    Raises:
        ServedMismatch: a row differs for another reason.
    """
    length = served["item_ids"].shape[1]
    ranks = served_ranks(served["item_ids"], targets)
    capped = np.minimum(offline.ranks, length)
    differ = np.flatnonzero(ranks != capped)
    at = np.minimum(capped[differ], length - 1)
    tie = np.isclose(offline.target_scores[differ], served["scores"][differ, at],
                     rtol=1e-5, atol=1e-6)
    if not tie.all():
        rows = differ[~tie]
        raise ServedMismatch(
            f"{name}: {len(rows)} of {len(targets)} served lists rank the held-out item "
            f"otherwise than the offline evaluation (first row {rows[0]}: served rank "
            f"{ranks[rows[0]]}, offline {describe_rank(offline.ranks[rows[0]])})")
    return {**scored(served, targets), "float_ties": int(len(differ))}


def catalogue_codes(item_ids: np.ndarray, catalogue: np.ndarray) -> np.ndarray:
    """[...] catalogue code of every served item id [...] (ids [num_items]); -1 for an id the
    catalogue lacks ("" for an empty slot)."""
    order = np.argsort(catalogue)
    position = np.searchsorted(catalogue, item_ids, sorter=order)
    codes = order[np.minimum(position, len(catalogue) - 1)]
    return np.where(catalogue[codes] == item_ids, codes, -1)


def seen_served(item_ids: np.ndarray, catalogue: np.ndarray, seen: sp.csr_matrix) -> int:
    """How many served items [u, n] (ids; "" for an empty slot) are among the users' seen
    items ([u, num_items] CSR over the catalogue ids [num_items])."""
    codes = catalogue_codes(item_ids, catalogue)
    real = codes >= 0                     # none in the empty lists of users who saw every item
    rows = np.repeat(np.arange(len(item_ids)), item_ids.shape[1]).reshape(item_ids.shape)
    return int((entries(seen, rows[real], codes[real]) > 0).sum())


def outside_served(item_ids: np.ndarray, catalogue_ids: np.ndarray,
                   catalogue: np.ndarray) -> int:
    """How many served items [u, n] (ids; "" for an empty slot) are not in the catalogue
    (`catalogue` [num_items] bool over the ids [num_items]; an id the ids lack counts too)."""
    codes = catalogue_codes(item_ids, catalogue_ids)
    return int(((item_ids != "") & ((codes < 0) | ~catalogue[np.maximum(codes, 0)])).sum())
