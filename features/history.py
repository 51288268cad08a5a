"""Users' time-ordered sequences: each interaction's previous L items, every user's latest
items, and item-to-next-item transition counts, built once with vectorised NumPy."""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from tworec.features.interactions import Interactions


def _time_sorted(interactions: Interactions, item_index: np.ndarray | None):
    """Time order [n], and the users [n] and (mapped) items [n] int64 in that order."""
    order = interactions.time_order()
    items = interactions.item[order].astype(np.int64)
    if item_index is not None:
        items = np.asarray(item_index, dtype=np.int64)[items]
    return order, interactions.user[order], items


def build_history(interactions: Interactions, length: int, item_index: np.ndarray | None = None,
                  pad: int = -1) -> np.ndarray:
    """The `length` items each user interacted with just before each interaction.

    "Before" is the time order of `Interactions.time_order` (timestamp, ties in log order), the
    order the temporal split uses, so the test row's history is everything else of its user.

    Args:
        interactions: the whole log (all splits: a test row sees its train and validation items).
        length: L, the number of previous items.
        item_index: optional [num_items] int mapping item codes to model indexes (a vocabulary's
            `remap`); by default item codes are used as they are.
        pad: the value of the slots before a user's first interaction.

    Returns:
        [n, L] int64, row i aligned with interaction i, oldest first, left-padded with `pad`.
    """
    order, users, items = _time_sorted(interactions, item_index)
    first_of_user = np.concatenate([[0], np.flatnonzero(np.diff(users)) + 1])
    starts = np.repeat(first_of_user, np.diff(np.append(first_of_user, len(users))))  # [n]
    positions = np.arange(len(users))
    history_sorted = np.full((len(users), length), pad, dtype=np.int64)
    for back in range(1, length + 1):                      # slot L - back holds the item `back` ago
        source = positions - back
        valid = source >= starts
        history_sorted[valid, length - back] = items[source[valid]]
    history = np.empty_like(history_sorted)
    history[order] = history_sorted
    return history


def latest_history(interactions: Interactions, length: int, item_index: np.ndarray | None = None,
                   pad: int = -1) -> np.ndarray:
    """[num_users, L] int64: every user's last L items of the whole log, oldest first, to serve
    a user by id alone."""
    _, users, items = _time_sorted(interactions, item_index)
    counts = np.bincount(users, minlength=interactions.num_users)
    ends = np.cumsum(counts)                                # one past each user's last row
    latest = np.full((interactions.num_users, length), pad, dtype=np.int64)
    for back in range(1, length + 1):
        valid = counts >= back
        latest[valid, length - back] = items[ends[valid] - back]
    return latest


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
