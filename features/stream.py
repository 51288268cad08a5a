"""Prepared shards as a training stream and as held-out batches, in bounded memory.

`features.prepare.prepare_shards` writes, beside its Parquet shards, the training rows as
TFRecord files of blocks (`train/part-NNNNN.tfrecord`), in an order DuckDB sorts by a hash of
each row's position, so that every file and block is a uniform sample of the training rows
(the window functions leave rows grouped by user). Each record is one block of up to
`block_rows` rows, a `tf.train.Example` whose features `user`, `item` and `history` hold the
columns as raw little-endian int32 bytes ([n], [n], [n * S], S = max(L, 1) history slots).
TFRecord and `tf.io.decode_raw` are stock TensorFlow: every worker of a cluster
(`ParameterServerStrategy`) reads the files itself, from a local disk or a shared file system,
and a block is parsed with one op, never row by row.

`PreparedLog.training_batches` streams them: each pass over the files shuffles their order,
interleaves blocks from several files, shuffles blocks in a bounded buffer (both by seed and
pass), gathers them into windows of `window_rows` rows and hands the windows to
`batches.window_batches`, the same function that cuts an in-memory log (one window per
epoch) into batches; a window's last rows fill a batch with the next one's. The input's memory
is the block buffer and a few windows, whatever the log's size; rows are permuted within a
window, and their order on disk is already random.

The catalogue of a prepared log is its item vocabulary: catalogue code c is vocabulary index
c + FIRST. Items that occur only in held-out rows are out of vocabulary: they cannot be
served, and a held-out row whose item is one of them is a miss.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pyarrow.parquet as pq
import scipy.sparse as sp

from tworec.features.interactions import DataError
from tworec.features.shards import duckdb_session, read_parquet_sql
from tworec.features.vocab import FIRST, OOV

SPLIT_CODES = {"train": 0, "validation": 1, "test": 2}
BLOCK_ROWS = 8192           # rows of one TFRecord block (~0.7 MB at L = 20)
WINDOW_ROWS = 1 << 18       # rows shuffled together
SHUFFLE_BLOCKS = 64         # blocks buffered for shuffling before they form windows
CYCLE_LENGTH = 4            # files read at once
SCORES_BYTES = 64 << 20     # [rows, num_items] float32 scores of one evaluation batch
SEEN_ROWS_PER_PASS = 8 << 20  # known rows read per held-out pass


class BlockWriter:
    """Writes rows to a TFRecord file as blocks of `block_rows` rows (the last one shorter):
    each a serialized `tf.train.Example` of raw little-endian int32 columns."""

    def __init__(self, path: str, block_rows: int = BLOCK_ROWS):
        import tensorflow as tf
        self.path, self.block_rows, self.rows = path, block_rows, 0
        self._writer = tf.io.TFRecordWriter(path)
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def write(self, user: np.ndarray, item: np.ndarray, history: np.ndarray) -> None:
        """Appends [n] user, [n] item and [n, L] history vocabulary indexes."""
        self._pending.append((user, item, history))
        self.rows += len(user)
        if sum(len(part[0]) for part in self._pending) >= self.block_rows:
            self._flush(final=False)

    def close(self) -> None:
        self._flush(final=True)
        self._writer.close()

    def _flush(self, final: bool) -> None:
        import tensorflow as tf
        if not self._pending:
            return
        user, item, history = (np.concatenate(column) for column in zip(*self._pending))
        full = len(user) if final else len(user) // self.block_rows * self.block_rows
        for start in range(0, full, self.block_rows):
            block = slice(start, min(start + self.block_rows, full))
            feature = {name: tf.train.Feature(bytes_list=tf.train.BytesList(
                value=[np.ascontiguousarray(values[block], "<i4").tobytes()]))
                for name, values in (("user", user), ("item", item), ("history", history))}
            self._writer.write(tf.train.Example(
                features=tf.train.Features(feature=feature)).SerializeToString())
        self._pending = [(user[full:], item[full:], history[full:])] if full < len(user) else []


def parse_block(record, history_length: int) -> dict:
    """One serialized block -> {"user": [n] int32, "item": [n] int64 catalogue code,
    "history": [n, L] int32}."""
    import tensorflow as tf
    spec = {name: tf.io.FixedLenFeature([], tf.string) for name in ("user", "item", "history")}
    raw = tf.io.parse_single_example(record, spec)
    column = {name: tf.io.decode_raw(value, tf.int32, little_endian=True)
              for name, value in raw.items()}
    return {"user": column["user"], "item": tf.cast(column["item"] - FIRST, tf.int64),
            "history": tf.reshape(column["history"], [-1, history_length])}


@dataclasses.dataclass(frozen=True)
class PreparedLog:
    """A folder written by `prepare_shards`, what a model needs of it, and its streams.

    Attributes:
        folder: the prepared folder. manifest: its `manifest.json`.
        num_users: rows of the user vocabulary (padding and OOV included).
        item_counts: [num_items] int64 training rows of every catalogue item.
        train_files: the TFRecord files of the training rows.
    """

    folder: str
    manifest: dict
    num_users: int
    item_counts: np.ndarray
    train_files: tuple[str, ...]

    @classmethod
    def load(cls, folder: str) -> "PreparedLog":
        path = os.path.join(folder, "manifest.json")
        if not os.path.isfile(path):
            raise DataError(f"{folder}: no manifest.json; pass a folder written by "
                            "prepare_shards (python -m tworec.features.prepare)")
        with open(path) as f:
            manifest = json.load(f)
        if "train_blocks" not in manifest:
            raise DataError(f"{folder}: prepared without training blocks (an older version); "
                            "prepare it again into a new folder")
        counts = pq.read_table(os.path.join(folder, "items.parquet"),
                               columns=["count"]).column("count").to_numpy()
        return cls(folder=os.path.abspath(folder), manifest=manifest,
                   num_users=manifest["vocabulary"]["users"] + FIRST, item_counts=counts,
                   train_files=tuple(os.path.join(folder, block["path"])
                                     for block in manifest["train_blocks"]))

    @property
    def num_items(self) -> int:
        return len(self.item_counts)

    @property
    def item_probability(self) -> np.ndarray:
        """[num_items] float32 share of training rows (logQ correction)."""
        return (self.item_counts / max(self.item_counts.sum(), 1)).astype(np.float32)

    @property
    def history_length(self) -> int:
        """L, the previous items a history holds (0: none)."""
        return self.manifest["history_length"]

    @property
    def history_slots(self) -> int:
        """The slots of every row's history: max(L, 1), an empty history one PAD slot (a
        folder prepared before the two were told apart recorded the slots as its L)."""
        return self.manifest.get("history_slots", self.manifest["history_length"])

    @property
    def train_rows(self) -> int:
        return self.manifest["split"]["train"]

    def item_ids(self) -> np.ndarray:
        """[num_items] str, the id of every catalogue code."""
        return pq.read_table(os.path.join(self.folder, "items.parquet"), columns=["id"]
                             ).column("id").to_numpy(zero_copy_only=False).astype(str)

    def item_index(self) -> np.ndarray:
        """[num_items] vocabulary index of every catalogue code."""
        return np.arange(self.num_items) + FIRST

    def training_batches(self, batch_size: int, seed=0, window_rows: int = WINDOW_ROWS,
                         shuffle_blocks: int = SHUFFLE_BLOCKS, cycle_length: int = CYCLE_LENGTH):
        """An endless dataset of shuffled {"user", "item", "history"} batches of the training
        rows (module docstring); every batch holds `batch_size` rows.

        Each pass reads every file once; its blocks form windows of at least `window_rows`
        rows (and of 4 batches), so no window holds a row twice, and a window's last rows
        fill a batch with the next window's first: a pass trains every row once. The file
        order, the block buffer's order and each window's rows are permuted by (`seed`, pass),
        so passes differ, and so do the workers of a cluster: `seed` may be a tensor (a
        worker's `training.worker_seed()`)."""
        import tensorflow as tf
        from tworec.features.batches import window_batches
        block_rows = self.manifest["block_rows"]
        window_blocks = -(-max(window_rows, 4 * batch_size) // block_rows)
        files = tf.constant(self.train_files)
        seed = tf.cast(seed, tf.int64)
        length = self.history_slots

        def epoch_windows(epoch: tf.Tensor) -> tf.data.Dataset:
            order = tf.random.experimental.stateless_shuffle(
                tf.range(tf.size(files)), seed=tf.stack([seed, -1 - epoch]))
            block_seed = tf.random.stateless_uniform(                  # [] int64
                [], seed=tf.stack([-1 - epoch, seed]), minval=0, maxval=2**62, dtype=tf.int64)
            # This function's graph seed, not the global one: a tensor op seed under a global
            # seed of 0 fails (`random_seed.get_seed` compares it in Python), and the block
            # order then depends on (seed, pass) alone.
            tf.compat.v1.set_random_seed(1)
            blocks = tf.data.Dataset.from_tensor_slices(tf.gather(files, order)).interleave(
                tf.data.TFRecordDataset, cycle_length=min(cycle_length, len(self.train_files)),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            blocks = blocks.map(lambda record: parse_block(record, length),
                                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            return blocks.shuffle(shuffle_blocks, seed=block_seed).ragged_batch(
                window_blocks).map(lambda window: {name: values.values
                                                   for name, values in window.items()})

        windows = tf.data.Dataset.counter().flat_map(epoch_windows)
        numbered = tf.data.Dataset.zip((tf.data.Dataset.counter(), windows))
        return window_batches(numbered, batch_size, shuffle=True, seed=seed).rebatch(
            batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    def _shards_sql(self) -> str:
        """DuckDB's scan of the prepared shards."""
        return read_parquet_sql([os.path.join(self.folder, shard["path"])
                                 for shard in self.manifest["shards"]])

    def _previous_sql(self) -> str | None:
        """SQL for a shard row's previous item index (`prepare_shards`' `previous` column, 0
        for none). A folder prepared before shards held it has it as its last history slot,
        unless it was prepared without history (L = 0, or an L of 1 recorded before the slots
        were told apart from it): None."""
        first = os.path.join(self.folder, self.manifest["shards"][0]["path"])
        if "previous" in pq.read_schema(first).names:
            return "previous"
        if self.history_length >= (1 if "history_slots" in self.manifest else 2):
            return f"history[{self.history_slots}]"
        return None

    @property
    def knows_previous_items(self) -> bool:
        """Whether the shards tell each row's previous item (all but those an earlier version
        prepared without history), which the item-transition baseline reads."""
        return self._previous_sql() is not None

    def transition_counts(self, memory_limit: str = "1GB") -> sp.csr_matrix:
        """[num_items, num_items] float32 CSR: how often catalogue item j directly followed
        item i in a user's training rows (`features.history.transition_counts` of the training
        rows), counted by DuckDB over the shards: a training row's `previous` item is its
        user's previous training row. The counts themselves are held, as in memory: 8 bytes
        per distinct pair (about 20 while read), read sorted and laid out as CSR without a
        copy in between."""
        previous = self._previous_sql()
        if previous is None:
            raise DataError(f"{self.folder}: prepared by an earlier version without history, so "
                            "its shards do not hold each row's previous item; prepare the log "
                            "again into a new folder")
        with duckdb_session(self.folder, memory_limit) as connection:
            pairs = connection.sql(
                f"SELECT {previous} - {FIRST} AS previous, "
                f"item - {FIRST} AS next, COUNT(*) AS n FROM {self._shards_sql()} "
                f"WHERE split = 0 AND {previous} >= {FIRST} "
                "GROUP BY ALL ORDER BY previous, next").to_arrow_table()
        per_row = np.bincount(pairs.column("previous").to_numpy(), minlength=self.num_items)
        return sp.csr_matrix((pairs.column("n").to_numpy().astype(np.float32),
                              pairs.column("next").to_numpy(),
                              np.concatenate([[0], np.cumsum(per_row)])),
                             shape=(self.num_items, self.num_items))

    def heldout_batches(self, part: str = "test", batch_rows: int = 1024,
                        memory_limit: str = "1GB", rows_per_pass: int = SEEN_ROWS_PER_PASS):
        """The held-out rows of `part` in batches, each with what the model knew of its user.

        Rows are read in passes over disjoint sets of users (`user % passes`, about
        `rows_per_pass` rows each) by DuckDB from the Parquet shards: a pass holds its held-out
        rows and their users' known items (of training rows for validation, training and
        validation rows for test; each (user, item) once, so that a user of millions of rows
        costs their distinct items), never the whole log. Each pass scans the shards' user,
        item and split columns once.

        Yields:
            dicts of "user" [b] int32 and "history" [b, L] int32 (the query features),
            "previous" [b] int32 the vocabulary index of the user's row before (0 for none,
            or unknown in a folder an earlier version prepared without history),
            "target" [b] int64 catalogue code (-1 when the item is not in the catalogue, a
            miss), "known" [b] bool (the user is in the vocabulary) and "excluded", a
            [b, num_items] CSR of the user's known items.
        """
        if part not in ("validation", "test"):
            raise DataError(f"unknown evaluation part {part!r}; use 'test' or 'validation'")
        code = SPLIT_CODES[part]
        passes = max(1, -(-self.manifest["rows"] // rows_per_pass))
        length, previous = self.history_slots, self._previous_sql() or "0"    # 0: unknown
        with duckdb_session(self.folder, memory_limit) as connection:
            for number in range(passes):
                where = f"FROM {self._shards_sql()} WHERE user % {passes} = {number}"
                held = connection.sql(f"SELECT user, item, history, {previous} AS previous "
                                      f"{where} AND split = {code} ORDER BY row").to_arrow_table()
                if not len(held):
                    continue
                seen = connection.sql(f"SELECT DISTINCT user, item {where} "   # a heavy
                                      f"AND split < {code} AND item >= {FIRST}"  # user's
                                      ).to_arrow_table()                    # items, not rows
                users = held.column("user").to_numpy()
                excluded = self._seen_matrix(users, seen.column("user").to_numpy(),
                                             seen.column("item").to_numpy() - FIRST)
                history = held.column("history").combine_chunks().flatten()
                history = history.to_numpy().reshape(len(held), length)
                items = held.column("item").to_numpy().astype(np.int64)
                last = held.column("previous").to_numpy()
                for start in range(0, len(held), batch_rows):
                    rows = slice(start, start + batch_rows)
                    yield {"user": users[rows], "history": history[rows], "previous": last[rows],
                           "target": np.where(items[rows] >= FIRST, items[rows] - FIRST, -1),
                           "known": users[rows] != OOV, "excluded": excluded[rows]}

    def _seen_matrix(self, users: np.ndarray, seen_users: np.ndarray,
                     seen_items: np.ndarray) -> sp.csr_matrix:
        """[len(users), num_items] CSR 0/1: row r holds the items of (seen_users, seen_items)
        pairs whose user is users[r]."""
        unique, inverse = np.unique(users, return_inverse=True)                 # users: [m] > 0
        position = np.minimum(np.searchsorted(unique, seen_users), len(unique) - 1)
        mine = unique[position] == seen_users
        matrix = sp.csr_matrix((np.ones(int(mine.sum()), np.float32),
                                (position[mine], seen_items[mine])),
                               shape=(len(unique), self.num_items))
        matrix.sum_duplicates()
        matrix.data[:] = 1
        return matrix[inverse]
