"""The columnar interaction log every later step reads.

Ids are stored once per distinct value (`user_ids`, `item_ids`, strings) and referred to by
integer codes per interaction (`user`, `item`), the way a categorical column is. Every step works
on whole NumPy arrays; nothing iterates over rows in Python.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp


class DataError(ValueError):
    """An input log that cannot be used; the message names the input and what was wrong."""


class SourceNotFound(DataError):
    """A log's path (a file, folder, glob or TFDS data directory) that holds nothing to read."""


@dataclasses.dataclass(frozen=True)
class Interactions:
    """An interaction log with its item and user tables.

    Attributes:
        user_ids: [num_users] str, the distinct user ids.
        item_ids: [num_items] str, every item of the item table, or of the log when there is
            no item table (catalogue codes index it; what an export serves is the items of its
            fit rows, `ModelInputs.catalogue`).
        user: [n] int32, index into `user_ids` per interaction.
        item: [n] int32, index into `item_ids` per interaction.
        timestamp: [n] int64, seconds (or any increasing integer clock).
        rating: [n] float32 or None for implicit feedback.
        item_features: name -> [num_items, ...] array aligned with `item_ids`
            (`genres` multi-hot float32, `year` int32 with 0 unknown, `title` str).
        user_features: name -> [num_users] array aligned with `user_ids` (str or numbers); of
            a feature that changes within a user, each user's last value in the log.
        user_feature_rows: name -> [n] each interaction's value, for the user features read
            from the log's rows whose value changes within a user (`user_feature_at`).
        genre_names: the names of the `genres` columns.
        dropped: reason -> number of input rows dropped for it.
        source: where the log came from.
        unread_columns: the columns of a generic log that no role reads (`--columns` maps
            them), in file order.
    """

    user_ids: np.ndarray
    item_ids: np.ndarray
    user: np.ndarray
    item: np.ndarray
    timestamp: np.ndarray
    rating: np.ndarray | None = None
    item_features: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    user_features: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    user_feature_rows: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    genre_names: tuple[str, ...] = ()
    dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    source: str = ""
    unread_columns: tuple[str, ...] = ()

    def __post_init__(self):
        n = len(self.user)
        for name in ("item", "timestamp", "rating"):
            column = getattr(self, name)
            if column is not None and len(column) != n:
                raise DataError(f"{self.source}: column {name!r} has {len(column)} rows, "
                                f"user has {n}")
        for name, column in self.user_feature_rows.items():
            if len(column) != n or name not in self.user_features:
                raise DataError(f"{self.source}: user feature {name!r} has {len(column)} row "
                                f"values for {n} rows, or no value per user")
        for table, ids in ((self.item_features, self.item_ids), (self.user_features, self.user_ids)):
            for name, values in table.items():
                if len(values) != len(ids):
                    raise DataError(f"{self.source}: feature {name!r} has {len(values)} rows "
                                    f"for {len(ids)} ids")

    def __len__(self) -> int:
        return len(self.user)

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_items(self) -> int:
        return len(self.item_ids)

    def take(self, rows: np.ndarray) -> Interactions:
        """The interactions at `rows` ([m] int), with the same id tables and features."""
        rating = None if self.rating is None else self.rating[rows]
        return dataclasses.replace(self, user=self.user[rows], item=self.item[rows],
                                   timestamp=self.timestamp[rows], rating=rating,
                                   user_feature_rows={name: values[rows] for name, values
                                                      in self.user_feature_rows.items()})

    def user_feature_at(self, name: str, rows: np.ndarray) -> np.ndarray:
        """[num_users] str: user feature `name` as known after `rows` ([m] int): of a feature
        that changes within a user, each user's value at their last row among `rows` in time
        order ('' for users without one), so that no later row's value reaches it; else the
        user table's value."""
        if name not in self.user_feature_rows:
            return np.asarray(self.user_features[name]).astype(str)
        part = self.take(rows)
        order = part.time_order()
        users = part.user[order]
        last = order[np.append(users[1:] != users[:-1], True)] if len(order) else order
        known = np.full(self.num_users, "", dtype=object)
        known[part.user[last]] = part.user_feature_rows[name][last].astype(str)
        return known.astype(str)

    def items_of(self, rows: np.ndarray) -> np.ndarray:
        """[num_items] bool: whether each item is the item of one of `rows` ([m] int)."""
        return np.bincount(self.item[rows], minlength=self.num_items) > 0

    def time_order(self) -> np.ndarray:
        """[n] int64 rows sorted by user, then timestamp, ties kept in log order."""
        return np.lexsort((np.arange(len(self)), self.timestamp, self.user))

    def summary(self) -> dict:
        """Counts of users, items and interactions, and the dropped rows by reason."""
        return {"source": self.source, "users": self.num_users, "items": self.num_items,
                "interactions": len(self), "has_ratings": self.rating is not None,
                "item_features": sorted(self.item_features), "user_features": sorted(self.user_features),
                "dropped": dict(self.dropped), "unread_columns": list(self.unread_columns)}


def interaction_matrix(interactions: Interactions, rows: np.ndarray) -> sp.csr_matrix:
    """[num_users, num_items] 0/1 CSR of the interactions at `rows`."""
    matrix = sp.csr_matrix((np.ones(len(rows), dtype=np.float32),
                            (interactions.user[rows], interactions.item[rows])),
                           shape=(interactions.num_users, interactions.num_items))
    matrix.data[:] = 1.0
    return matrix


def first_appearance(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct [d] of `values` [n] in order of first appearance, codes [n] int32 with
    distinct[codes] == values)."""
    distinct, first, codes = np.unique(values, return_index=True, return_inverse=True)
    appearance = np.argsort(first, kind="stable")
    rank = np.empty_like(appearance)
    rank[appearance] = np.arange(len(appearance))
    return distinct[appearance], rank[codes.reshape(-1)].astype(np.int32)


def drop_duplicate_rows(user: np.ndarray, item: np.ndarray, timestamp: np.ndarray,
                        rating: np.ndarray | None) -> np.ndarray:
    """[n] bool mask keeping the first of each group of exactly equal rows (file order)."""
    keys = [timestamp, item, user] if rating is None else [rating, timestamp, item, user]
    order = np.lexsort(keys)
    same = np.ones(len(order) - 1, dtype=bool) if len(order) else np.zeros(0, dtype=bool)
    for key in keys:
        same &= key[order[1:]] == key[order[:-1]]
    keep = np.ones(len(user), dtype=bool)
    keep[order[1:][same]] = False
    return keep
