"""Logs stored as Parquet shards: a folder of `.parquet` files or a glob matching them.

A shard set is read exactly as the same rows in one Parquet file would be (the same column
resolution, checks and encoding), the shards concatenated in the order of their paths. Reading
goes through Arrow's dataset API one column at a time, a batch at a time, only the needed
columns. A file named `items.parquet` among the shards is not a shard but the item table: the
log's item column, then one column per item feature (a fixed-size list column is a
[num_items, k] matrix, e.g. `genres`, whose names the file's metadata may carry).

`describe` summarises a shard set without loading it: DuckDB reads the Parquet files with a
memory limit, spilling to a temporary folder, so a log larger than memory is counted exactly.

Run as a module, it writes a synthetic log of any size as shards in bounded memory
(`synthetic.write_shards`) and prints one JSON line with the rows and rows per second:

    python -m tworec.features.shards --synthetic 100m --out logs/synthetic-100m
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import glob
import json
import os
import pathlib
import re
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from tworec.console import OneLineParser
from tworec.features.interactions import DataError, Interactions, SourceNotFound
from tworec.features.sources import (DEFAULT_COLUMNS, FLOAT32_OVERFLOW, MISSING, NO_RATING,
                                     OUT_OF_RANGE, RATINGS_OUT_OF_RANGE,
                                     TICKS_PER_SECOND, _column_numpy,
                                     _log_from_roles, _one_line, _resolve_columns,
                                     NUL, decimal_comma_advice, empty_ids_error,
                                     id_codes, id_type_error, not_utf8_ids_error,
                                     nul_ids_error, parquet_file, unreadable_parquet,
                                     INT96_UNIT,
                                     genres_error, genres_multi_hot, no_known_items_error,
                                     whole_years, NOT_WHOLE_YEARS, NOT_YEARS,
                                     YEARS_OUT_OF_RANGE)

ITEM_TABLE = "items.parquet"
GENRE_NAMES_KEY = b"tworec.genre_names"      # item-table metadata: JSON list, one per column
BATCH_ROWS = 1 << 20
DISTINCT_ROW_BYTES = 64     # memory limit per row of one DISTINCT pass (see `describe`)
GLOB_CHARACTERS = "*?["
# Data files refused among shards, which would not be read (not a `.json`, such as a log's own
# manifest, nor a `.txt`, such as a readme).
OTHER_DATA = (".csv", ".tsv", ".jsonl", ".ndjson", ".gz", ".bz2", ".zst", ".xz", ".zip",
              ".orc", ".avro", ".arrow", ".feather")


@dataclasses.dataclass(frozen=True)
class ShardSet:
    """The files of a shard source.

    Attributes:
        source: the folder or glob as given.
        files: the log shards, sorted by path.
        items: the item table among them, or None.
    """

    source: str
    files: tuple[str, ...]
    items: str | None = None


def find(source: str) -> ShardSet | None:
    """The shards a folder or glob names; None for a source that is neither (a file, or a
    folder without `.parquet` files such as a GroupLens release). Names starting with `_` or
    `.` are skipped in a folder and where a glob's wildcards reach them (`_hidden_match`).

    Raises:
        DataError: one line for an empty folder, a glob matching nothing or matching files that
            are not Parquet, a folder of shards that also holds other data files (`OTHER_DATA`,
            such as a day's `.csv`), or two item tables.
    """
    prepared = _prepared_folder(source)
    if prepared is not None:
        where = ("a folder that prepare wrote" if os.path.normpath(prepared) ==
                 os.path.normpath(source) else f"inside {prepared}, a folder that prepare wrote")
        raise DataError(f"{source}: {where}, not a log; read it with "
                        f"tworec.features.stream.PreparedLog.load({prepared!r}) and "
                        "tworec.retrieval.train.fit_prepared (README: logs larger than memory), "
                        "or pass the log it was prepared from")
    if not os.path.exists(source) and any(c in source for c in GLOB_CHARACTERS):
        found = sorted({p for p in glob.glob(source, recursive=True) if os.path.isfile(p)})
        matches = [path for path in found if not _hidden_match(source, path)]
        if found and not matches:
            raise SourceNotFound(f"{source}: the pattern's wildcards reach only names starting "
                                 f"with _ or . ({found[0]}), which are skipped as a write in "
                                 "progress (Spark's _temporary); spell such a name out in the "
                                 "pattern to read it")
        if not matches:
            raise SourceNotFound(f"{source}: no file matches the pattern; pass a glob that "
                                 "matches Parquet shards, e.g. logs/part-*.parquet, or their "
                                 "folder")
        first_names: dict[str, str] = {}                  # a file linked twice: its first
        for path in matches:                               # name, in the sorted order
            first_names.setdefault(os.path.realpath(path), path)
        matches = list(first_names.values())
        other = next((p for p in matches if not p.endswith(".parquet")), None)
        if other is not None:
            raise DataError(f"{source}: the pattern matches {other}, which is not a .parquet "
                            "file; make it match only the shards, e.g. "
                            f"{os.path.join(os.path.dirname(source) or '.', '*.parquet')}")
        return _with_item_table(source, matches)
    if not os.path.isdir(source):
        return None
    files, anything, walked, read, others, hidden = [], False, set(), set(), [], []
    roots = {os.path.realpath(source), os.path.abspath(source)}
    for folder, subfolders, names in os.walk(source, followlinks=True):
        real = os.path.realpath(folder)
        if real in walked or real not in roots and any(   # read once; an ancestor's other
                os.path.commonpath([real, root]) == real for root in roots):  # folders are
            subfolders[:] = []                                                # not the log
            continue
        walked.add(real)
        hidden += [os.path.join(folder, n) for n in sorted(subfolders + names)
                   if n.startswith((".", "_"))]
        subfolders[:] = sorted(d for d in subfolders if not d.startswith((".", "_")))
        anything |= bool(names)
        shards = [n for n in names if not n.startswith((".", "_"))
                  and n.lower().endswith((".parquet", ".parq"))]
        misnamed = next((n for n in shards if not n.endswith(".parquet")), None)
        if misnamed is not None:
            raise DataError(f"{os.path.join(folder, misnamed)}: a shard is read when its name "
                            "ends .parquet; rename it so, or move it out of the folder")
        for name in sorted(shards):                   # a file linked twice is read once
            if os.path.realpath(os.path.join(folder, name)) not in read:
                read.add(os.path.realpath(os.path.join(folder, name)))
                files.append(os.path.join(folder, name))
        others += [os.path.join(folder, n) for n in sorted(names) if not n.startswith((".", "_"))
                   and n.lower().endswith(OTHER_DATA)]
    if files and others:
        raise DataError(f"{others[0]}: not a .parquet file, among the log's shards, where it "
                        "would not be read; write it as Parquet, or move it out of the folder")
    if not anything and hidden:
        raise DataError(f"{source}: holds only names starting with _ or . ({hidden[0]}), which "
                        "are skipped as a write in progress (Spark's _temporary); pass the "
                        "folder of the finished shards")
    if not anything:
        raise DataError(f"{source}: the folder is empty; pass a folder of .parquet shards, a "
                        f"glob such as {os.path.join(source, 'part-*.parquet')}, or a GroupLens "
                        "release folder")
    return _with_item_table(source, sorted(files)) if files else None


def _hidden_match(pattern: str, path: str) -> bool:
    """Whether the wildcards of `pattern` reached `path` through a file or folder whose name
    starts with `_` or `.` (Spark's `_temporary` of a write in progress, `_SUCCESS`), which a
    folder read skips as Spark, Hive and Arrow's datasets do. A component of the pattern that
    itself starts so (`_part-*.parquet`) reads it, as `glob` treats dot files; what `**`
    matches is a wildcard's."""
    patterns, parts = pathlib.PurePath(pattern).parts, pathlib.PurePath(path).parts
    stars = [index for index, part in enumerate(patterns) if part == "**"]
    head, tail = (stars[0], len(patterns) - stars[-1] - 1) if stars else (len(patterns), 0)
    between = [part for part in patterns[head:len(patterns) - tail] if part != "**"]
    pairs = (list(zip(patterns[:head], parts[:head]))
             + list(zip(patterns[len(patterns) - tail:], parts[len(parts) - tail:]))
             + [(next((c for c in between if fnmatch.fnmatchcase(part, c)), "**"), part)
                for part in parts[head:len(parts) - tail]])      # a name spelt between two **
    return any(part.startswith(("_", ".")) and not component.startswith(part[0])
               for component, part in pairs)


def _prepared_folder(source: str) -> str | None:
    """The folder `prepare` wrote that `source` (a folder, glob or .parquet file) is or is in
    (its `shards` or `train` folder), known by its manifest; None otherwise."""
    if not (os.path.isdir(source) or source.endswith(".parquet")
            or any(c in source for c in GLOB_CHARACTERS)):
        return None
    folder = os.path.normpath(source if os.path.isdir(source) else
                              os.path.dirname(source) or ".")
    candidates = [folder] + ([os.path.dirname(folder)]
                             if os.path.basename(folder) in ("shards", "train") else [])
    for candidate in candidates:
        try:
            with open(os.path.join(candidate or ".", "manifest.json")) as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict) and {"train_blocks", "history_slots"} <= set(manifest):
            return candidate or "."
    return None


def _with_item_table(source: str, files: list[str]) -> ShardSet:
    items = [p for p in files if os.path.basename(p) == ITEM_TABLE]
    if len(items) > 1:
        raise DataError(f"{source}: {len(items)} item tables ({', '.join(items)}); keep one "
                        f"{ITEM_TABLE} beside the shards")
    shards = tuple(p for p in files if os.path.basename(p) != ITEM_TABLE)
    if not shards:
        raise DataError(f"{source}: only the item table {items[0]}, no log shards; write the "
                        "log's rows as .parquet files beside it")
    return ShardSet(source, shards, items[0] if items else None)


def needed_columns(shards: ShardSet, columns: dict[str, str], by_duckdb: bool = False
                   ) -> tuple[dict[str, str], pa.Schema]:
    """The role -> column mapping (resolved on the first shard with rows as for one Parquet
    log) and the schema of the needed columns, which every shard with rows must share but for
    width (`_widened`: int32 and int64 are read as int64); an empty shard may lack them or
    hold them as another type (an empty day's export types a text column `null`).

    Args:
        by_duckdb: the shards are for DuckDB (`parquet_log`), whose names ignore case: a
            needed column must be the only one of its name in any case.

    Raises:
        DataError: one line naming the first shard that lacks a needed column or holds it with
            another type, and the shard it differs from.
    """
    schemas, rows = {}, {}
    for path in shards.files:
        parquet = _parquet(path)
        schemas[path], rows[path] = parquet.schema_arrow, parquet.metadata.num_rows
    first = next((path for path in shards.files if rows[path]), shards.files[0])
    schema = schemas[first]
    mapping = _resolve_columns(first, schema.names, columns)
    needed = pa.schema([schema.field(name) for name in sorted(set(mapping.values()))])
    for path in shards.files:
        other = schemas[path]
        if not rows[path]:                    # neither compared nor read by DuckDB
            continue
        if by_duckdb:
            _refuse_case_twins(path, other.names, needed.names)
            _refuse_row_column_names(path, other.names)
        if path == first:                  # its header checked by `_resolve_columns`
            continue
        twice = next((name for name in needed.names if other.names.count(name) > 1), None)
        if twice is not None:
            raise DataError(f"{path}: the column {twice!r} is in the shard "
                            f"{other.names.count(twice)} times; give the columns distinct names")
        rated = mapping.rating_open and next(
            (name for name in DEFAULT_COLUMNS["rating"] if name in other.names), None)
        if rated:                     # read from the first shard alone, its rows would be lost
            raise DataError(f"{path}: column {rated!r} would be read as ratings, which {first} "
                            "lacks; every shard needs the same columns (found there: "
                            f"{', '.join(schema.names)}), or give --columns rating={NO_RATING} "
                            "to read no ratings")
        for field in needed:
            if field.name not in other.names:
                raise DataError(f"{path}: no column {field.name!r}, which {first} has; every "
                                "shard needs the same columns (found: "
                                f"{', '.join(other.names)})")
            found, wide = other.field(field.name).type, needed.field(field.name).type
            if found != wide:
                wide = _widened(wide, found)
                if wide is None:
                    units = {getattr(_stored(kind), "unit", None) for kind in
                             (found, schema.field(field.name).type)}
                    int96 = ("; if one of them is a Parquet INT96 time (Spark's legacy), it "
                             "is read in microseconds, as DuckDB reads it: write the times in "
                             "one unit, e.g. timestamp[us]" if units == {"us", "ns"} else "")
                    raise DataError(f"{path}: column {field.name!r} is {found}, but "
                                    f"{schema.field(field.name).type} in {first}; write every "
                                    f"shard with the same schema{int96}")
                needed = needed.set(needed.get_field_index(field.name), field.with_type(wide))
        mapping.unread = tuple(dict.fromkeys(mapping.unread + mapping.unread_of(other.names)))
    return mapping, needed


def _widened(one: pa.DataType, other: pa.DataType) -> pa.DataType | None:
    """The type a column of two shards is read as when they hold it in kinds that differ only
    in width, as Arrow's dataset scanner casts it in memory and DuckDB's `union_by_name` out of
    core: integers of one sign as 64 bits, floats as float64, text and bytes as their large
    types, timestamps of one zone in s, ms or us as the finest. None for any other pair."""
    one, other = _stored(one), _stored(other)
    for kind, wide in ((pa.types.is_signed_integer, pa.int64()),
                       (pa.types.is_unsigned_integer, pa.uint64()),
                       (pa.types.is_floating, pa.float64()), (_is_text, pa.large_string()),
                       (_is_binary, pa.large_binary())):
        if kind(one) and kind(other):
            return wide
    units = ("s", "ms", "us")                # DuckDB reads a union with ns otherwise
    if (pa.types.is_timestamp(one) and pa.types.is_timestamp(other) and one.tz == other.tz
            and one.unit in units and other.unit in units):
        return pa.timestamp(max(one.unit, other.unit, key=units.index), one.tz)
    return None


def _refuse_row_column_names(path: str, names: list[str]) -> None:
    """A DataError when a column, read or not, has the name of one DuckDB adds to each row of
    a scan (`_scan`: its file and its row in it): DuckDB would read the shard's own column, and
    rows would take other positions, or refuse the scan."""
    clash = next((name for name in names if name.lower() in ROW_COLUMNS), None)
    if clash is not None:
        raise DataError(f"{path}: column {clash!r} has the name of a column describe and "
                        "prepare (DuckDB) add to each row for its position: rename it, or load "
                        "the log in memory")


ROW_COLUMNS = ("file_index", "file_row_number")      # DuckDB's, as `_scan` and `_row_sql` ask


def _refuse_case_twins(path: str, names: list[str], needed: list[str]) -> None:
    """A DataError when a needed column shares its name but for case with another: DuckDB
    would read either (`Timestamp` for `timestamp`). A needed column that is not there is the
    schema check's to name."""
    for name in (name for name in needed if name in names):
        twin = next((other for other in names
                     if other != name and other.lower() == name.lower()), None)
        if twin is not None:
            raise DataError(f"{path}: columns {name!r} and {twin!r} differ only in case, which "
                            "describe and prepare (DuckDB) do not tell apart: rename one, or "
                            "load the log in memory")


def _schema(path: str) -> pa.Schema:
    return _parquet(path).schema_arrow


def _parquet(path: str) -> pq.ParquetFile:
    """A shard (`sources.parquet_file`), refused in one line when Arrow cannot read it."""
    try:
        return parquet_file(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise unreadable_parquet(path, error) from None


def load(source: str, columns: dict[str, str] | None = None) -> Interactions:
    """Reads a folder or glob of Parquet shards into `Interactions`: the same log as the
    shards' rows in one Parquet file, with the catalogue and item features of an
    `items.parquet` among them.

    Args:
        source: a folder of `.parquet` files or a glob such as `logs/part-*.parquet`.
        columns: role -> column name, as for one Parquet log.
    """
    shards = find(source)
    if shards is None:
        raise DataError(f"{source}: no .parquet files; pass a folder of Parquet shards or a "
                        "glob matching them")
    return read(shards, columns or {})


def read(shards: ShardSet, columns: dict[str, str]) -> Interactions:
    """`load` of the shards `find` found."""
    mapping, schema = needed_columns(shards, columns)
    items = None if shards.items is None else read_item_table(shards.items, mapping["item"])
    return _log_from_roles(shards.source, mapping, read_columns(shards.files, schema), items)


def read_columns(files, schema: pa.Schema, batch_rows: int = BATCH_ROWS) -> dict[str, np.ndarray]:
    """name -> [n] NumPy column of the shards concatenated in order, read one column at a time
    and a batch of `batch_rows` at a time with Arrow's dataset scanner. A shard that cannot be
    read (a corrupt page) is a one-line DataError naming it."""
    dataset = ds.dataset(list(files), schema=schema, format=ds.ParquetFileFormat(
        read_options=ds.ParquetReadOptions(coerce_int96_timestamp_unit=INT96_UNIT)))
    columns = {}
    for field in schema:
        chunks = []
        try:
            for tagged in dataset.scanner(columns=[field.name],
                                          batch_size=batch_rows).scan_batches():
                column = tagged.record_batch.column(0)
                if column.null_count:          # the whole shard's count, for the message
                    column = parquet_file(tagged.fragment.path).read(
                        columns=[field.name]).column(0)
                chunks.append(_column_numpy(tagged.fragment.path, field.name,
                                            pa.chunked_array([column])))
        except (pa.ArrowException, OSError):            # which shard: Arrow does not say
            problem = _unreadable(files, [field.name])
            if problem is None:
                raise
            raise problem from None
        columns[field.name] = (np.concatenate(chunks) if chunks else _column_numpy(
            files[0], field.name, pa.chunked_array([], type=field.type)))
    return columns


def _unreadable(files, names: list[str]) -> DataError | None:
    """The one-line error of the first of `files` whose columns `names` Arrow cannot read (a
    corrupt page), or None. Read a batch at a time, for an error's message only."""
    for path in files:
        for name in names:
            try:
                for _ in parquet_file(path).iter_batches(BATCH_ROWS, columns=[name]):
                    pass
            except (pa.ArrowException, OSError) as error:
                return DataError(f"{path}: cannot read column {name!r}: {_one_line(error)}")
    return None


# ---------------------------------------------------------------- the item table


def item_table_ids(path: str, id_column: str) -> np.ndarray:
    """[num_items] str ids of an `items.parquet`, read alone: the log's item column must be
    there (checked on the schema first) and hold every item once, none missing or empty."""
    names = _schema(path).names
    if id_column not in names:
        raise DataError(f"{path}: the item table needs the log's item column {id_column!r}; it "
                        f"has {', '.join(names)}")
    text, codes = id_codes(path, id_column, _column_numpy(
        path, id_column, parquet_file(path).read(columns=[id_column]).column(0)))
    ids = text[codes]
    empty = np.flatnonzero(ids == "")
    if len(empty):
        raise empty_ids_error(path, id_column, len(empty), int(empty[0]))
    distinct, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise DataError(f"{path}: item {str(distinct[counts > 1][0])!r} appears "
                        f"{counts[counts > 1][0]} times; the item table has one row per item")
    return ids


def read_item_table(path: str, id_column: str) -> dict:
    """The catalogue, item features and genre names of an `items.parquet` whose id column is
    the log's item column, as `sources.from_columns` takes them."""
    ids = item_table_ids(path, id_column)
    table = parquet_file(path).read()
    features = {name: _feature(path, name, table.column(name))
                for name in table.column_names if name != id_column}
    genre_names = ()
    if "genres" in features and features["genres"].dtype.kind == "U":   # names joined by '|'
        features["genres"], genre_names = genres_multi_hot(features["genres"], path, "genres")
    elif "genres" in features:
        width = features["genres"].shape[1] if features["genres"].ndim == 2 else 1
        stored = (table.schema.metadata or {}).get(GENRE_NAMES_KEY)
        genre_names = tuple(json.loads(stored)) if stored else tuple(
            f"genre_{g}" for g in range(width))
        if len(genre_names) != width:
            raise DataError(f"{path}: {len(genre_names)} genre names in its metadata for "
                            f"{width} genre columns")
    if "year" in features:
        features["year"] = whole_years(path, "year", features["year"])
    return dict(catalogue=ids, item_features=features, genre_names=genre_names)


def _feature(path: str, name: str, column: pa.ChunkedArray) -> np.ndarray:
    """[num_items] values, or [num_items, k] for a fixed-size list column."""
    if pa.types.is_fixed_size_list(column.type):
        flat = _column_numpy(path, name, pa.chunked_array(
            [chunk.flatten() for chunk in column.chunks], type=column.type.value_type))
        return flat.reshape(len(column), column.type.list_size)
    if pa.types.is_nested(column.type):
        raise DataError(f"{path}: column {name!r} is {column.type}; an item feature is a "
                        "number, a string or a fixed-size list")
    values = _column_numpy(path, name, column)
    return values.astype(str) if values.dtype == object else values


def write_item_table(path: str, item_ids: np.ndarray, features: dict[str, np.ndarray],
                     genre_names: tuple[str, ...] = (), id_column: str = "item_id") -> None:
    """Writes the item table `read_item_table` reads: ids, features ([items] or
    [items, k], the latter as a fixed-size list) and the genre names in its metadata."""
    columns = {id_column: pa.array(np.asarray(item_ids).astype(str))}
    for name, values in features.items():
        values = np.asarray(values)
        columns[name] = (pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)),
                                                            values.shape[1])
                         if values.ndim == 2 else pa.array(values))
    table = pa.table(columns).replace_schema_metadata(
        {GENRE_NAMES_KEY: json.dumps(list(genre_names))} if genre_names else None)
    pq.write_table(table, path)


# ---------------------------------------------------------------- summary without loading


@contextlib.contextmanager
def duckdb_session(source: str, memory_limit: str, database: str = ":memory:"):
    """A DuckDB connection under `memory_limit` that spills to a temporary folder (created
    beside `database` when it is a file) and turns DuckDB's conversion, out-of-memory and
    reading errors (DuckDB's own words name the file) into one-line DataErrors naming
    `source`, and a query interrupted (DuckDB's answer to Ctrl-C) into KeyboardInterrupt."""
    import duckdb
    limit = memory_bytes(memory_limit)
    with tempfile.TemporaryDirectory(prefix="tworec-duckdb-") as spill:
        connection = duckdb.connect(database if database == ":memory:"
                                    else os.path.join(spill, database))
        try:
            for setting in (f"memory_limit='{limit}B'", f"temp_directory='{spill}'",
                            "preserve_insertion_order=false",
                            "enable_progress_bar=false"):   # prepare says its own progress
                connection.execute(f"SET {setting}")
            yield connection
        except duckdb.ConversionException as error:
            raise DataError(f"{source}: a time or rating value is not numeric: "
                            f"{_one_line(error)}") from None
        except duckdb.OutOfMemoryException as error:
            raise DataError(f"{source}: DuckDB needs more than its memory limit of "
                            f"{memory_limit}; raise the limit ({_one_line(error)})") from None
        except (duckdb.InterruptException, RuntimeError) as error:   # Ctrl-C during a query
            if isinstance(error, duckdb.InterruptException) or str(error) == "Query interrupted":
                raise KeyboardInterrupt from None
            raise
        except duckdb.Error as error:         # a file it cannot read (a corrupt page); not
            if isinstance(error, duckdb.ProgrammingError) and not isinstance(   # SQL of ours
                    error, duckdb.InvalidInputException):
                raise
            raise DataError(f"{source}: cannot read: {_one_line(error)}") from None
        finally:
            connection.close()


def describe(source: str, columns: dict[str, str] | None = None,
             memory_limit: str = "1GB") -> dict:
    """The counts of the log a shard set (or one `.parquet` file) loads as, computed by DuckDB
    over the files without loading them: the keys of `Interactions.summary()` with the same
    values, the time range, the rows of every shard (from the files' footers), and how DuckDB
    ran.

    DuckDB rather than Arrow's scanner: the exact counts need distinct values and distinct rows
    (duplicates are dropped on loading), which DuckDB computes out of core under
    `memory_limit`, spilling to a temporary folder; Arrow's scanner has no distinct at all.
    Distinct rows are counted in passes over disjoint sets of users (`hash(user) % passes`;
    duplicates share their user), about `limit / DISTINCT_ROW_BYTES` rows each: DuckDB's
    spilling DISTINCT still needs memory that grows with the rows (one pass over 100M rows ran
    out of 500MB; so did, now and then, a pass over 25M), and a pass that fits its limit is
    the surest not to. Peak resident memory is then about the limit plus ~200MB, whatever the
    log's size.

    Args:
        source: a folder or glob of Parquet shards, or one `.parquet` file.
        columns: role -> column name, as for `load`.
        memory_limit: DuckDB's memory limit, e.g. '1GB' or '500MiB'.
    """
    limit = memory_bytes(memory_limit)
    parquet = parquet_log(source, columns, read_item_table)
    catalogue, mapping, rows = parquet.catalogue, parquet.mapping, parquet.rows
    log, known = parquet.log, parquet.known
    passes = -(-rows // max(1, limit // DISTINCT_ROW_BYTES))
    with duckdb_session(source, memory_limit) as connection:
        parquet.check(connection, source, catalogue and catalogue["catalogue"])
        distinct_rows = kept = 0
        for part in range(passes):
            some_users = "" if passes == 1 else f"WHERE hash(u) % {passes} = {part}"
            counts = connection.execute(
                f"SELECT COUNT(*), COUNT(*) FILTER (WHERE {known}) "
                f"FROM (SELECT DISTINCT u, i, f, r FROM ({log}) {some_users})").fetchone()
            distinct_rows, kept = distinct_rows + counts[0], kept + counts[1]
        users, items, first, last = connection.execute(
            f"SELECT COUNT(DISTINCT u), COUNT(DISTINCT i), MIN(t), MAX(t) "
            f"FROM ({log}) WHERE {known}").fetchone()
    sides = {kind: sorted(role.partition(".")[2] for role in mapping
                          if role.startswith(kind + ".")) for kind in ("user", "item")}
    item_features = sorted({*sides["item"], *(catalogue["item_features"] if catalogue else ())})
    return {"source": source, "users": users,
            "items": items if catalogue is None else len(catalogue["catalogue"]),
            "interactions": kept, "has_ratings": "rating" in mapping,
            "item_features": item_features, "user_features": sides["user"],
            "dropped": dropped_counts(rows, distinct_rows, kept),
            "unread_columns": list(mapping.unread),
            "time_range": [first, last],
            "shards": [{"path": path, "rows": count}
                       for path, count in zip(parquet.shards.files, parquet.shard_rows)],
            "duckdb": {"memory_limit": memory_limit, "distinct_passes": passes}}


def parquet_source(source: str) -> ShardSet:
    """The shards of a folder or glob, or one `.parquet` file as a set of one: what DuckDB's
    `describe` and `prepare` read; a one-line DataError saying so for anything else."""
    shards = find(source)
    if shards is not None:
        return shards
    if not os.path.exists(source):
        raise SourceNotFound(f"{source}: no such file or folder; pass a folder or glob of "
                             "Parquet shards, or one .parquet file")
    if not (os.path.isfile(source) and source.endswith(".parquet")):
        raise DataError(f"{source}: not Parquet; this reads only a folder or glob of Parquet "
                        "shards or one .parquet file: write the log as Parquet first (e.g. "
                        "pyarrow.csv.read_csv, then pyarrow.parquet.write_table)")
    return ShardSet(source, (source,))


@dataclasses.dataclass(frozen=True)
class ParquetLog:
    """A Parquet log as DuckDB's `describe` and `prepare` read it.

    Attributes:
        shards: its files. mapping: role -> column name. schema: the shards' schema.
        shard_rows: the rows of every shard (from the footers).
        catalogue: what `read_items` gave for the item table, or None without one.
        log: SQL of its rows (`log_sql`). known: SQL condition of a row whose item is in the
            catalogue (`known_sql`).
    """
    shards: ShardSet
    mapping: dict
    schema: pa.Schema
    shard_rows: list
    catalogue: object
    log: str
    known: str

    @property
    def rows(self) -> int:
        return sum(self.shard_rows)

    def check(self, connection, source: str, catalogue_ids) -> None:
        """`check_values`, then a one-line DataError when no row's item is among
        `catalogue_ids` (the item table's ids; None without a table)."""
        check_values(connection, source, self.shards, self.shard_rows, self.mapping, self.schema)
        if catalogue_ids is not None and not connection.execute(
                f"SELECT i FROM ({self.log}) WHERE {self.known} LIMIT 1").fetchone():
            raise no_known_items_error(source, connection.execute(
                f"SELECT i FROM ({self.log}) LIMIT 1").fetchone()[0], catalogue_ids[:1])


def parquet_log(source: str, columns: dict[str, str] | None, read_items) -> ParquetLog:
    """The shards of `source` with the columns each role reads, its item table read by
    `read_items(path, id_column)` first (its mistakes come before the log's), and its rows
    counted from the footers: a one-line DataError for an empty log."""
    shards = parquet_source(source)
    mapping, schema = needed_columns(shards, columns or {}, by_duckdb=True)
    if shards.items is not None:              # DuckDB reads its item column too
        _refuse_case_twins(shards.items, _schema(shards.items).names, [mapping["item"]])
    catalogue = None if shards.items is None else read_items(shards.items, mapping["item"])
    shard_rows = [_parquet(path).metadata.num_rows for path in shards.files]
    if sum(shard_rows) == 0:
        raise DataError(f"{source}: the log is empty")
    return ParquetLog(shards, mapping, schema, shard_rows, catalogue,
                      log_sql(shards, shard_rows, mapping, schema), known_sql(shards, mapping))


def dropped_counts(rows: int, distinct_rows: int, kept: int) -> dict[str, int]:
    """The rows dropped by reason, as `load` reports them: repeats of an earlier row, then
    (of the distinct rows) those whose item is not in the item table."""
    return {reason: number for reason, number in (
        ("duplicate_row", rows - distinct_rows), ("item_not_in_catalogue", distinct_rows - kept))
        if number}


UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


MEMORY_MAX = 1 << 50        # 1PiB: DuckDB refuses sizes from 2^63 bytes in its own words


def memory_bytes(text: str) -> int:
    """Bytes of a memory size as DuckDB writes it: '1GB' (10**9), '512MiB' (2**29), '2e9';
    from 1MiB to MEMORY_MAX."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in UNITS or not (
            1 << 20 <= float(match.group(1)) * UNITS[unit] <= MEMORY_MAX):
        raise ValueError(f"{text!r} is not a memory size of at least 1MiB and at most 1PiB, "
                         "such as 1GB or 512MiB")
    return int(float(match.group(1)) * UNITS[unit])


def check_values(connection, source: str, shards: ShardSet, shard_rows: list[int],
                 mapping: dict[str, str], schema: pa.Schema) -> None:
    """The values `load` refuses, counted by DuckDB in one pass before any other work: missing
    ids, times and ratings (null, NaN, Arrow's markers such as `NA` in text), empty ids,
    infinite times and text ratings that are not numbers; also the text times this SQL
    cannot read as `load` does: those that are not numbers (`load` reads ISO dates and times)
    and integers beyond 2^53 (read through float64 here)."""
    import duckdb
    checks = []                                      # (condition, column, what is wrong)
    for role in ("user", "item", "time", "rating"):
        if role not in mapping:
            continue
        name, kind = _name(mapping[role]), _stored(schema.field(mapping[role]).type)
        text = _is_text(kind)
        if role in ("time", "rating") and not _read_as(role, kind):
            binary = _is_binary(kind)
            raise DataError(f"{source}: column {mapping[role]!r} is of type {kind}, which out of "
                            f"core is not read as a {role}: write it as {READ_AS[role]}"
                            + (", or load the log in memory, which reads bytes as text"
                               if binary else ""))
        number = f"TRY_CAST({name} AS DOUBLE)" if text else name
        missing = f"{name} IS NULL"
        if role in ("time", "rating") and text:           # Arrow's markers, as `load` reads
            missing += f" OR list_contains({_sql_list(MISSING.to_pylist())}, {name})"
        if (role in ("time", "rating") and text) or pa.types.is_floating(kind):
            missing += f" OR isnan({number})"                  # a NaN id too, as `load` reads
        checks.append((missing, mapping[role], "missing"))
        if role in ("user", "item") and pa.types.is_decimal(kind) and kind.precision > 38:
            raise DataError(f"{source}: column {mapping[role]!r} is of type {kind}, which out "
                            "of core (DuckDB) reads as floating point, merging ids; write the "
                            "ids as text, or load the log in memory")
        if role in ("user", "item") and not _read_as_id(kind):
            raise id_type_error(source, mapping[role], kind)
        if role in ("user", "item") and (text or _is_binary(kind)):
            checks.append((f"{name} = ''", mapping[role], "empty"))
        if role in ("user", "item") and _is_binary(kind):
            checks.append((f"TRY(decode({name})) IS NULL AND {name} IS NOT NULL", mapping[role],
                           "not utf8"))
        if role in ("user", "item") and (text or _is_binary(kind)):
            value = f"TRY(decode({name}))" if _is_binary(kind) else name
            checks.append((f"contains({value}, chr({ord(NUL)}))", mapping[role], "nul"))
        if role in ("time", "rating") and text:
            checks.append((f"{number} IS NULL AND {name} IS NOT NULL", mapping[role],
                           f"text {role}"))
        if role == "time" and (text or pa.types.is_floating(kind) or pa.types.is_decimal(kind)):
            checks.append((f"NOT (abs(CAST({number} AS DOUBLE)) < {2.0 ** 63!r})", mapping[role],
                           "out of range"))
        if role == "rating" and (text or pa.types.is_floating(kind)
                                 or pa.types.is_decimal(kind)):
            checks.append((f"NOT (abs(CAST({number} AS DOUBLE)) < {FLOAT32_OVERFLOW!r})",
                           mapping[role], "rating out of range"))
        if role == "time" and pa.types.is_unsigned_integer(kind):
            checks.append((f"{name} > {2 ** 63 - 1}", mapping[role], "out of range"))
        if role == "time" and text:                        # read through float64 below
            checks.append((f"abs({number}) >= {2 ** 53}", mapping[role], "beyond 2^53"))
    checks += _side_checks(source, shards, mapping, schema)
    row, scan = _scan(shards.files, shard_rows)
    # Parquet's min/max statistics leave NaN out, and DuckDB's statistics propagation then
    # folds isnan() to false (DuckDB 2.0): the count is taken without it.
    connection.execute("SET disabled_optimizers = 'statistics_propagation'")
    try:
        found = connection.execute("SELECT " + ", ".join(
            f"COUNT(*) FILTER (WHERE {condition}), MIN({row}) FILTER (WHERE {condition}), "
            f"arg_min(CAST({_name(name)} AS VARCHAR), {row}) FILTER (WHERE {condition})"
            for condition, name, _ in checks) + f" FROM {scan}").fetchone()
    except (duckdb.InterruptException, duckdb.OutOfMemoryException,
            duckdb.ConversionException):          # `duckdb_session` says these
        raise
    except duckdb.Error:                    # the first scan: a corrupt page shows here, and
        problem = _unreadable(shards.files, schema.names)    # DuckDB may not name the file
        if problem is None:
            raise
        raise problem from None
    finally:                                         # the session's other queries keep it
        connection.execute("RESET disabled_optimizers")
    for (_, name, wrong), count, first, value in zip(checks, found[::3], found[1::3],
                                                      found[2::3]):
        if not count:
            continue
        first = _in_its_shard(shards.files, shard_rows, first)
        if wrong == "empty":
            raise empty_ids_error(source, name, count, first)
        if wrong == "not utf8":
            raise not_utf8_ids_error(source, name, count, first)
        if wrong == "nul":
            raise nul_ids_error(source, name, count, first)
        if wrong in COUNTED:
            raise DataError(f"{source}: column {name!r} has {count} {COUNTED[wrong]} "
                            f"(first at row {first})" + ("; fill them, or leave the feature out "
                                                         "of --columns" if wrong == "missing side"
                                                         else ""))
        if wrong == "beyond 2^53":
            raise DataError(f"{source}: column {name!r} holds a time beyond 2^53 as text "
                            f"({value!r} at row {first}), which out of core is read through "
                            "float64 and would lose digits: write the column as int64")
        if wrong in NOT_NUMBERS:
            raise DataError(f"{source}: column {name!r} is {NOT_NUMBERS[wrong]} (first value "
                            f"that is not a number: {value!r}, at row {first}"
                            f"{decimal_comma_advice(value)})")
        raise DataError(f"{source}: column {name!r} holds text that is not a number ({value!r} "
                        f"at row {first}); read out of core, a text time must be a number: "
                        "write the column as a Parquet timestamp (pyarrow.compute.cast(column, "
                        "pyarrow.timestamp('us'))), or load the log in memory, which reads ISO "
                        "dates and times")


# What the SQL below reads as each role (and text of numbers, `_is_text`).
READ_AS = {"time": "integers, floats, timestamps, durations or dates",
           "rating": "integers or floats"}


# The checks `check_values` counts, and what their rows are.
COUNTED = {"missing": "missing or NaN values", "out of range": OUT_OF_RANGE,
           "rating out of range": RATINGS_OUT_OF_RANGE, "missing side": "missing values",
           "year not whole": NOT_WHOLE_YEARS, "year out of range": YEARS_OUT_OF_RANGE}
NOT_NUMBERS = {"text rating": "not numeric", "text year": NOT_YEARS}   # and what they are not


def _side_checks(source: str, shards: ShardSet, mapping: dict[str, str],
                 schema: pa.Schema) -> list[tuple[str, str, str]]:
    """`check_values`' checks of the side features (`user.NAME`, `item.NAME`) as `load` reads
    them: no value missing, `item.genres` text without an item table, `item.year` whole
    numbers below 2^31 (text of such numbers too); a DataError at once for a type it refuses."""
    checks = []
    for role in sorted((role for role in mapping if "." in role), key=mapping.get):
        name, kind = _name(mapping[role]), _stored(schema.field(mapping[role]).type)
        checks.append((f"{name} IS NULL", mapping[role], "missing side"))
        if role == "item.genres" and (shards.items is not None or not _is_text(kind)):
            raise genres_error(source, mapping[role], shards.items is not None)
        if role != "item.year":
            continue
        if not _read_as("rating", kind):
            raise DataError(f"{source}: column {mapping[role]!r} is of type {kind}, "
                            f"{NOT_YEARS}")
        number = f"TRY_CAST({name} AS DOUBLE)" if _is_text(kind) else f"CAST({name} AS DOUBLE)"
        checks += [(f"{number} IS NULL AND {name} IS NOT NULL", mapping[role], "text year"),
                   (f"isnan({number})", mapping[role], "missing"),
                   (f"{number} <> round({number})", mapping[role], "year not whole"),
                   (f"abs({number}) >= {2 ** 31}", mapping[role], "year out of range")]
    return checks


def _stored(kind: pa.DataType) -> pa.DataType:
    """The Arrow type of a column's values: a dictionary's value type."""
    return kind.value_type if pa.types.is_dictionary(kind) else kind


def _read_as(role: str, kind: pa.DataType) -> bool:
    """Whether the SQL below reads a Parquet column of Arrow type `kind` (not a dictionary)
    as the `role` (time or rating) column: numbers (decimals too) and text; for times,
    timestamps, durations and dates as well, for ratings booleans (as `load` reads them)."""
    moment = (pa.types.is_timestamp(kind) or pa.types.is_duration(kind)
              or pa.types.is_date(kind))
    return (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)
            or pa.types.is_null(kind) or _is_text(kind) or (role == "time" and moment)
            or (role == "rating" and pa.types.is_boolean(kind)))


def _read_as_id(kind: pa.DataType) -> bool:
    """Whether an id column of Arrow type `kind` (not a dictionary) is read as `load` reads
    it: text, bytes and numbers (`sources.id_type_error` refuses dates, times and booleans)."""
    return (_is_text(kind) or _is_binary(kind) or pa.types.is_integer(kind)
            or pa.types.is_floating(kind) or pa.types.is_decimal(kind)
            or pa.types.is_null(kind))


def _is_binary(kind: pa.DataType) -> bool:
    return (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
            or pa.types.is_binary_view(kind) or pa.types.is_fixed_size_binary(kind))


def _is_text(kind: pa.DataType) -> bool:
    """Whether a Parquet column's Arrow type is text (dictionary-encoded text included)."""
    kind = _stored(kind)
    return (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind))


def log_sql(shards: ShardSet, shard_rows: list[int], mapping: dict[str, str],
            schema: pa.Schema) -> str:
    """A SELECT of the log's rows as `load` reads them: `u`, `i` the ids as text, `t` the time
    in whole seconds, `f` the time at full precision (it tells rows apart and orders them
    below a second), `r` the rating (NULL without one) and `row` the position in the log."""
    time = schema.field(mapping["time"])
    row, scan = _scan(shards.files, shard_rows)
    user, item = (schema.field(mapping[role]) for role in ("user", "item"))
    return (f"SELECT {_id_sql(user)} AS u, {_id_sql(item)} AS i, {_time_sql(time)} AS t, "
            f"{_moment_sql(time)} AS f, {_rating_sql(mapping.get('rating'))} AS r, "
            f"{row} AS row FROM {scan}")


def known_sql(shards: ShardSet, mapping: dict[str, str]) -> str:
    """SQL condition on `i`: the item is in the item table (TRUE without one)."""
    if shards.items is None:
        return "TRUE"
    item = _schema(shards.items).field(mapping["item"])
    return f"i IN (SELECT {_id_sql(item)} FROM {read_parquet_sql([shards.items])})"


def _id_sql(field: pa.Field) -> str:
    """SQL for an id column as `load` reads it: text as NumPy writes it, bytes as UTF-8
    (CAST would write them as escapes, '\\xC3\\xA9'; `check_values` refuses those that are not
    UTF-8), a float as the float64 it is."""
    kind = _stored(field.type)
    if _is_binary(kind):
        return f"decode({_name(field.name)})"
    if pa.types.is_floating(kind):       # DuckDB may read float16 and float32 shards as FLOAT
        return f"CAST(CAST({_name(field.name)} AS DOUBLE) AS VARCHAR)"
    return f"CAST({_name(field.name)} AS VARCHAR)"


def read_parquet_sql(paths, *options: str) -> str:
    """DuckDB's `read_parquet` of exactly `paths`, in their order, as Arrow reads them: each
    path a file, not a glob (its `*`, `?` and `[` escaped: `p?1.parquet` also read
    `pa1.parquet`), and no `key=value` folder read as a column (it replaced the file's own
    column of that name)."""
    files = [re.sub(r"([*?\[])", r"[\1]", path) for path in paths]
    return f"read_parquet({', '.join([_sql_list(files), 'hive_partitioning=false', *options])})"


def _scan(files, shard_rows: list[int]) -> tuple[str, str]:
    """SQL for the shards' rows: (a row's position in the log, the scan of the shards with
    rows). An empty shard is left out: DuckDB would take an empty first shard's `null` types
    for every shard's."""
    files, shard_rows = zip(*((path, rows) for path, rows in zip(files, shard_rows) if rows))
    return _row_sql(shard_rows), read_parquet_sql(files, "file_row_number=true",
                                                  "union_by_name=true")   # `_widened`


def _in_its_shard(files, shard_rows: list[int], row: int) -> str:
    """A row of the log (`_row_sql`) as a user finds it: "500 of PATH", its row in its shard
    (from 0, as `load` counts a file's rows); just the row when the log is one file."""
    if len(files) == 1:
        return str(row)
    shard = int(np.searchsorted(np.cumsum(shard_rows), row, side="right"))
    return f"{row - sum(shard_rows[:shard])} of {files[shard]}"


def _row_sql(shard_rows: list[int]) -> str:
    """SQL for a row's position in the log: its file's offset plus its row in the file
    (`file_index` counts the files in the order given; DuckDB's `filename` is not always the
    path given, './a' comes back as 'a')."""
    offsets = np.concatenate([[0], np.cumsum(shard_rows)[:-1]]).astype(int).tolist()
    return f"{offsets}[CAST(file_index AS BIGINT) + 1] + file_row_number"


def whole_seconds(field: pa.Field) -> bool:
    """Whether a time column holds whole seconds by its type (integers, dates, timestamp[s],
    duration[s])."""
    return (pa.types.is_integer(field.type) or pa.types.is_date(field.type)
            or ((pa.types.is_timestamp(field.type) or pa.types.is_duration(field.type))
                and field.type.unit == "s"))


def _time_sql(field: pa.Field) -> str:
    """SQL for the int64 seconds `load` makes of the time column: integers as they are,
    timestamps and dates as whole seconds since the epoch, durations (DuckDB reads their
    ticks) as whole seconds, anything else through float64, truncated."""
    name = _name(field.name)
    if pa.types.is_integer(field.type):
        return f"CAST({name} AS BIGINT)"
    if pa.types.is_timestamp(field.type):               # truncated, as `from_columns` divides
        if field.type.unit == "ns":
            return f"epoch_ns({name}) // 1000000000"
        return f"epoch_us({name}) // 1000000"          # beyond 1677-2262, which ns cannot hold
    if pa.types.is_duration(field.type):
        return f"{name} // {TICKS_PER_SECOND[field.type.unit]}"
    if pa.types.is_date(field.type):
        return f"CAST(epoch({name}) AS BIGINT)"
    return f"CAST(trunc(CAST({name} AS DOUBLE)) AS BIGINT)"


def _moment_sql(field: pa.Field) -> str:
    """SQL for the time at full precision, as `from_columns` compares it: numbers,
    timestamps and durations as they are, dates as seconds, anything else through float64."""
    if pa.types.is_date(field.type):
        return _time_sql(field)
    if (pa.types.is_integer(field.type) or pa.types.is_floating(field.type)
            or pa.types.is_timestamp(field.type) or pa.types.is_duration(field.type)):
        return _name(field.name)
    return f"CAST({_name(field.name)} AS DOUBLE)"


def _rating_sql(name: str | None) -> str:
    """SQL for the float32 rating `load` makes, or NULL without a rating column."""
    return "NULL" if name is None else f"CAST(CAST({_name(name)} AS DOUBLE) AS FLOAT)"


def _name(column: str) -> str:
    return '"' + column.replace('"', '""') + '"'


def _sql_list(paths) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


# ---------------------------------------------------------------- writing synthetic shards


def main(argv=None) -> int:
    """Writes a synthetic preset's log as Parquet shards; one JSON line with rows and rows/s."""
    from tworec.features.synthetic import PRESETS, ROWS_PER_SHARD, write_shards
    parser = OneLineParser(description="Writes a synthetic log as Parquet shards in bounded "
                                       "memory.")
    parser.add_argument("--synthetic", default="default", choices=sorted(PRESETS),
                        metavar="PRESET", help="the generator's sizes: "
                        f"{', '.join(sorted(PRESETS))} (100m: about 100 million rows)")
    parser.add_argument("--out", required=True, help="a new or empty folder for the shards")
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0)")
    parser.add_argument("--rows-per-shard", type=int, default=ROWS_PER_SHARD,
                        help=f"rows of one shard, a chunk of users (default {ROWS_PER_SHARD:,})")
    args = parser.parse_args(argv)
    if args.rows_per_shard < 1:
        parser.error(f"--rows-per-shard must be at least 1, got {args.rows_per_shard}")
    started = time.perf_counter()
    rows = []

    def progress(path: str, count: int) -> None:
        rows.append(count)
        print(f"[shards] {path}: {count:,} rows", file=sys.stderr, flush=True)

    try:
        paths = write_shards(PRESETS[args.synthetic], args.out, seed=args.seed,
                             rows_per_shard=args.rows_per_shard, progress=progress)
    except FileExistsError as error:
        print(f"error: --out {error}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - started
    print(json.dumps({"out": args.out, "synthetic": args.synthetic, "seed": args.seed,
                      "shards": len(paths), "rows": sum(rows), "seconds": round(seconds, 1),
                      "rows_per_second": round(sum(rows) / seconds)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
