"""The data config both stages read, and the arrays both stages train and are evaluated on,
built once from the log.

Items are addressed by catalogue code (`Interactions.item`, 0..num_items-1) everywhere; the model
maps a code to its vocabulary index (items seen in training; others share the OOV row) and its
features. Histories hold vocabulary indexes with 0 as padding.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tworec.features.history import build_history, latest_history
from tworec.features.interactions import DataError, Interactions
from tworec.features.splits import Split
from tworec.features.vocab import PAD, Vocabulary

PROTOCOLS = ("temporal", "random")        # the splits a run evaluates with


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """How the log becomes model inputs: the evaluation protocol and each row's history length
    (the same for both stages)."""

    split: str = "temporal"               # one of PROTOCOLS, see features.splits
    history_length: int = 20              # previous items per row, 0 for none

    def validate(self) -> None:
        """Raises DataError naming the first setting that cannot work."""
        if self.split not in PROTOCOLS:
            raise DataError(f"split {self.split!r}: choose one of {list(PROTOCOLS)}")
        if self.history_length < 0:
            raise DataError(f"history_length must be >= 0, got {self.history_length}")


DATA_PRESETS = {"default": DataConfig(), "tiny": DataConfig(history_length=5)}


@dataclasses.dataclass
class ModelInputs:
    """Vocabularies, feature tables and per-split example arrays.

    Attributes:
        users, items: vocabularies from the training rows.
        item_index: [num_items] vocabulary index of every catalogue item.
        item_genres: [num_items, g] float32 multi-hot (g may be 0). item_year: [num_items] int32.
        user_feature_index: name -> [num_users] int64 indexes into `user_feature_vocabs[name]`.
        examples: part -> {"user": [m], "item": [m] catalogue code, "history": [m, L]}.
        latest: [num_users, L] every user's last L items of the whole log (for serving).
        item_probability: [num_items] float32 share of training interactions (logQ correction).
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
    item_probability: np.ndarray

    @property
    def num_items(self) -> int:
        return self.interactions.num_items

    @property
    def history_length(self) -> int:
        """L, the history slots of every row (at least 1: an empty history is one pad)."""
        return self.latest.shape[1]


def prepare(interactions: Interactions, split: Split, history_length: int) -> ModelInputs:
    """Builds vocabularies from the training rows and the example arrays of every part."""
    users = Vocabulary.from_codes(interactions.user_ids, interactions.user[split.train], "users")
    items = Vocabulary.from_codes(interactions.item_ids, interactions.item[split.train], "items")
    item_index = items.remap(interactions.item_ids)
    user_index = users.remap(interactions.user_ids)
    length = max(history_length, 1)
    history = build_history(interactions, length, item_index=item_index, pad=PAD)
    latest = latest_history(interactions, length, item_index=item_index, pad=PAD)
    feature_vocabs, feature_index = {}, {}
    for name, values in interactions.user_features.items():
        values = np.asarray(values).astype(str)
        vocab = Vocabulary(np.unique(values[values != ""]), name=f"user_{name}")
        feature_vocabs[name], feature_index[name] = vocab, vocab.lookup(values)
    examples = {}
    for part in ("train", "validation", "test"):
        rows = getattr(split, part)
        examples[part] = {"user": user_index[interactions.user[rows]],
                          "item": interactions.item[rows].astype(np.int64),
                          "history": history[rows]}
        for name, index in feature_index.items():
            examples[part][f"user_{name}"] = index[interactions.user[rows]]
    counts = np.bincount(interactions.item[split.train], minlength=interactions.num_items)
    genres = interactions.item_features.get("genres")
    if genres is None:
        genres = np.zeros((interactions.num_items, 0), dtype=np.float32)
    year = interactions.item_features.get("year", np.zeros(interactions.num_items, dtype=np.int32))
    return ModelInputs(
        interactions=interactions, split=split, users=users, items=items, item_index=item_index,
        item_genres=np.asarray(genres, dtype=np.float32), item_year=np.asarray(year, np.int32),
        user_feature_vocabs=feature_vocabs, user_feature_index=feature_index, examples=examples,
        latest=latest, item_probability=(counts / max(counts.sum(), 1)).astype(np.float32))

