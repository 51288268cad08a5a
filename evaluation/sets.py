"""Held-out rows of a split part, with what each user had before them."""
from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

from tworec.features.interactions import DataError, Interactions
from tworec.features.splits import Split


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
