"""The ranker's pair features and the signals they come from.

Besides the model inputs, the ranker reads two signals, handed over as one `RankingSignals`
object to `list_examples` (training and evaluation) and to the export (baked into the graph):
the retrieval stage's embeddings (ranking never imports retrieval: they arrive as arrays) and
the item-to-next-item transition counts of the training rows.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp
import tensorflow as tf

from tworec.features.history import previous_items, transition_counts
from tworec.features.inputs import ModelInputs


@dataclasses.dataclass(frozen=True)
class RankingSignals:
    """What the ranker reads besides `ModelInputs`.

    Attributes:
        retrieval_queries: part -> [m, e] the retrieval query embedding of every row of that
            part, or None without the retrieval signal.
        retrieval_latest: [num_users, e] every user's retrieval query embedding from their
            latest history (what serving sees), or None.
        retrieval_items: [num_items, e] the retrieval item embeddings, or None.
        transitions: [V, V] CSR over item vocabulary indexes (`transition_matrix`), or None.
    """

    retrieval_queries: dict[str, np.ndarray] | None = None
    retrieval_latest: np.ndarray | None = None
    retrieval_items: np.ndarray | None = None
    transitions: sp.csr_matrix | None = None

    @property
    def has_retrieval(self) -> bool:
        return self.retrieval_items is not None


def signals(data: ModelInputs, use_transitions: bool, retrieval: dict | None = None
            ) -> RankingSignals:
    """The signals of a run: `retrieval` holds the retrieval stage's `queries` (part -> [m, e]),
    `latest` ([num_users, e]) and `items` ([num_items, e]) arrays."""
    retrieval = retrieval or {}
    return RankingSignals(retrieval_queries=retrieval.get("queries"),
                          retrieval_latest=retrieval.get("latest"),
                          retrieval_items=retrieval.get("items"),
                          transitions=transition_matrix(data) if use_transitions else None)


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


def retrieval_scores(queries: np.ndarray, items: np.ndarray, codes: np.ndarray,
                     chunk: int = 8192) -> np.ndarray:
    """[m, n] float32 retrieval dot products of queries [m, e] with the items [num_items, e] at
    catalogue codes [m, n], a chunk of rows at a time (bounded memory). The same TF op as the
    export's, so that training, evaluation and serving see the same float32 values."""
    scores = np.empty(codes.shape, np.float32)
    for start in range(0, len(codes), chunk):
        rows = slice(start, start + chunk)
        scores[rows] = tf.einsum("me,mne->mn", queries[rows],                         # [m, n]
                                 tf.gather(items, codes[rows])).numpy()
    return scores


def list_examples(data: ModelInputs, signals: RankingSignals, part: str,
                  items: np.ndarray) -> dict[str, np.ndarray]:
    """The ranker's inputs for candidate lists `items` [m, n] of the rows of `part`: the model
    inputs of each row, "items" [m, n], "retrieval_scores" [m, n] and "transitions" [m, n] when
    the signals carry them, and "rating" [m] of the item in slot 0 (zeros without ratings)."""
    examples = {k: v for k, v in data.examples[part].items() if k != "item"}
    examples["items"] = items
    if signals.has_retrieval:
        examples["retrieval_scores"] = retrieval_scores(
            signals.retrieval_queries[part], signals.retrieval_items, items)
    if signals.transitions is not None:
        examples["transitions"] = transition_features(signals.transitions, data, part, items)
    rating = data.interactions.rating
    rows = getattr(data.split, part)
    examples["rating"] = (np.zeros(len(rows), np.float32) if rating is None else rating[rows])
    return examples
