"""The data config both stages read, and the arrays both stages train and are evaluated on,
built once from the log.

Items are addressed by catalogue code (`Interactions.item`, 0..num_items-1) everywhere; the model
maps a code to its vocabulary index (items seen in training; others share the OOV row) and its
features. Histories hold vocabulary indexes with 0 as padding.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import scipy.sparse as sp

from tworec.features.history import build_history, latest_history
from tworec.features.interactions import DataError, Interactions, interaction_matrix
from tworec.features.splits import Split, global_quantile
from tworec.features.vocab import FIRST, PAD, Vocabulary

PROTOCOLS = ("temporal", "random", "global[:Q]", "latest", "none")   # the splits a run can use
EMPTY_SLOT = -1          # the code of a candidate slot left empty (fewer unseen items than k)
MODEL_ITEM_FEATURES = ("genres", "year")   # the item features `prepare` gives the models


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """How the log becomes model inputs: the evaluation protocol and each row's history length
    (the same for both stages)."""

    split: str = "temporal"               # one of PROTOCOLS, see features.splits
    history_length: int = 20              # previous items per row, 0 for none
    exclude_seen: bool = True             # never serve (nor rank) a user's known items; off
                                          # for catalogues where repeats are wanted
    cold_start_window: float | None = None  # users never seen get the items most frequent in
                                          # this latest share of the known rows; None: chosen
                                          # on validation among COLD_START_WINDOWS

    def validate(self) -> None:
        """Raises DataError naming the first setting that cannot work."""
        if self.split.startswith("global"):
            global_quantile(self.split)
        elif self.split not in PROTOCOLS:
            raise DataError(f"split {self.split!r}: choose one of {list(PROTOCOLS)}")
        if self.history_length < 0:
            raise DataError(f"history_length must be >= 0, got {self.history_length}")
        window = self.cold_start_window
        if window is not None and (isinstance(window, bool) or
                                   not (isinstance(window, (int, float)) and 0 < window <= 1)):
            raise DataError(f"--cold-start-window (cold_start_window) must be in (0, 1] (1: all "
                            f"known rows; leave it out to choose on validation), got {window!r}")


DATA_PRESETS = {"default": DataConfig(), "tiny": DataConfig(history_length=5)}
COLD_START_WINDOWS = (1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01)


@dataclasses.dataclass(frozen=True)
class PopularItems:
    """What every model serves a user that a part's known rows do not hold (never seen): the
    catalogue by its count among the latest `window` share of those rows, ties to its count
    among all of them, then to the lower code.

    Attributes:
        window: the share of the known rows, latest first, that is counted (1: all).
        order: [num_items] int64 catalogue codes, best first (the served order); the items
            without a known row come last, past `size`.
        share: [num_items] float32 each item's share of the counted rows (the served score).
        size: the items with known rows (the part's catalogue): only `order[:size]` is served.
    """

    window: float
    order: np.ndarray
    share: np.ndarray
    size: int


def popular_items(interactions: Interactions, rows: np.ndarray, window: float) -> PopularItems:
    """`PopularItems` of the known `rows` (positions into `interactions`): the latest
    `window` share of them in time order (ties in log order; at least one row) is counted."""
    rows = np.sort(rows)
    latest = rows[np.argsort(interactions.timestamp[rows], kind="stable")]
    latest = latest[len(latest) - max(1, round(window * len(latest))):] if len(rows) else rows
    num_items = interactions.num_items
    recent = np.bincount(interactions.item[latest], minlength=num_items)
    overall = np.bincount(interactions.item[rows], minlength=num_items)
    order = np.lexsort((np.arange(num_items), -overall, -recent))
    return PopularItems(window, order, (recent / max(len(latest), 1)).astype(np.float32),
                        int((overall > 0).sum()))


@dataclasses.dataclass
class ModelInputs:
    """Vocabularies, feature tables, per-split example arrays and the users' state.

    Histories only ever hold rows a model may know: a training row's history is the user's
    earlier training rows; a held-out row's history is the user's state as of the rows known
    before its part (training rows for validation, training and validation rows for test),
    the state an export serves.

    Attributes:
        users, items: vocabularies from the training rows.
        item_index: [num_items] vocabulary index of every catalogue item.
        item_genres: [num_items, g] float32 multi-hot (g may be 0). item_year: [num_items] int32.
        user_feature_index: name -> [num_users] int64 indexes into `user_feature_vocabs[name]`
            of every user's feature as known after the fit rows (what an export serves; the
            training and validation examples read it as known after the training rows).
        examples: part -> {"user": [m], "item": [m] catalogue code, "history": [m, S]}.
        latest: [num_users, S] every user's last L items of the fit rows (what an export serves).
            S = max(L, 1) slots: with L = 0 the one slot is padding everywhere (no history).
        seen: [num_users, num_items] CSR 0/1 of every user's items in the fit rows.
        known: [num_users] bool, users with fit rows (an export serves others the popular items).
        item_probability: [num_items] float32 share of training interactions (logQ correction).
        popular: part ("validation", "test") -> what users its known rows do not hold are
            served (`PopularItems`); the test part's is the exports'.
        history_length: L, the previous items a history holds (0: none).
        exclude_seen: whether a user's known items are never served nor ranked.
    """

    interactions: Interactions
    split: Split
    users: Vocabulary
    items: Vocabulary
    item_index: np.ndarray
    item_genres: np.ndarray
    item_year: np.ndarray
    user_feature_vocabs: dict[str, Vocabulary]
    user_feature_index: dict[str, np.ndarray]
    examples: dict[str, dict[str, np.ndarray]]
    latest: np.ndarray
    seen: sp.csr_matrix
    known: np.ndarray
    item_probability: np.ndarray
    popular: dict[str, PopularItems]
    history_length: int
    exclude_seen: bool = True

    @property
    def num_items(self) -> int:
        return self.interactions.num_items

    def latest_examples(self, users: np.ndarray) -> dict[str, np.ndarray]:
        """The model inputs of `users` [u] (codes) in their latest state, what an export reads
        for them: "user" [u], "history" [u, S] and "user_NAME" [u] (a test row's, but "item")."""
        examples = {"user": self.users.remap(self.interactions.user_ids)[users],
                    "history": self.latest[users]}
        examples.update({f"user_{name}": index[users]
                         for name, index in self.user_feature_index.items()})
        return examples

    def known_in(self, part: str) -> np.ndarray:
        """[m] bool per row of `part`: whether its user has rows known before the part (all
        training rows do); the others are served as users the models do not know."""
        users = self.interactions.user[getattr(self.split, part)]
        if part == "train":
            return np.ones(len(users), bool)
        before = self.split.train if part == "validation" else self.split.fit
        return (np.bincount(self.interactions.user[before],
                            minlength=self.interactions.num_users) > 0)[users]

    @property
    def catalogue(self) -> np.ndarray:
        """[num_items] bool: the items an export serves and a test row is ranked among, those
        with fit rows. Any other item (of the item table alone, or first seen in held-out rows)
        is never served: a held-out row of one is a miss (`evaluation.EvalSet.catalogue`)."""
        return self.interactions.items_of(self.split.fit)

    @property
    def untrained_items(self) -> int:
        """Catalogue items without training rows (only validation rows), which the models
        score by their features and the untrained out-of-vocabulary id."""
        return int((self.catalogue & (self.item_index < FIRST)).sum())

    def state(self) -> dict:
        """What an export knows: the fit rows, their users and items, the last timestamp."""
        fit = self.split.fit
        return {"rows": int(len(fit)), "users": int(self.known.sum()),
                "items": int((np.asarray(self.seen.sum(0)).ravel() > 0).sum()),
                "last_timestamp": int(self.interactions.timestamp[fit].max()) if len(fit) else None}


def prepare(interactions: Interactions, split: Split, history_length: int,
            exclude_seen: bool = True, cold_start_window: float = 1.0) -> ModelInputs:
    """Builds vocabularies from the training rows and the example arrays of every part; users
    never seen are served the items most frequent in the latest `cold_start_window` share of
    the rows known before a part (`popular_items`)."""
    users = Vocabulary.from_codes(interactions.user_ids, interactions.user[split.train], "users")
    items = Vocabulary.from_codes(interactions.item_ids, interactions.item[split.train], "items")
    item_index = items.remap(interactions.item_ids)
    user_index = users.remap(interactions.user_ids)

    def state_of(rows: np.ndarray) -> np.ndarray:
        """[num_users, S] every user's last L items among `rows`."""
        return at_least_one_slot(latest_history(interactions.take(rows), history_length,
                                                item_index=item_index, pad=PAD))

    histories = {"train": at_least_one_slot(build_history(
        interactions.take(split.train), history_length, item_index=item_index, pad=PAD))}
    latest = state_of(split.fit)
    for part, state in (("validation", state_of(split.train)), ("test", latest)):
        histories[part] = state[interactions.user[getattr(split, part)]]
    feature_vocabs, feature_index, trained_index = {}, {}, {}
    trained_users = np.unique(interactions.user[split.train])
    for name in interactions.user_features:        # as known after the rows each part follows
        trained_values = interactions.user_feature_at(name, split.train)
        seen_values = trained_values[trained_users]    # nothing held out reaches a vocabulary
        vocab = Vocabulary(np.unique(seen_values[seen_values != ""]), name=f"user_{name}")
        feature_vocabs[name], trained_index[name] = vocab, vocab.lookup(trained_values)
        feature_index[name] = vocab.lookup(interactions.user_feature_at(name, split.fit))
    examples = {}
    for part in ("train", "validation", "test"):
        rows = getattr(split, part)
        examples[part] = {"user": user_index[interactions.user[rows]],
                          "item": interactions.item[rows].astype(np.int64),
                          "history": histories[part]}
        for name, index in (feature_index if part == "test" else trained_index).items():
            examples[part][f"user_{name}"] = index[interactions.user[rows]]
    counts = np.bincount(interactions.item[split.train], minlength=interactions.num_items)
    genres, year = (interactions.item_features.get(name) for name in MODEL_ITEM_FEATURES)
    if genres is None:
        genres = np.zeros((interactions.num_items, 0), dtype=np.float32)
    if year is None:
        year = np.zeros(interactions.num_items, dtype=np.int32)
    return ModelInputs(
        interactions=interactions, split=split, users=users, items=items, item_index=item_index,
        item_genres=np.asarray(genres, dtype=np.float32), item_year=np.asarray(year, np.int32),
        user_feature_vocabs=feature_vocabs, user_feature_index=feature_index, examples=examples,
        latest=latest, seen=interaction_matrix(interactions, split.fit),
        known=np.bincount(interactions.user[split.fit], minlength=interactions.num_users) > 0,
        item_probability=(counts / max(counts.sum(), 1)).astype(np.float32),
        popular={part: popular_items(interactions, rows, cold_start_window)
                 for part, rows in (("validation", split.train), ("test", split.fit))},
        history_length=history_length, exclude_seen=exclude_seen)


def at_least_one_slot(history: np.ndarray) -> np.ndarray:
    """[n, L] histories -> [n, max(L, 1)]: the models read at least one slot, so an empty
    history (L = 0) becomes one PAD slot, which every model and signal reads as no history."""
    return history if history.shape[1] else np.full((len(history), 1), PAD, history.dtype)
