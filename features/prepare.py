"""Out-of-core preparation of a Parquet log into training-ready shards, computed by DuckDB.

`prepare_shards` reads a log given as Parquet shards (a folder, a glob or one file, resolved
as `features.shards` resolves them) and computes, in SQL under a memory limit with spilling to
a temporary folder, what the in-memory path (`splits.temporal_split` then `inputs.prepare`)
computes with NumPy:

- the temporal split: per user, rows in time order with ties in log order; the last row is
  test, the one before validation, the rest train; users with fewer than 3 rows wholly train;
- the vocabularies of the training rows as `Vocabulary.from_codes` lays them out: index 0
  padding, 1 OOV, ids from 2 most frequent first, ties by first appearance in the log;
- each row's history: the vocabulary indexes of its user's previous `history_length` items,
  oldest first, left-padded with 0 (for the temporal split this is what `inputs.prepare`
  gives every part: a training row's earlier training rows, a held-out row's state as of the
  rows before it);
- the per-item training counts (popularity, logQ).

The query's shape (`f` the file's position among the shards, `r` the row's in its file):

    WITH raw   AS (SELECT user u, item i, time t (whole seconds), time f (full precision),
                          rating, offset[f] + r AS row FROM read_parquet(files)),
         log   AS (SELECT * FROM raw WHERE i IN items.parquet   -- duplicates dropped, first kept
                   QUALIFY ROW_NUMBER() OVER (PARTITION BY u, i, f, rating ORDER BY row) = 1)
    placed:        a user's rows of one second trade rows so that they come in f order
                   (`NTH_VALUE(row, rank by f) OVER (PARTITION BY u, t ORDER BY row)`)
    labelled:      SELECT *, ROW_NUMBER() OVER (PARTITION BY u ORDER BY t, row) AS k,
                             COUNT(*) OVER (PARTITION BY u) AS n FROM log
                   split = 0 if n < 3 or k <= n - 2, 1 if k = n - 1, else 2
    items/users:   SELECT i, COUNT(*) c, MIN(row) first FROM labelled WHERE split = 0
                   GROUP BY i; index = 1 + ROW_NUMBER() OVER (ORDER BY c DESC, first)
    shards:        SELECT row, user index, item index, [LAG(item index, L, 0) OVER w, ...,
                   LAG(item index, 1, 0) OVER w] AS history,
                   LAG(item index, 1, 0) OVER w AS previous, t, rating, split
                   FROM labelled LEFT JOIN users LEFT JOIN items  -- unknown: OOV
                   WINDOW w AS (PARTITION BY u ORDER BY t, row)

Only window functions, GROUP BY and joins: the same query runs unchanged in spirit on Spark
SQL or BigQuery for a cluster-sized log (`LAG`, `ROW_NUMBER`, `QUALIFY`/a filtered subquery,
an array constructor for the history), writing the same shards.

Written to `out_folder`: `shards/part-NNNNN.parquet` (columns `row` int64, the row's position
in the log; `user`, `item` int32 vocabulary indexes; `history` fixed-size list<int32>[max(L, 1)];
`previous` int32, the item index of the user's row before (0 for none), whatever L, for the
item-transition baseline; `timestamp` int64; `rating` float32, NaN without ratings; `split`
int8: 0 train, 1 validation, 2 test); the training rows again as `train/part-NNNNN.tfrecord`,
blocks that TensorFlow streams (`features.stream`); `users.parquet` and `items.parquet`
(`index` int32, `id` string, `count` int64 training rows, ordered by index) and
`manifest.json` with the counts, the rows dropped by reason among them.

Before any of it, the values `load` refuses (missing or empty ids, missing times and ratings,
an item table without the log's item column or with an item twice, an empty result) stop it
with a one-line DataError, as `shards.describe` does.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq

from tworec.features.interactions import DataError
from tworec.features.shards import (GLOB_CHARACTERS, ITEM_TABLE, dropped_counts,
                                    duckdb_session, item_table_ids, parquet_log,
                                    read_parquet_sql, whole_seconds)
from tworec.features.sources import INDEX_COLUMN, unread_columns_note
from tworec.features.stream import BLOCK_ROWS, SPLIT_CODES, BlockWriter
from tworec.features.vocab import FIRST, OOV, PAD

ROWS_PER_SHARD = 1 << 22
ROW_GROUP_ROWS = 1 << 17
HISTORY_MAX = 1000          # history slots: the SQL takes one LAG a slot (20,000 ran minutes)


def prepare_shards(source: str, out_folder: str, history_length: int = 20,
                   memory_limit: str = "1GB", columns: dict[str, str] | None = None,
                   rows_per_shard: int = ROWS_PER_SHARD, block_rows: int = BLOCK_ROWS,
                   seed: int = 0, progress=None, note=None) -> dict:
    """Prepares a Parquet log out of core into training-ready shards (see the module docstring).

    Args:
        source: a folder or glob of Parquet shards, or one `.parquet` file.
        out_folder: a new or empty folder for the shards, vocabularies and manifest.
        history_length: L, previous items per row, at most HISTORY_MAX; 0 gives every row one
            PAD slot, as `inputs.prepare` does (the models read at least one slot).
        memory_limit: DuckDB's memory limit, e.g. '1GB' or '500MiB'.
        columns: role -> column name, as for `shards.load`.
        rows_per_shard: rows of one output shard (written in row groups of ROW_GROUP_ROWS).
        block_rows: training rows of one TFRecord block.
        seed: seeds the order of the training rows in the TFRecord files.
        progress: called with (path, rows) as each shard is complete.
        note: called with one line once the log is checked, before the work, when `columns`
            names side features or the item table has feature columns: the shards will not
            hold them.

    Returns:
        The manifest also written as `manifest.json`: rows, the rows dropped by reason (as
        `load` counts them), users, items, rows per split, short users, the shards, DuckDB's
        memory limit as its connection reports it, and `not_read`: the side features
        `columns` names (`user.NAME`, `item.NAME`) and the item table's feature columns
        ("items.parquet's NAME"), which the prepared shards do not hold.
    """
    _check_sizes(history_length=history_length, rows_per_shard=rows_per_shard,
                 block_rows=block_rows)
    _check_out_folder(source, out_folder)
    parquet = parquet_log(source, columns, item_table_ids)
    mapping, schema, shard_rows = parquet.mapping, parquet.schema, parquet.shard_rows
    catalogue, log, known = parquet.catalogue, parquet.log, parquet.known
    length = max(history_length, 1)
    started = time.perf_counter()
    with _left_as_it_was_on_failure(out_folder), \
            duckdb_session(source, memory_limit, "prepare.duckdb") as connection:
        parquet.check(connection, source, catalogue)
        not_read = sorted(role for role in mapping if "." in role) + [
            f"{ITEM_TABLE}'s {name}" for name in ([] if parquet.shards.items is None else
                                                    pq.read_schema(parquet.shards.items).names)
            if name != mapping["item"] and not INDEX_COLUMN.fullmatch(name)]
        if mapping.unread and note:
            note(unread_columns_note(mapping.unread, mapping.rating_open))
        if not_read and note:
            note(f"{', '.join(not_read)} not in the prepared shards, which hold ids, histories, "
                 "times and ratings: models trained on them read no side features")
        for folder in ("shards", "train"):
            os.makedirs(os.path.join(out_folder, folder), exist_ok=True)
        setting = connection.execute("SELECT current_setting('memory_limit')").fetchone()[0]
        connection.execute(_labelled_sql(log, known, whole_seconds(schema.field(mapping["time"]))))
        unknown = 0 if catalogue is None else connection.execute(
            f"SELECT COUNT(*) FROM (SELECT DISTINCT u, i, f, r FROM ({log}) "
            f"WHERE NOT ({known}))").fetchone()[0]
        for table, column in (("users", "u"), ("items", "i")):
            connection.execute(_vocabulary_sql(table, column))
            _write_vocabulary(connection, table, os.path.join(out_folder, f"{table}.parquet"))
        paths = _write_shards(connection.sql(_shards_sql(history_length)).to_arrow_reader(
            ROW_GROUP_ROWS), out_folder, length, rows_per_shard, progress)
        blocks = _write_training_blocks(connection, [path for path, _ in paths],
                                        os.path.join(out_folder, "train"), length,
                                        rows_per_shard, block_rows, seed, progress)
        counts = dict(connection.execute(
            "SELECT split, COUNT(*) FROM labelled GROUP BY split").fetchall())
        rows, users, short = connection.execute(
            "SELECT COUNT(*), COUNT(DISTINCT u), COUNT(DISTINCT u) FILTER (WHERE n < 3) "
            "FROM labelled").fetchone()
        vocabulary = {table: connection.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                      for table in ("users", "items")}
        seconds = time.perf_counter() - started
        manifest = {"source": source, "rows": rows,
                    "dropped": dropped_counts(sum(shard_rows), rows + unknown, rows),
                    "users": users,
                    "vocabulary": {"users": vocabulary["users"], "items": vocabulary["items"],
                                   "padding": 0, "oov": OOV, "first": FIRST},
                    "split": {part: int(counts.get(code, 0))
                              for part, code in SPLIT_CODES.items()},
                    "short_users": short, "history_length": history_length, "history_slots": length,
                    "shards": [{"path": os.path.relpath(path, out_folder), "rows": count}
                               for path, count in paths],
                    "block_rows": block_rows,
                    "train_blocks": [{"path": os.path.relpath(path, out_folder), "rows": count}
                                     for path, count in blocks],
                    "seconds": round(seconds, 3),
                    "rows_per_second": round(rows / max(seconds, 1e-9)),
                    "duckdb": {"memory_limit": setting},
                    "not_read": not_read}
        with open(os.path.join(out_folder, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
    return manifest


def _check_sizes(**sizes: int) -> None:
    """A ValueError naming the first of `sizes` (history_length from 0 to HISTORY_MAX, the
    others from 1) out of its range: a shard of 0 rows was written again and again."""
    for name, value in sizes.items():
        low, high = (0, HISTORY_MAX) if name == "history_length" else (1, None)
        if value < low or high is not None and value > high:
            raise ValueError(f"{name} must be from {low}" + (f" to {high:,}" if high else " up")
                             + f", got {value!r}")


def _check_out_folder(source: str, out_folder: str) -> None:
    """A one-line DataError, before any work, unless `out_folder` is a new or empty folder
    that can be made (no file on its path, its nearest existing folder writable) outside the
    folder the log `source` is read from (a folder, or a glob's folders before its first
    wildcard when one reaches into folders): the prepared shards would be read with it."""
    if os.path.exists(out_folder) and not os.path.isdir(out_folder):
        raise DataError(f"{out_folder}: a file, not a folder; pass a new or empty folder")
    if os.path.isdir(out_folder) and os.listdir(out_folder):
        raise DataError(f"{out_folder}: not empty; pass a new or empty folder")
    existing = os.path.abspath(out_folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        problem = "a file, not a folder" if not os.path.isdir(existing) else "not writable"
        raise DataError(f"{out_folder}: cannot be made: {existing} is {problem}; pass a new or "
                        "empty folder in a folder you can write")
    parts = pathlib.PurePath(os.path.abspath(source)).parts
    wild = next((k for k, part in enumerate(parts) if any(c in part for c in GLOB_CHARACTERS)),
                None)
    read = os.path.abspath(source) if os.path.isdir(source) else None
    if read is None and wild is not None and wild < len(parts) - 1:     # wildcard folders
        read = os.path.join(*parts[:wild])
    inside = read is not None and os.path.commonpath(
        [os.path.realpath(out_folder), os.path.realpath(read)]) == os.path.realpath(read)
    hidden = inside and any(part.startswith(("_", ".")) for part in pathlib.PurePath(
        os.path.relpath(os.path.realpath(out_folder), os.path.realpath(read))).parts)
    if inside and not hidden:                    # a `_` or `.` folder is never read as shards
        raise DataError(f"--out {out_folder}: inside the log's folder {read}, where the "
                        "prepared shards would be read as the log's; pass a folder outside it")


@contextlib.contextmanager
def _left_as_it_was_on_failure(folder: str):
    """Removes what the block wrote into `folder` (new, or empty before) when it fails, so
    that the same command can run again."""
    existed = os.path.isdir(folder)
    try:
        yield
    except BaseException:
        if not existed:
            shutil.rmtree(folder, ignore_errors=True)
        elif os.path.isdir(folder):
            for entry in os.listdir(folder):
                path = os.path.join(folder, entry)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        raise


def _labelled_sql(log: str, known: str, whole_seconds: bool) -> str:
    """The log without duplicate rows and rows of items not in the item table (`known`), each
    row with its position, rank in its user's time order (k, from 1), its user's row count (n)
    and split label, as a table. Unless the time is in whole seconds, a user's rows of one
    second first trade positions so that they come in their full-precision order, as
    `sources.from_columns` places them."""
    placed = "log" if whole_seconds else "placed"
    placing = "" if whole_seconds else """,
        ranked AS (
            SELECT *, ROW_NUMBER() OVER (PARTITION BY u, t ORDER BY f, row) AS place FROM log),
        placed AS (
            SELECT * EXCLUDE (row, place),
                   NTH_VALUE(row, place) OVER (PARTITION BY u, t ORDER BY row ROWS BETWEEN
                       UNBOUNDED PRECEDING AND UNBOUNDED FOLLOWING) AS row
            FROM ranked)"""
    return f"""
        CREATE TABLE labelled AS
        WITH log AS (
            SELECT * FROM ({log}) WHERE {known}
            QUALIFY ROW_NUMBER() OVER (PARTITION BY u, i, f, r ORDER BY row) = 1){placing},
        ordered AS (
            SELECT * EXCLUDE (f), ROW_NUMBER() OVER (PARTITION BY u ORDER BY t, row) AS k,
                      COUNT(*) OVER (PARTITION BY u) AS n
            FROM {placed})
        SELECT *, CAST(CASE WHEN n < 3 OR k <= n - 2 THEN 0 WHEN k = n - 1 THEN 1 ELSE 2 END
                       AS TINYINT) AS split
        FROM ordered"""


def _vocabulary_sql(table: str, column: str) -> str:
    """A vocabulary of the training rows: most frequent first, ties by first appearance."""
    return f"""
        CREATE TABLE {table} AS
        SELECT CAST({FIRST - 1} + ROW_NUMBER() OVER (ORDER BY count DESC, first) AS INTEGER)
                   AS index, id, count
        FROM (SELECT {column} AS id, COUNT(*) AS count, MIN(row) AS first
              FROM labelled WHERE split = 0 GROUP BY {column})"""


def _shards_sql(history_length: int) -> str:
    """The rows of the shards: codes, history of the previous `history_length` item indexes
    (one PAD slot for 0), and the previous item index whatever the length."""
    lags = ", ".join(f"LAG(item, {back}, {PAD}) OVER w"
                     for back in range(history_length, 0, -1)) or str(PAD)
    return f"""
        WITH coded AS (
            SELECT l.row, l.u, l.t, l.r, l.split,
                   COALESCE(users.index, {OOV}) AS user, COALESCE(items.index, {OOV}) AS item
            FROM labelled l LEFT JOIN users ON l.u = users.id LEFT JOIN items ON l.i = items.id)
        SELECT row, user, item, [{lags}] AS history, LAG(item, 1, {PAD}) OVER w AS previous,
               t AS timestamp,
               COALESCE(CAST(r AS FLOAT), CAST('NaN' AS FLOAT)) AS rating, split
        FROM coded
        WINDOW w AS (PARTITION BY u ORDER BY t, row)"""


def _write_vocabulary(connection, table: str, path: str) -> None:
    pq.write_table(connection.sql(
        f"SELECT index, id, count FROM {table} ORDER BY index").to_arrow_table(), path)


def _write_shards(reader: pa.RecordBatchReader, out_folder: str, length: int,
                  rows_per_shard: int, progress=None) -> list[tuple[str, int]]:
    """Writes the query's batches as Parquet shards of at most `rows_per_shard` rows;
    [(path, rows)]."""
    schema = pa.schema([("row", pa.int64()), ("user", pa.int32()), ("item", pa.int32()),
                        ("history", pa.list_(pa.int32(), length)), ("previous", pa.int32()),
                        ("timestamp", pa.int64()),
                        ("rating", pa.float32()), ("split", pa.int8())])
    written, writer = [], None
    for batch in reader:
        while len(batch):
            if writer is None or written[-1][1] == rows_per_shard:
                if writer is not None:
                    writer.close()
                    if progress:
                        progress(*written[-1])
                path = os.path.join(out_folder, "shards", f"part-{len(written):05d}.parquet")
                writer, written = pq.ParquetWriter(path, schema), written + [(path, 0)]
            take = min(len(batch), rows_per_shard - written[-1][1])
            writer.write_batch(_typed(batch.slice(0, take), schema, length),
                               row_group_size=ROW_GROUP_ROWS)
            written[-1] = (written[-1][0], written[-1][1] + take)
            batch = batch.slice(take)
    if writer is not None:
        writer.close()
        if progress:
            progress(*written[-1])
    return written


def _write_training_blocks(connection, shards: list[str], folder: str, length: int,
                           rows_per_file: int, block_rows: int, seed: int,
                           progress=None) -> list[tuple[str, int]]:
    """Writes the training rows of the prepared shards as TFRecord files of blocks, in an
    order DuckDB sorts them into by a hash of their position and `seed` (out of core, spilling
    like the rest): every file and block is a uniform sample of the rows, so a reader that
    shuffles within a bounded window still mixes users and times. [(path, rows)]."""
    reader = connection.sql(
        f"SELECT user, item, history FROM {read_parquet_sql(shards)} "
        f"WHERE split = {SPLIT_CODES['train']} ORDER BY hash(row, {seed}), row"
    ).to_arrow_reader(ROW_GROUP_ROWS)
    written, writer = [], None
    for batch in reader:
        while len(batch):
            if writer is None or writer.rows == rows_per_file:
                if writer is not None:
                    writer.close()
                    written.append((writer.path, writer.rows))
                    if progress:
                        progress(*written[-1])
                writer = BlockWriter(os.path.join(folder, f"part-{len(written):05d}.tfrecord"),
                                     block_rows)
            part = batch.slice(0, rows_per_file - writer.rows)
            writer.write(part.column("user").to_numpy(), part.column("item").to_numpy(),
                         part.column("history").flatten().to_numpy().reshape(-1, length))
            batch = batch.slice(len(part))
    if writer is not None:
        writer.close()
        written.append((writer.path, writer.rows))
        if progress:
            progress(*written[-1])
    return written


def _typed(batch: pa.RecordBatch, schema: pa.Schema, length: int) -> pa.RecordBatch:
    """The batch in the shards' types; the history list becomes a [rows, L] fixed-size list."""
    history = batch.column("history").flatten().cast(pa.int32())       # [rows * L]
    columns = [batch.column(field.name).cast(field.type) if field.name != "history" else
               pa.FixedSizeListArray.from_arrays(history, length) for field in schema]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def main(argv=None) -> int:
    """Prepares Parquet shards out of core; progress on stderr, then the manifest's counts as
    one JSON line."""
    from tworec.console import OneLineParser
    from tworec.features.shards import memory_bytes
    from tworec.features.sources import parse_columns
    parser = OneLineParser(description="Prepares a Parquet log (a folder or glob of shards, or "
                                       "one .parquet file) out of core into training-ready "
                                       "shards, with DuckDB.")
    parser.add_argument("--data", required=True, help="a folder or glob of Parquet shards, or "
                                                      "one .parquet file")
    parser.add_argument("--out", required=True, help="a new or empty folder for the prepared "
                                                     "shards")
    parser.add_argument("--history-length", type=int, default=20,
                        help=f"previous items per row (default 20, at most {HISTORY_MAX:,})")
    parser.add_argument("--memory-limit", default="1GB",
                        help="DuckDB's memory limit (default 1GB); beyond it DuckDB spills to a "
                             "temporary folder")
    parser.add_argument("--columns", default="",
                        help="column mapping, user=..,item=..,time=..,rating=.. (rating=none "
                             "reads no ratings)")
    args = parser.parse_args(argv)
    if not 0 <= args.history_length <= HISTORY_MAX:
        parser.error(f"--history-length must be from 0 to {HISTORY_MAX:,}, got "
                     f"{args.history_length}")
    try:
        memory_bytes(args.memory_limit)
    except ValueError as error:
        parser.error(f"--memory-limit: {error}")

    def progress(path: str, rows: int) -> None:
        print(f"[prepare] {path}: {rows:,} rows", file=sys.stderr, flush=True)

    def note(line: str) -> None:
        print(f"[prepare] note: {line}", file=sys.stderr, flush=True)

    try:
        manifest = prepare_shards(args.data, args.out, args.history_length, args.memory_limit,
                                  parse_columns(args.columns), progress=progress, note=note)
    except DataError as error:                         # the data's mistake, not the options'
        parser.exit(2, f"error: {error}\n")
    except KeyboardInterrupt:                          # the folder is left as it was
        print(f"error: stopped (Ctrl-C); {args.out} is left as it was: run the same command "
              "again", file=sys.stderr)
        return 130
    print(json.dumps({key: manifest[key] for key in (
        "rows", "dropped", "users", "vocabulary", "split", "seconds", "rows_per_second")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
