"""Train / validation / test splits of an `Interactions` log, as row indexes.

- `temporal`: per user, sorted by time with ties kept in log order: the last interaction is
  test, the second-last validation, the rest train. Users with fewer than 3 interactions stay
  wholly in train and are counted (`require_held_out`: a run refuses a log where no user has
  3 or more).
- `random`: the TFRS tutorials' protocol, an 80/20 shuffle with a seed (42); no validation.
- `global[:Q]` (Q = 0.9 by default): every row after the Q-quantile of timestamps is test; of
  the rows before it, those after the Q-quantile of their own timestamps are validation, the
  rest train. Nothing after a cut can reach what is fit before it: the protocol closest to
  deployment.
- `latest`: per user, the last interaction is validation, the rest train; nothing is tested.
  The deployment run of the recipe `temporal` evaluates, one row later: the models train and
  stop early, and the ranker is calibrated, as there, and the exports know every row. Users
  with a single interaction stay wholly in train and are counted (a run refuses a log of such
  users alone).
- `none`: every row is train; nothing is held out (a deployment run without validation).
- `cutoff`: everything before a global timestamp is train, the rest test.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tworec.features.interactions import DataError, Interactions

SPLITS = ("temporal", "random", "global", "latest", "none", "cutoff")
GLOBAL_QUANTILE = 0.9


@dataclasses.dataclass(frozen=True)
class Split:
    """Row indexes ([m] int64, each in increasing order) of the three parts of a log."""

    kind: str
    train: np.ndarray
    validation: np.ndarray
    test: np.ndarray
    short_users: int = 0   # users kept wholly in train for having too few interactions to
                           # hold any out (temporal: < 3, latest: < 2)

    @property
    def fit(self) -> np.ndarray:
        """[f] the rows the models are fit on and an export knows: train and validation."""
        return np.sort(np.concatenate([self.train, self.validation]))

    def sizes(self) -> dict[str, int]:
        return {"train": len(self.train), "validation": len(self.validation),
                "test": len(self.test)}


def split(interactions: Interactions, kind: str = "temporal", *, seed: int = 42,
          train_fraction: float = 0.8, cutoff: int | None = None) -> Split:
    """Splits a log; see the module docstring for the protocols (`global:0.8` sets Q)."""
    if kind == "temporal":
        return temporal_split(interactions)
    if kind == "random":
        return random_split(interactions, seed=seed, train_fraction=train_fraction)
    if kind.startswith("global"):
        return global_split(interactions, global_quantile(kind))
    if kind == "none":
        empty = np.zeros(0, dtype=np.int64)
        return Split("none", np.arange(len(interactions), dtype=np.int64), empty, empty)
    if kind == "latest":
        return latest_split(interactions)
    if kind == "cutoff":
        if cutoff is None:
            raise DataError("split 'cutoff' needs a cutoff timestamp")
        return cutoff_split(interactions, cutoff)
    raise DataError(f"unknown split {kind!r}; known: {list(SPLITS)}")


def global_quantile(kind: str) -> float:
    """Q of `global[:Q]`; raises DataError unless 0 < Q < 1."""
    name, colon, text = kind.partition(":")
    try:
        quantile = float(text) if colon else GLOBAL_QUANTILE          # 'global:' has no Q
    except ValueError:
        quantile = -1.0
    if name != "global":
        quantile = -1.0
    if not 0 < quantile < 1:
        raise DataError(f"split {kind!r}: write global or global:Q with 0 < Q < 1, e.g. global:0.9")
    return quantile


def global_split(interactions: Interactions, quantile: float = GLOBAL_QUANTILE) -> Split:
    """Rows after the `quantile` of timestamps are test; of the rest, rows after the same
    quantile of their timestamps are validation (ties stay before a cut)."""
    time = interactions.timestamp
    cut = np.quantile(time, quantile, method="lower")
    before = time <= cut
    if before.all():
        raise DataError(f"split global:{quantile}: no row is later than the cut "
                        f"(timestamps span {time.min()}..{time.max()})")
    validation_cut = np.quantile(time[before], quantile, method="lower")
    return Split(f"global:{quantile:g}", np.flatnonzero(before & (time <= validation_cut)),
                 np.flatnonzero(before & (time > validation_cut)), np.flatnonzero(~before))


def positions_from_end(interactions: Interactions) -> tuple[np.ndarray, np.ndarray]:
    """For every row, how many of its user's interactions come after it in time order, and how
    many interactions its user has. Both [n] int64."""
    order = interactions.time_order()
    counts = np.bincount(interactions.user, minlength=interactions.num_users)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    user_sorted = interactions.user[order]
    rank = np.arange(len(order)) - starts[user_sorted]                 # position in the user's time
    from_end = np.empty(len(order), dtype=np.int64)
    from_end[order] = counts[user_sorted] - 1 - rank
    return from_end, counts[interactions.user]


HELD_OUT_FROM = 3        # rows a user needs before the temporal protocol holds any out
VALIDATED_FROM = 2       # rows a user needs before the latest protocol validates on one


def temporal_split(interactions: Interactions) -> Split:
    from_end, count = positions_from_end(interactions)
    eligible = count >= HELD_OUT_FROM
    test = np.flatnonzero(eligible & (from_end == 0))
    validation = np.flatnonzero(eligible & (from_end == 1))
    train = np.flatnonzero(~eligible | (from_end >= 2))
    return Split("temporal", train, validation, test,
                 short_users=short_users(interactions, HELD_OUT_FROM))


def latest_split(interactions: Interactions) -> Split:
    """Each user's last row validation (users with `VALIDATED_FROM` rows or more), the rest
    train; no test rows."""
    from_end, count = positions_from_end(interactions)
    eligible = count >= VALIDATED_FROM
    return Split("latest", np.flatnonzero(~eligible | (from_end >= 1)),
                 np.flatnonzero(eligible & (from_end == 0)), np.zeros(0, dtype=np.int64),
                 short_users=short_users(interactions, VALIDATED_FROM))


def require_held_out(parts: Split) -> None:
    """Raises DataError when a split holds out nothing it is for: no test row for an
    evaluating protocol, no validation row for `latest` (no user of the log has enough rows):
    a run would measure, or calibrate, nothing. `none` holds out nothing by design."""
    if parts.kind == "latest" and not len(parts.validation):
        raise DataError(f"split 'latest': no user has {VALIDATED_FROM} or more rows, which "
                        "leaves nothing to validate, stop early or calibrate on; use split "
                        "'none'")
    if parts.kind not in ("latest", "none") and not len(parts.test):
        why = (f"no user has {HELD_OUT_FROM} or more rows" if parts.kind == "temporal" else
               f"it holds out none of the log's {len(parts.train) + len(parts.validation)} rows")
        raise DataError(f"split {parts.kind!r}: {why}, which leaves nothing to test; use split "
                        "'latest' (validates on each user's last row) or 'none'")


def short_users(interactions: Interactions, minimum: int) -> int:
    """How many users have rows, but fewer than `minimum` (kept wholly in train)."""
    counts = np.bincount(interactions.user, minlength=interactions.num_users)
    return int(((counts > 0) & (counts < minimum)).sum())


def random_split(interactions: Interactions, seed: int = 42, train_fraction: float = 0.8) -> Split:
    if not 0 < train_fraction < 1:
        raise DataError(f"train_fraction must be in (0, 1), got {train_fraction}")
    order = np.random.default_rng(seed).permutation(len(interactions))
    cut = int(round(train_fraction * len(order)))
    return Split("random", np.sort(order[:cut]), np.zeros(0, dtype=np.int64), np.sort(order[cut:]))


def cutoff_split(interactions: Interactions, cutoff: int) -> Split:
    before = interactions.timestamp < cutoff
    if before.all() or not before.any():
        raise DataError(f"cutoff {cutoff} leaves one side empty (timestamps span "
                        f"{interactions.timestamp.min()}..{interactions.timestamp.max()})")
    return Split("cutoff", np.flatnonzero(before), np.zeros(0, dtype=np.int64),
                 np.flatnonzero(~before))
