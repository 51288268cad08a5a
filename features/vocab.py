"""String-id vocabularies built from training data, with padding and out-of-vocabulary slots.

Index 0 is padding (the empty string), index 1 is out-of-vocabulary, ids start at 2: the same
layout as `tf.keras.layers.StringLookup(vocabulary=ids, mask_token="", num_oov_indices=1)`, so an
exported model maps strings exactly as training did.
"""
from __future__ import annotations

import json
import os

import numpy as np

from tworec.features.interactions import DataError

PAD, OOV, FIRST = 0, 1, 2


class Vocabulary:
    """A list of string ids; `ids[i]` has index `i + 2`."""

    def __init__(self, ids, name: str = "ids"):
        self.ids = np.asarray(ids).astype(str)
        self.name = name
        if len(np.unique(self.ids)) != len(self.ids):
            raise DataError(f"vocabulary {name!r} has repeated ids")
        if (self.ids == "").any():
            raise DataError(f"vocabulary {name!r} contains the empty string, reserved for padding")
        self._order = np.argsort(self.ids)

    @classmethod
    def from_codes(cls, id_table: np.ndarray, codes: np.ndarray, name: str = "ids") -> "Vocabulary":
        """The ids of `id_table` ([d] str) that `codes` ([n] int) use, most frequent first
        (ties by first appearance)."""
        counts = np.bincount(codes, minlength=len(id_table))
        used = np.flatnonzero(counts)
        first = np.full(len(id_table), len(codes))
        np.minimum.at(first, codes[::-1], np.arange(len(codes))[::-1])
        order = used[np.lexsort((first[used], -counts[used]))]
        return cls(id_table[order], name=name)

    def __len__(self) -> int:
        """Number of ids; an embedding table needs `len(vocab) + 2` rows."""
        return len(self.ids)

    @property
    def size(self) -> int:
        """Rows of an embedding table over this vocabulary, padding and OOV included."""
        return len(self.ids) + FIRST

    def lookup(self, strings) -> np.ndarray:
        """[...] str -> [...] int64 indexes; '' is PAD, unknown ids are OOV."""
        strings = np.asarray(strings).astype(str)
        if len(self.ids) == 0:
            return np.where(strings == "", PAD, OOV).astype(np.int64)
        position = np.minimum(np.searchsorted(self.ids[self._order], strings), len(self.ids) - 1)
        found = self.ids[self._order][position] == strings
        index = np.where(found, self._order[position] + FIRST, OOV)
        return np.where(strings == "", PAD, index).astype(np.int64)

    def remap(self, id_table: np.ndarray) -> np.ndarray:
        """[d] int64 index of every id of `id_table`, to translate codes with one gather."""
        return self.lookup(id_table)

    def decode(self, indexes) -> np.ndarray:
        """[...] int -> [...] str; PAD and OOV decode to ''. An index outside the table
        (negative, as `EMPTY_SLOT`, or from `size` on) is a ValueError."""
        indexes = np.asarray(indexes)
        outside = (indexes < 0) | (indexes >= self.size)
        if outside.any():
            raise ValueError(f"{self.name}: index {indexes[outside].flat[0]} is not in the "
                             f"vocabulary's 0 to {self.size - 1}")
        return np.concatenate([["", ""], self.ids])[indexes]

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump({"name": self.name, "ids": self.ids.tolist()}, f)

    @classmethod
    def load(cls, path: str) -> "Vocabulary":
        with open(path) as f:
            data = json.load(f)
        return cls(data["ids"], name=data["name"])
