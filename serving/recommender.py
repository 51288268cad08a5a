"""The two-stage recommender over a `Client`: retrieval top-K, ranking, the user's top-N.

Signatures used (batch is dimension 0):
    retrieval serving_default: user_id [b] string -> item_ids [b, k] string, scores [b, k] float32
    ranking serving_default: user_id [b] string, item_ids [b, k] string -> scores [b, k] float32
    ranking candidates (when the export has it): user_id [b] string, item_ids [b, k] string ->
        item_ids [b, k + E] string, retrieval's then the ranking stage's own (title candidates)
    retrieval known_users (`Recommender.known_users`): user_id [b] string -> known [b] bool
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from tworec.serving.client import Client
from tworec.serving.errors import ServingError

PAD_ID = b""


def top_n(item_ids: np.ndarray, scores: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n best of every row, ties to the earlier column (as `tf.math.top_k`).

    Args:
        item_ids: [b, k] candidates.
        scores: [b, k] their scores; -inf marks a removed candidate.
        n: how many to keep.

    Returns:
        (item_ids [b, min(n, k)], scores [b, min(n, k)]); a slot left without a candidate holds
        `PAD_ID` and -inf.
    """
    order = np.argsort(-scores, axis=1, kind="stable")[:, :n]              # [b, n]
    ids = np.take_along_axis(item_ids, order, axis=1)
    best = np.take_along_axis(scores, order, axis=1)
    return np.where(np.isneginf(best), PAD_ID, ids), best


class Recommender:
    """Retrieval, then ranking of the retrieved candidates, then top-N, over one client.

    Args:
        client: a `Client` (over real TF Serving too), or a stand-in with its `predict` and
            `predict_version`.
        retrieval_model: the served name of the retrieval model.
        ranking_model: the served name of the ranking model.
    """

    def __init__(self, client: Client, retrieval_model: str = "retrieval",
                 ranking_model: str = "ranking"):
        self.client = client
        self.retrieval_model = retrieval_model
        self.ranking_model = ranking_model

    def recommend(self, user_ids: Sequence[str] | np.ndarray, n: int = 10,
                  seen: Sequence[Sequence[str]] | None = None) -> dict[str, np.ndarray]:
        """The top-n items of every user.

        Args:
            user_ids: [b] user ids.
            n: how many items per user.
            seen: per user, item ids to leave out (e.g. what they rated already), or None.

        Returns:
            {"item_ids": [b, w] bytes, "scores": [b, w] float32} from the ranking model, best
            first, w = min(n, the candidates a user can have: retrieval's k and the title
            candidates; the composed `recommender` export always answers its `top_n`). A slot
            without a candidate holds `PAD_ID`: scored -inf where `seen` removed the candidate,
            and below the row's every real score where retrieval found fewer than k items or
            the ranking model fewer title candidates than it adds (the ranking export scores
            its padding so).
        """
        if np.ndim(user_ids) != 1:
            raise ValueError(f"user_ids must be a flat list of ids, got shape "
                             f"{np.shape(user_ids)}")
        users = _as_bytes(user_ids)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n must be a whole number of at least 1, got {n!r}")
        if seen is not None and len(seen) != len(users):
            raise ValueError(f"seen has {len(seen)} rows for {len(users)} users")
        if seen is not None and any(isinstance(row, (str, bytes)) for row in seen):
            raise ValueError("seen holds one list of item ids per user, e.g. [['i1', 'i2']], "
                             "not ids alone")
        retrieved = self.client.predict(self.retrieval_model, {"user_id": users})["item_ids"]
        if not len(users):               # JSON could not carry the [0, k] candidates
            candidates, scores = retrieved, np.zeros(retrieved.shape, np.float32)
        else:
            candidates, scores = self.ranked(users, retrieved)
        if seen is not None:
            scores = np.where(_seen_mask(candidates, seen), -np.inf, scores).astype(np.float32)
        return dict(zip(("item_ids", "scores"), top_n(candidates, scores, n)))

    def ranked(self, users: np.ndarray, retrieved: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidates [b, k + E], scores [b, k + E]): retrieval's candidates [b, k] with the
        ranking model's own (`added_candidates`), scored by the version that added them (a
        hot swap between the two requests never joins two versions' answers; one retired
        meanwhile starts the pair over once), or by the latest version when the ranking model
        has no `candidates` signature."""
        for attempt in range(2):
            candidates, version = self.added_candidates(users, retrieved)
            try:
                answer = self.client.predict(self.ranking_model,
                                             {"user_id": users, "item_ids": candidates},
                                             version=version)
            except ServingError as error:
                if version is None or error.code != "NOT_FOUND" or attempt == 1:
                    raise
                continue
            if "item_ids" in answer and not self._reads_item_ids(version):
                raise ValueError(f"model {self.ranking_model!r} answers item_ids and takes "
                                 "none, as a retrieval model does: it scored no candidate "
                                 "(REST leaves an input a signature lacks unread); name the "
                                 "ranking model")
            return candidates, answer["scores"]

    def _reads_item_ids(self, version: int | None) -> bool:
        """Whether the ranking model's serving_default takes item_ids (True when the client
        cannot say: a stand-in without `metadata`)."""
        metadata = getattr(self.client, "metadata", None)
        if metadata is None:
            return True
        signature = metadata(self.ranking_model, version).signature_def["serving_default"]
        return "item_ids" in signature.inputs

    def added_candidates(self, users: np.ndarray, candidates: np.ndarray
                         ) -> tuple[np.ndarray, int | None]:
        """([b, k + E] retrieval's candidates [b, k] and the ranking model's own (its
        `candidates` signature: title candidates), the version that answered), or retrieval's
        alone and None from a ranking model without that signature (tworec's before it had
        one, or another ranking model)."""
        try:
            answer, version = self.client.predict_version(
                self.ranking_model, {"user_id": users, "item_ids": candidates},
                signature_name="candidates")
            return answer["item_ids"], version
        except ServingError as error:
            if error.code != "FAILED_PRECONDITION":        # not a missing signature
                raise
            return candidates, None

    def known_users(self, user_ids: Sequence[str] | np.ndarray) -> np.ndarray | None:
        """[b] bool: whether the retrieval model was fit on rows of each user (the others get
        the list for users never seen); None when its export has no `known_users` signature
        (tworec's before it had one, or another retrieval model)."""
        users = _as_bytes(user_ids)
        try:
            answer = self.client.predict(self.retrieval_model, {"user_id": users},
                                         signature_name="known_users")
        except ServingError as error:
            if error.code != "FAILED_PRECONDITION":        # not a missing signature
                raise
            return None
        return np.asarray(answer["known"], bool)


def _seen_mask(candidates: np.ndarray, seen: Sequence[Sequence[str]]) -> np.ndarray:
    """[b, k] True where the candidate is among the user's seen items."""
    return np.array([[item in row_seen for item in row]
                     for row, row_seen in zip(candidates, ({_bytes(i) for i in s} for s in seen))],
                    dtype=bool).reshape(candidates.shape)


def _as_bytes(user_ids) -> np.ndarray:
    """[b] object array of the ids as bytes."""
    return np.array([_bytes(u) for u in user_ids], dtype=object)


def _bytes(value) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")
