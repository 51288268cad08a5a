"""Held-out rows of a split part, with what the model knew of each user before them.

A held-out part is scored the way it is served: from each user's state as of the rows known
before the part (for `test`: the training and validation rows, what an export bakes in; for
`validation`: the training rows), frozen for every held-out row of that user. Under the
per-user temporal split that state is the user's whole past; under the random split (several
held-out rows per user) it is the user's training rows.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

from tworec.features.interactions import DataError, Interactions, interaction_matrix
from tworec.features.splits import Split


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """Held-out rows of one split part and what each user had before them.

    Attributes:
        rows: [m] rows of the log being predicted.
        users: [m] user codes. targets: [m] item codes.
        history: [m, num_items] CSR 0/1 of the items the row's user had in the known rows.
        last_item: [m] item code of the user's latest known interaction, -1 if none.
        known: [m] bool, whether the user has known rows (an export knows them; others are
            served the popular items).
        catalogue: [num_items] bool, the items ranked: those with known rows (what an export
            of them serves); a row whose target is outside is a miss.
        exclude_seen: whether `history` is excluded from the ranking (as the exports do).
    """

    rows: np.ndarray
    users: np.ndarray
    targets: np.ndarray
    history: sp.csr_matrix
    last_item: np.ndarray
    known: np.ndarray
    catalogue: np.ndarray
    exclude_seen: bool = True

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def excluded(self) -> sp.csr_matrix:
        """[m, num_items] CSR of the items not to rank: `history`, or none."""
        return self.history if self.exclude_seen else sp.csr_matrix(self.history.shape,
                                                                    dtype=np.float32)


def known_rows(parts: Split, part: str) -> np.ndarray:
    """The rows known before `part` is held out: train and validation for `test`, train for
    `validation`."""
    if part == "test":
        return parts.fit
    if part == "validation":
        return parts.train
    raise DataError(f"unknown evaluation part {part!r}; use 'test' or 'validation'")


def repeated_targets(interactions: Interactions, parts: Split, part: str) -> np.ndarray:
    """[m] bool for the rows of `part`: whether the row's item is already among its user's
    rows known before the part (`known_rows`), as `eval_set`'s history holds them. With seen
    items excluded, such a row is a miss at every K for every model. Pairs compared as keys,
    without the [m, num_items] history."""
    def keys(rows: np.ndarray) -> np.ndarray:
        return interactions.user[rows].astype(np.int64) * interactions.num_items + \
            interactions.item[rows]
    return np.isin(keys(getattr(parts, part)), keys(known_rows(parts, part)))


def part_catalogue(interactions: Interactions, parts: Split, part: str) -> np.ndarray:
    """[num_items] bool: the items of the rows known before `part` (`known_rows`), the
    catalogue an export of those rows serves and its held-out rows are ranked among."""
    return interactions.items_of(known_rows(parts, part))


def eval_set(interactions: Interactions, parts: Split, part: str = "test",
             exclude_seen: bool = True) -> EvalSet:
    """The rows of `part` with each user's state as of the rows known before it."""
    before = known_rows(parts, part)
    rows = getattr(parts, part)
    known = interactions.take(before)
    order = known.time_order()
    last = np.full(interactions.num_users, -1)
    last[known.user[order]] = known.item[order]                # later rows overwrite earlier
    users = interactions.user[rows]
    history = interaction_matrix(interactions, before)[users]  # [m, I] the user's known items
    has_rows = np.bincount(known.user, minlength=interactions.num_users) > 0
    return EvalSet(rows=rows, users=users, targets=interactions.item[rows], history=history,
                   last_item=last[users], known=has_rows[users], exclude_seen=exclude_seen,
                   catalogue=part_catalogue(interactions, parts, part))
