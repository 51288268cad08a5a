"""Readers that turn every supported log into the same columnar `Interactions`.

Sources: `synthetic`, `tfds:NAME` (MovieLens configs of TensorFlow Datasets), a GroupLens release
(folder or `.zip`; ml-100k, ml-1m, ml-latest(-small), ml-20m, ml-25m, detected from file names),
a generic CSV / Parquet log with a column mapping, or Parquet shards (`features.shards`). Files
are parsed by Arrow in blocks; no code here loops over rows in Python. A text log's delimiter is
detected from its header unless given; a file that is not UTF-8 text is refused before it is
parsed.
"""
from __future__ import annotations

import codecs
import collections
import dataclasses
import datetime
import decimal
import math
import os
import re
import socket
import urllib.parse
import urllib.request
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from tworec.features.interactions import (DataError, Interactions, SourceNotFound,
                                          drop_duplicate_rows, first_appearance)
from tworec.features.splits import HELD_OUT_FROM

ML100K_GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime",
                 "Documentary", "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery",
                 "Romance", "Sci-Fi", "Thriller", "War", "Western")
TFDS_NAMES = ("100k", "1m", "latest-small", "25m")
TIE_SEED = 0                       # of the random order of a GroupLens release's ties
DEFAULT_COLUMNS = {"user": ("user_id", "userId", "user", "uid"),
                   "item": ("item_id", "movieId", "movie_id", "item", "iid"),
                   "time": ("timestamp", "time", "ts", "datetime"),
                   "rating": ("rating", "user_rating", "score")}
NO_RATING = "none"      # `--columns rating=none`: the log has no ratings, whatever its columns
BLOCK_SIZE = 16 << 20
TEXT_SUFFIXES = (".csv", ".tsv", ".txt")          # each also gzip-compressed, e.g. `.csv.gz`
DELIMITERS = (",", ";", "\t", "|")                 # detected from the header, in this order
DELIMITER_HELP = ("for .csv/.tsv/.txt logs: the character between fields, e.g. ';' or '\\t' "
                  "(default: detected from the header among , ; tab |; tab for .tsv)")


def load(source: str, columns: dict[str, str] | None = None, data_dir: str | None = None,
         seed: int = 0, delimiter: str | None = None) -> Interactions:
    """Loads an interaction log.

    Args:
        source: `synthetic`, `synthetic:PRESET`, `tfds:NAME` (e.g. `tfds:movielens/100k-ratings`),
            a GroupLens folder or `.zip`, a `.csv` / `.tsv` / `.txt` (each also as `.gz`) or
            `.parquet` file, or Parquet shards: a folder of `.parquet` files or a glob such as
            `logs/part-*.parquet` (`features.shards`).
        columns: for generic files, role -> column name: `user`, `item`, `time`, optional
            `rating`, and side features as `user.NAME` or `item.NAME`.
        data_dir: for `tfds:NAME` only: the TFDS data directory, e.g. holding a prepared copy.
        seed: seed of the synthetic generator.
        delimiter: for text logs, the character between fields (`\\t` or `tab` for a tab);
            None detects it from the header.
    """
    delimiter = _delimiter_option(source, delimiter)
    if data_dir is not None and not source.startswith("tfds:"):
        raise DataError(f"--data-dir {data_dir}: {source} is not a TensorFlow Datasets source; "
                        "the option applies only to tfds:NAME")
    if columns and has_fixed_columns(source):
        given = ",".join(f"{role}={name}" for role, name in columns.items())
        raise DataError(f"--columns {given}: {source} has fixed columns; the option applies "
                        "only to .csv/.tsv/.parquet logs and Parquet shards")
    if source == "synthetic" or source.startswith("synthetic:"):
        from tworec.features.synthetic import PRESETS, SHARDS_ONLY, generate
        preset = source.partition(":")[2] or "default"
        if preset not in PRESETS:
            raise DataError(f"unknown synthetic preset {preset!r}; known: {sorted(PRESETS)}")
        if preset in SHARDS_ONLY:
            raise DataError(f"{source}: too large to generate in memory; write it to Parquet "
                            f"shards (python -m tworec.features.shards --synthetic {preset} --out "
                            "DIR, or features.synthetic.write_shards) and pass the folder")
        return generate(PRESETS[preset], seed=seed, name=f"synthetic:{preset}")
    if source.startswith("tfds:"):
        return load_tfds(source[len("tfds:"):], data_dir=data_dir)
    from tworec.features import shards
    found = shards.find(source)                          # a folder or glob of Parquet shards
    if found is not None:
        return shards.read(found, columns or {})
    if not os.path.exists(source):
        raise SourceNotFound(f"{source or repr(source)}: no such file or folder (expected a "
                             "GroupLens release folder or .zip, a .csv/.tsv/.parquet log, a "
                             "folder or glob of .parquet shards, 'synthetic' or 'tfds:NAME')")
    if os.path.isdir(source) or source.endswith(".zip"):
        return load_grouplens(source)
    return load_table(source, columns or {}, delimiter)


def has_fixed_columns(source: str) -> bool:
    """Whether `source` gives a log whose columns are its own, which --columns cannot map:
    synthetic data, TFDS, a GroupLens release."""
    return _named_data(source) or is_release(source)


def _named_data(source: str) -> bool:
    """Whether `source` names data `load` makes or fetches (synthetic, TFDS), whatever a
    folder of that name holds."""
    return source == "synthetic" or source.startswith(("synthetic:", "tfds:"))


def is_release(source: str) -> bool:
    """Whether `source` is a GroupLens release: a folder or `.zip` holding one (a folder of
    Parquet shards is read as shards first, and synthetic and TFDS names as theirs, as `load`
    does)."""
    if _named_data(source):
        return False
    from tworec.features import shards
    try:
        if not ((os.path.isdir(source) or source.endswith(".zip")) and os.path.exists(source)
                and shards.find(source) is None):
            return False
        release = _Release(source)
    except DataError:                               # an empty folder, a zip it cannot read
        return False
    try:
        return _release_reader(release) is not None
    finally:
        release.close()


def _delimiter_option(source: str, text: str | None) -> str | None:
    """The one character `text` names as a delimiter, or None; a DataError for a source that is
    not a text log or for anything Arrow cannot split on."""
    if text is None:
        return None
    if _text_suffix(source) is None:
        raise DataError(f"--delimiter {text!r}: {source} is not a text log; the option applies "
                        f"only to {', '.join(TEXT_SUFFIXES)} files")
    delimiter = {"\\t": "\t", "tab": "\t"}.get(text, text)
    if len(delimiter) != 1 or delimiter in '"\r\n':
        raise DataError(f"--delimiter {text!r}: expected one character, such as ',', ';', '|' "
                        "or \\t for a tab")
    return delimiter


def from_columns(source: str, user, item, timestamp, rating=None, *, catalogue=None,
                 item_features=None, genre_names=(), user_table=None, user_rows=None,
                 item_rows=None, dropped=None, names=None) -> Interactions:
    """Validates raw columns and encodes them as `Interactions`.

    Args:
        source: name used in error messages.
        user, item: [n] ids, any dtype; compared as strings, none empty or missing.
        timestamp: [n] numbers, datetime64, timedelta64 (seconds from an origin), Python
            dates or datetimes (aware ones in UTC) or text (numbers or ISO dates and times),
            made whole seconds (truncated). Below a second
            the full-precision time still tells rows apart (they are not duplicates) and
            orders them: a user's rows of one second are placed in their true order among
            the positions they hold, so that ties of whole seconds in log order are the true
            order (`prepare._labelled_sql` does the same in SQL).
        rating: [n] numeric or None.
        catalogue: [num_items] item ids of the item table, or None to use the log's items.
            Rows whose item is not in it are dropped and counted.
        item_features: name -> [num_items, ...] aligned with `catalogue`.
        user_table: (ids [u], name -> [u] features) or None.
        user_rows: name -> [n] each row's user feature (a log's `user.NAME` column), or None;
            instead of `user_table`. Each user's last value in file order makes the table; a
            feature whose value changes within a user also keeps its rows' values
            (`Interactions.user_feature_at`).
        item_rows: name -> [n] each row's item feature (a log's `item.NAME` column), or None:
            each item's last value among the kept rows in file order, beside `item_features`;
            items of the catalogue the log lacks get '' or 0.
        dropped: counts of rows already dropped by the reader.
        names: role (user, item, time, rating) -> column name, for messages.
    """
    names = {**ROLE_NAMES, **(names or {})}
    dropped = dict(dropped or {})
    (user_text, user), (item_text, item) = (
        id_codes(source, names[role], ids) for role, ids in (("user", user), ("item", item)))
    if len(user) == 0:
        raise DataError(f"{source}: the log is empty")
    for role, text, codes in (("user", user_text, user), ("item", item_text, item)):
        empty = np.flatnonzero(np.isin(codes, np.flatnonzero(text == "")))
        if len(empty):
            raise empty_ids_error(source, names[role], len(empty), int(empty[0]))
    seconds, moment = _times(source, names["time"], timestamp)
    rating = None if rating is None else _ratings_float32(source, names["rating"], rating)
    keep = drop_duplicate_rows(user, item, moment, rating)
    _count(dropped, "duplicate_row", len(keep) - int(keep.sum()))
    if catalogue is not None:
        catalogue = np.asarray(catalogue).astype(str)
        position, found = _positions(catalogue, item_text)
        item_codes, known = position[item], found[item]
        _count(dropped, "item_not_in_catalogue", int((keep & ~known).sum()))
        if not (keep & known).any():
            raise no_known_items_error(source, item_text[item[0]], catalogue[:1])
        keep &= known
    rows = np.flatnonzero(keep)
    users, user_codes = first_appearance(user[rows])
    user_ids = user_text[users]
    if moment is not seconds:
        rows = rows[_true_order_within_seconds(user_codes, seconds[rows], moment[rows])]
    if catalogue is None:
        items, item_codes = first_appearance(item[rows])
        item_ids = item_text[items]
        item_features = {}
    else:
        item_ids, item_codes = catalogue, item_codes[rows].astype(np.int32)
    feature_rows = {name: np.asarray(values)[rows] for name, values in (user_rows or {}).items()}
    kept = np.sort(rows)                                          # in file order
    if feature_rows:
        user_table = _last_per_id((user_text, user[kept]), _taken(user_rows, kept))
    if item_rows:                                    # as the users': of the kept rows only
        item_features = {**(item_features or {}), **_align_features(
            item_ids, _last_per_id((item_text, item[kept]), _taken(item_rows, kept)))}
    changing = {name: values for name, values in feature_rows.items()
                if _changes_within(user_codes, values)}
    return Interactions(user_ids=user_ids, item_ids=item_ids, user=user_codes, item=item_codes,
                        timestamp=seconds[rows], rating=None if rating is None else rating[rows],
                        item_features=dict(item_features or {}),
                        user_features=_align_features(user_ids, user_table),
                        user_feature_rows=changing, genre_names=tuple(genre_names),
                        dropped=dropped, source=source)


def _taken(features: dict, rows: np.ndarray) -> dict[str, np.ndarray]:
    """name -> [len(rows)] the `rows` of each of `features` (name -> [n])."""
    return {name: np.asarray(values)[rows] for name, values in features.items()}


def _changes_within(user: np.ndarray, values: np.ndarray) -> bool:
    """Whether some user of `user` [n] has two different `values` [n] (compared as text)."""
    _, value_codes = np.unique(np.asarray(values).astype(str), return_inverse=True)
    pairs = np.unique(user.astype(np.int64) * (int(value_codes.max(initial=0)) + 1)
                      + value_codes.reshape(-1))
    return len(pairs) > len(np.unique(user))


ROLE_NAMES = {"user": "user", "item": "item", "time": "timestamp", "rating": "rating"}


def id_codes(source: str, name: str, ids) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ids of a column as text, and each row's code.

    Text is as NumPy writes a value (a float32 as its float64), bytes (also a bytearray or
    memoryview) decoded as UTF-8; a missing id (None, NaN, pandas' NA) is refused, not read as
    the id "None" or "nan" (a list is looked through as given: NumPy would write a NaN among
    text as "nan"), as are bytes that are not UTF-8, ids holding a NUL (NumPy's text drops a
    trailing one) and dates, times and booleans (`id_type_error`). Only the distinct ids
    become fixed-width text: one long id costs its length once, not once a row.

    Returns:
        (text [d] str, distinct, codes [n] int64 with text[codes] the rows' ids).
    """
    listed = isinstance(ids, (list, tuple))
    if listed:                                   # NumPy would read a bytearray as numbers
        ids = [bytes(value) if isinstance(value, BYTES_LIKE) else value for value in ids]
    natural = np.asarray(ids)
    if natural.ndim != 1:
        raise DataError(f"{source}: column {name!r} is of shape {natural.shape}; give one id a "
                        "row, a flat list or array")
    if natural.dtype.kind in "bmM":
        raise id_type_error(source, name, natural.dtype)
    if (listed and natural.dtype.kind in "iuf"
            and any(isinstance(value, (bool, np.bool_)) for value in ids)):
        raise id_type_error(source, name, "bool")            # NumPy made them numbers
    if listed and natural.dtype.kind in "US":
        natural = np.asarray(ids, dtype=object)     # as given: NumPy's text would drop a
    elif natural.dtype.kind == "S":                 # trailing NUL and write a NaN as "nan"
        natural = natural.astype(object)            # bytes without NumPy's NUL padding
    if natural.dtype.kind == "f":
        _refuse(source, name, np.isnan(natural), "missing values")
    elif natural.dtype == object:
        _refuse(source, name, _missing(natural), "missing values")
    text = _arrow_text(natural)
    if text is None and natural.dtype == object:        # not all text: each as str() writes
        values = natural.tolist()                       # it (a list of 1 and "1")
        odd = next((value for value in values if isinstance(value, NOT_IDS)), None)
        if odd is not None:
            raise id_type_error(source, name, type(odd).__name__)
        written = [_written(value) for value in values]
        bad = np.flatnonzero(np.equal(np.array(written, dtype=object), None))
        if len(bad):
            raise not_utf8_ids_error(source, name, len(bad), int(bad[0]))
        text = pa.array(written, pa.string())
    if text is not None:
        distinct = pc.unique(text)                      # text may be chunked (> 2 GiB)
        codes = pc.index_in(text, value_set=distinct).to_numpy()
        nul = np.flatnonzero(pc.match_substring(distinct, NUL).to_numpy(zero_copy_only=False))
        if len(nul):
            rows = np.flatnonzero(np.isin(codes, nul))
            raise nul_ids_error(source, name, len(rows), int(rows[0]))
        _refuse_wide_ids(source, name, distinct, codes)
        written = distinct.to_numpy(zero_copy_only=False).astype(str)
    else:                                               # numbers
        if natural.dtype.kind == "f" and natural.itemsize < 8:
            natural = natural.astype(np.float64)        # NumPy's float32 text is DuckDB's not
        keys = (natural.view(f"u{natural.itemsize}")    # a float by its bits: -0.0 writes
                if natural.dtype.kind == "f" and natural.itemsize in (2, 4, 8) else natural)
        _, first, codes = np.unique(keys, return_index=True, return_inverse=True)
        written = natural[first].astype(str)
    text, merged = np.unique(written, return_inverse=True)   # one id a text (1 and "1")
    return text, merged[codes.reshape(-1)].astype(np.int64)


BYTES_LIKE = (bytes, bytearray, memoryview)    # ids as bytes, decoded as UTF-8
ID_TABLE_BYTES = 1 << 30       # a column's distinct ids as fixed-width NumPy text: past it,
ID_WIDTH_WASTE = 4             # refused when the longest id makes them this many times the text


def _refuse_wide_ids(source: str, name: str, distinct: pa.Array, codes: np.ndarray) -> None:
    """A DataError naming the longest of `distinct` ([d] Arrow text) and its first row (of
    `codes` [n]) when the ids as fixed-width NumPy text (4 bytes a character of the longest,
    each) would take more than ID_TABLE_BYTES and ID_WIDTH_WASTE times their own characters:
    a few long ids among short ones (many ids of one width, UUIDs, take what they hold)."""
    lengths = pc.utf8_length(distinct)
    longest = pc.max(lengths).as_py() or 0
    size = 4 * longest * len(distinct)
    held = max(pc.sum(lengths).as_py() or 0, len(distinct))               # characters
    if size <= ID_TABLE_BYTES or longest * len(distinct) <= ID_WIDTH_WASTE * held:
        return
    row = int(np.flatnonzero(codes == pc.index(lengths, longest).as_py())[0])
    raise DataError(f"{source}: column {name!r} has an id of {longest:,} characters (first at "
                    f"row {row}) among {len(distinct):,} distinct ids, which as fixed-width text "
                    f"would take {size / 2**30:.1f} GiB (at most {ID_TABLE_BYTES / 2**30:g} "
                    "GiB); give shorter ids (map them to integers, or check that the role "
                    "reads the id column)")


def _missing(values: np.ndarray) -> np.ndarray:
    """[n] bool: which values of an object array are missing: None, a NaN (a float's or a
    Decimal's, signalling ones too, which refuse to be compared) or a value unequal to itself
    but not false (pandas' NA)."""
    try:
        return np.equal(values, None) | np.not_equal(values, values)
    except (decimal.InvalidOperation, TypeError, ValueError):
        return np.array([_is_missing(value) for value in values.tolist()], bool)


def _is_missing(value) -> bool:
    """`_missing` of one value."""
    if value is None:
        return True
    if isinstance(value, decimal.Decimal):
        return value.is_nan()
    unequal = value != value
    return not isinstance(unequal, (bool, np.bool_)) or bool(unequal)


def _written(value) -> str | None:
    """An id as text: bytes (and bytearrays, memoryviews) decoded as UTF-8 (None if they are
    not), anything else as str() writes it."""
    if isinstance(value, (np.float16, np.float32)):
        return str(float(value))                    # as its float64, as in an array
    if not isinstance(value, BYTES_LIKE):
        return str(value)
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        return None


def empty_ids_error(source: str, name: str, count: int, first: int | str) -> DataError:
    """`first`: the first such row, or where it is ("500 of PATH", `shards._in_its_shard`)."""
    return DataError(f"{source}: column {name!r} has {count} empty ids (first at row {first}); "
                     "every row needs a user and an item id")


def not_utf8_ids_error(source: str, name: str, count: int, first: int | str) -> DataError:
    """`first`: as for `empty_ids_error`."""
    return DataError(f"{source}: column {name!r} has {count} ids that are not UTF-8 text "
                     f"(first at row {first}); write the ids as text (bytes such as UUIDs as "
                     "hex)")


NUL = "\x00"


def nul_ids_error(source: str, name: str, count: int, first: int | str) -> DataError:
    """`first`: as for `empty_ids_error`."""
    return DataError(f"{source}: column {name!r} has {count} ids holding a NUL character "
                     f"(first at row {first}); strip it from the ids (a fixed-width export "
                     "pads them with NULs)")


NOT_IDS = (bool, np.bool_, datetime.date, datetime.time, datetime.timedelta, np.datetime64,
           np.timedelta64)            # Python's and NumPy's values `id_type_error` refuses


def id_type_error(source: str, name: str, kind) -> DataError:
    """An id column of dates, times or booleans (NumPy dtype or Arrow type `kind`): in memory
    and out of core would write them as different text."""
    return DataError(f"{source}: column {name!r} holds {kind} values, which are not read as "
                     "ids; map the role to a column of text or integer ids, or write these "
                     "as text")


def no_known_items_error(source: str, log_item: str, table_items) -> DataError:
    sample = f"{str(table_items[0])!r}" if len(table_items) else "none: it is empty"
    return DataError(f"{source}: no interaction's item is in the item table (the log has "
                     f"{str(log_item)!r}, the item table {sample}); write the item table's id "
                     "column with the log's item ids")


TICKS_PER_SECOND = {"s": 1, "ms": 1000, "us": 1000_000, "ns": 1000_000_000}


def _times(source: str, name: str, values) -> tuple[np.ndarray, np.ndarray]:
    """([n] int64 whole seconds, truncated toward zero, [n] the times at full precision): the
    same array twice when every time is a whole second (nothing below a second to order by).
    Text is read as a text log's time column is (`_as_number`: numbers, else ISO dates and
    times); a duration counts its whole seconds, as from an origin. Missing (NaT), infinite
    and out-of-range times are refused, and text mixing numbers and dates."""
    values = _from_text(source, name, _numpy_times(source, name, _python_times(
        source, name, np.asarray(values))), TIME_TYPES)
    if values.dtype.kind in "mM":      # a timestamp, date or duration column, in its own unit
        _refuse(source, name, np.isnat(values), "missing values")
        unit, count = np.datetime_data(values.dtype)
        if unit == "generic":
            raise DataError(f"{source}: column {name!r} is a {values.dtype} without a unit; "
                            f"give it one (values.astype('{values.dtype.kind}8[s]'))")
        if count != 1:                                     # 10 ms, 2 D, 3 ps: one tick
            values = _in_finer_unit(source, name, values, unit)
        if unit in COARSE_UNITS:                           # days, hours, ...: seconds
            values, unit = _in_finer_unit(source, name, values, "s"), "s"
        elif unit not in TICKS_PER_SECOND:                 # ps, fs, as: ns, truncated
            values, unit = values.astype(f"{values.dtype.kind}8[ns]"), "ns"
        ticks = values.view(np.int64)
        per_second = TICKS_PER_SECOND[unit]
        below = np.fmod(ticks, per_second)
        seconds = (ticks - below) // per_second
        return seconds, (ticks if below.any() else seconds)
    _refuse_mixed_times(source, name, values)
    _numpy_times(source, name, values, every=True)     # not text: NumPy times among numbers?
    if values.dtype.kind == "b":                   # NumPy would read them as 0 and 1
        raise DataError(f"{source}: column {name!r} is of type bool, which is not read as a "
                        "time: write it as numbers, dates or times")
    values = _numeric(source, name, values, "neither all numbers nor all ISO dates and times")
    if values.dtype.kind in "fu":
        _refuse(source, name, ~(np.abs(values.astype(np.float64, copy=False)) < 2.0 ** 63)
                if values.dtype.kind == "f" else values > np.iinfo(np.int64).max, OUT_OF_RANGE)
    seconds = values.astype(np.int64)
    return seconds, (values if values.dtype.kind == "f" and (values != seconds).any()
                     else seconds)


OUT_OF_RANGE = "times that are infinite or beyond ±2^63 seconds"
RATINGS_OUT_OF_RANGE = "ratings that are infinite or beyond float32's ±3.4e38"
FLOAT32_OVERFLOW = 2.0 ** 128 - 2.0 ** 103      # from here on a double rounds to float32 inf
COARSE_UNITS = ("Y", "M", "W", "D", "h", "m")                 # NumPy's units above a second


def _python_times(source: str, name: str, values: np.ndarray) -> np.ndarray:
    """An object array of Python dates or datetimes (pandas Timestamps too; None where one is
    missing) as datetime64, read by Arrow: naive times as they are, aware ones in UTC, as a
    Parquet timestamp column is read. Other arrays as they are; only arrays whose first value
    not missing (None, NaN) is a date are looked through."""
    if values.dtype != object:
        return values
    present = next((value for value in values.flat if not (     # the first not missing
        value is None or isinstance(value, float) and math.isnan(value))), None)
    if not isinstance(present, datetime.date):
        return values
    try:                                      # from_pandas: NaN (a missing value) is a null
        return pa.array(values.reshape(-1), from_pandas=True).to_numpy(zero_copy_only=False)
    except (pa.ArrowException, ValueError, TypeError):
        raise DataError(f"{source}: column {name!r} holds Python dates beside date-times or "
                        "other values; give it dates only or date-times only") from None


def _numpy_times(source: str, name: str, values: np.ndarray, every: bool = False) -> np.ndarray:
    """An object array of NumPy datetime64 (or timedelta64) scalars of one type as an array of
    that type; other arrays as they are. Read as numbers, such scalars would be their counts
    of ticks, so scalars of several types (or among other values) are refused. Only arrays
    that start with one are looked through, unless `every` (to keep text cheap)."""
    times = (np.datetime64, np.timedelta64)
    if values.dtype != object or not len(values) or not (
            every and any(issubclass(kind, times) for kind in set(map(type, values.flat)))
            or isinstance(values.flat[0], times)):
        return values
    kinds = {value.dtype if isinstance(value, times) else type(value) for value in values.flat}
    if len(kinds) > 1:
        raise DataError(f"{source}: column {name!r} holds NumPy times of several types, or "
                        f"beside other values ({', '.join(sorted(map(str, kinds)))}); give them "
                        "one type (np.array(values, 'datetime64[s]'))")
    return np.array(list(values), dtype=kinds.pop())


def _in_finer_unit(source: str, name: str, values: np.ndarray, unit: str) -> np.ndarray:
    """NumPy times in a finer `unit`; those it cannot hold (NumPy wraps them around
    silently) refused as out of range."""
    converted = values.astype(f"{values.dtype.kind}8[{unit}]")
    _refuse(source, name, converted.astype(values.dtype) != values, OUT_OF_RANGE)
    return converted


def _ratings_float32(source: str, name: str, values) -> np.ndarray:
    """[n] float32 ratings; text read as a text log's, and missing, NaN, infinite and
    out-of-float32 ratings refused."""
    values = _numeric(source, name, _from_text(source, name, np.asarray(values),
                                               (pa.float64(),)))
    if values.dtype.kind == "f":
        _refuse(source, name, ~(np.abs(values.astype(np.float64, copy=False))
                                < FLOAT32_OVERFLOW), RATINGS_OUT_OF_RANGE)
    return values.astype(np.float32)


def _refuse_mixed_times(source: str, name: str, values: np.ndarray) -> None:
    """For text times no type read, some of which look like dates: a DataError naming the
    first value that looks like neither a number nor a date (else the first of the fewer
    kind), where `_numeric` would name the first date."""
    text = _arrow_text(values)
    if text is None:
        return
    date = pc.fill_null(pc.match_substring_regex(text, DATE_LIKE), False).to_numpy(
        zero_copy_only=False)
    if not date.any():
        return
    number = pc.fill_null(pc.match_substring_regex(text, NUMBER_LIKE), False).to_numpy(
        zero_copy_only=False)
    odd = np.flatnonzero(~date & ~number)
    if not len(odd) and date.all():
        first = _first_unreadable_time(text)
        raise DataError(f"{source}: column {name!r} holds ISO dates and times that no one "
                        f"timestamp type reads all of (first {str(values[first])!r}, at row "
                        f"{first}: an impossible date such as 2020-02-30, a time with an "
                        "offset beside times without one, or other text)")
    if not len(odd):                                   # numbers and dates: the fewer kind
        odd = np.flatnonzero(date if date.sum() <= number.sum() else ~date)
    first = odd[0]
    raise DataError(f"{source}: column {name!r} is neither all numbers nor all ISO dates and "
                    f"times (first odd value: {str(values[first])!r}, at row {first})")


def _refuse(source: str, name: str, wrong: np.ndarray, what: str) -> None:
    """A DataError counting the rows `wrong` [n] marks, and naming the first, if any."""
    rows = np.flatnonzero(wrong)
    if len(rows):
        raise DataError(f"{source}: column {name!r} has {len(rows)} {what} "
                        f"(first at row {rows[0]})")


def _arrow_text(values: np.ndarray) -> pa.Array | None:
    """[n] NumPy text as an Arrow string array; None when `values` are not all text."""
    if values.dtype.kind not in "OUS":
        return None
    try:
        return pa.array(values, pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):         # not all text: `_numeric` says why
        return None


def _from_text(source: str, name: str, values: np.ndarray,
               types: tuple[pa.DataType, ...]) -> np.ndarray:
    """`values` with text cast as a text log's column is (`_as_number` with `types`: Arrow's
    missing-value markers refused as missing); anything else, and text no type reads, as it
    is, for `_numeric` to name the first bad value."""
    text = _arrow_text(values)
    if text is None:
        return values
    column = _as_number(pa.table({name: text}), name, types).column(name)
    return values if pa.types.is_string(column.type) else _column_numpy(source, name, column)


def _true_order_within_seconds(user: np.ndarray, seconds: np.ndarray,
                               moment: np.ndarray) -> np.ndarray:
    """[n] rows that put each user's rows of one second in the order of `moment` (ties in log
    order) among the positions they hold; every other row stays where it is."""
    rows = np.arange(len(user))
    true = np.lexsort((rows, moment, seconds, user))       # each group's rows, in true order
    held = np.lexsort((rows, seconds, user))               # each group's positions, ascending
    placed = np.empty_like(rows)
    placed[held] = true
    return placed


def _positions(table: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Index of each of `values` ([n] str) in `table` ([d] str), and whether it is there."""
    if len(table) == 0:
        return np.zeros(len(values), dtype=np.int64), np.zeros(len(values), dtype=bool)
    order = np.argsort(table, kind="stable")
    position = np.minimum(np.searchsorted(table[order], values), len(table) - 1)
    return order[position], table[order[position]] == values


def _count(dropped: dict[str, int], reason: str, number: int) -> None:
    if number:
        dropped[reason] = dropped.get(reason, 0) + number


def _numeric(source: str, name: str, values, wrong: str = "not numeric") -> np.ndarray:
    """[n] float64 or int64 values of a numeric column; a clear error otherwise, saying the
    column is `wrong`."""
    values = np.asarray(values)
    if values.dtype.kind not in "iuf":
        try:
            text = _arrow_text(values)
            if text is not None and pc.all(pc.string_is_ascii(text)).as_py() is False:
                raise ValueError("not ASCII")                        # '١', '０', '1\xa0'
            values = values.astype(np.float64)
        except (TypeError, ValueError):
            row = next(row for row, value in enumerate(values) if not _parses(value))
            raise DataError(f"{source}: column {name!r} is {wrong} (first value that is not a "
                            f"number: {str(values[row])!r}, at row {row}"
                            f"{decimal_comma_advice(values[row])})") from None
    if values.dtype.kind == "f":
        _refuse(source, name, np.isnan(values), "missing or NaN values")
    return values


def decimal_comma_advice(value) -> str:
    """"; write numbers with a decimal point" when `value` reads as a number with a decimal
    comma (`3,5`), else ""."""
    return "; write numbers with a decimal point" if _parses(str(value).replace(",", ".")) else ""


def _parses(value) -> bool:
    """Whether `value` reads as a number as out of core (DuckDB) reads text too: ASCII only
    (Python's float() also reads Arabic-Indic and full-width digits and Unicode spaces)."""
    if isinstance(value, str) and not value.isascii():
        return False
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False


def _align_features(ids: np.ndarray, table) -> dict[str, np.ndarray]:
    """Features of a (table ids, name -> values) `table` of users or items reordered to
    `ids`; ids the table lacks get '' or 0."""
    if table is None:
        return {}
    table_ids, features = table
    position, found = _positions(np.asarray(table_ids).astype(str), ids)
    aligned = {}
    for name, values in features.items():
        values = np.asarray(values)[position]
        aligned[name] = np.where(found, values, "" if values.dtype.kind in "OUS" else 0)
    return aligned


# ---------------------------------------------------------------- GroupLens releases


RATINGS_FILES = ("u.data", "ratings.dat", "ratings.csv")     # one a release, by format


class _Release:
    """Files of a GroupLens release, in a folder or a `.zip`, found by their base names."""

    def __init__(self, path: str):
        self.path = path
        if path.endswith(".zip"):
            if not zipfile.is_zipfile(path):
                raise DataError(f"{path}: not a readable zip archive")
            self._zip = zipfile.ZipFile(path)
            names = [n for n in self._zip.namelist() if not n.endswith("/")]
        else:
            self._zip = None
            names = [os.path.relpath(os.path.join(d, f), path)
                     for d, _, files in os.walk(path) for f in files]
        self.files = {os.path.basename(n): n for n in sorted(names, key=len, reverse=True)}
        ratings = sorted(n for n in names if os.path.basename(n) in RATINGS_FILES)
        if len(ratings) > 1:
            shown = ", ".join(ratings[:3]) + (", ..." if len(ratings) > 3 else "")
            raise DataError(f"{path}: holds more than one release's ratings ({shown}); pass the "
                            "folder or .zip of one release")

    def has(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str) -> bytes:
        member = self.files[name]
        if self._zip is not None:
            return self._zip.read(member)
        with open(os.path.join(self.path, member), "rb") as f:
            return f.read()

    def where(self, name: str) -> str:
        return f"{self.path}:{self.files[name]}"

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()


def load_grouplens(path: str) -> Interactions:
    """Reads a GroupLens MovieLens release (folder or `.zip`), detecting the format."""
    release = _Release(path)
    reader = _release_reader(release)
    if reader is None:
        text = any(_text_suffix(name) for name in release.files)
        advice = ("; to read a text log, pass the file itself (a folder of text parts is not "
                  "read as one log: write them as Parquet shards)" if text else "")
        raise DataError(f"{path}: unknown format: expected u.data (ml-100k), ratings.dat (ml-1m, "
                        "ml-10m) or ratings.csv (ml-latest, ml-20m, ml-25m); found "
                        f"{sorted(release.files)[:10]}{advice}")
    return reader(release)


def _release_reader(release: _Release):
    """The reader of the release's format, by the ratings file it holds; None for none."""
    return _release_format(release)[0]


def _release_format(release: _Release):
    """(reader, {optional file: what its absence leaves out}) of the release's format, by the
    ratings file it holds; (None, {}) for none."""
    items, users = "items have no genres, year or title", "users have no age, gender or occupation"
    for name, reader, optional in (
            ("u.data", _read_ml100k, {"u.item": items, "u.user": users}),
            ("ratings.dat", _read_ml1m, {"movies.dat": items}),   # ml-10m has no users.dat
            ("ratings.csv", _read_ml_latest, {"movies.csv": items})):
        if release.has(name):
            return reader, optional
    return None, {}


def release_gaps(source: str) -> list[str]:
    """What a GroupLens release `source` (as `load` reads it) lacks of its format's optional
    files, one line each ("SOURCE has no movies.csv: items have no genres, year or title");
    [] for a complete release or any other source."""
    if not is_release(source):
        return []
    release = _Release(source)
    try:
        _, optional = _release_format(release)
        return [f"{source} has no {name} beside its ratings: its {left_out}"
                for name, left_out in optional.items() if not release.has(name)]
    finally:
        release.close()


def _read_delimited(release: _Release, name: str, names: list[str], delimiter: str,
                    encoding: str = "utf8", header: bool = False, types=None) -> pa.Table:
    """Parses one delimited file of a release with Arrow; `::` is mapped to a single byte, and
    other encodings than UTF-8 are decoded here (Arrow's transcoding would call Python's codecs
    from its threads: see `_in_arrow_memory`)."""
    data = release.read(name)
    if encoding != "utf8":
        data = data.decode(encoding).encode()
    if delimiter == "::":
        data, delimiter = data.replace(b"::", b"\x1f"), "\x1f"
    source = _in_arrow_memory(data)
    del data                                  # only Arrow's copy is kept while it is parsed
    read = pacsv.ReadOptions(column_names=None if header else names, block_size=BLOCK_SIZE)
    parse = pacsv.ParseOptions(delimiter=delimiter, quote_char='"' if header else False)
    convert = pacsv.ConvertOptions(column_types=types or {}, strings_can_be_null=False)
    try:
        table = pacsv.read_csv(source, read_options=read, parse_options=parse,
                               convert_options=convert)
    except pa.ArrowInvalid as error:
        raise DataError(f"{release.where(name)}: cannot parse: {error}") from None
    missing = [c for c in names if c not in table.column_names]
    if missing:
        raise DataError(f"{release.where(name)}: missing required column(s) {missing}; "
                        f"found {table.column_names}")
    return table


def _ratings(release: _Release, name: str, table: pa.Table, roles: tuple[str, str, str, str],
             **tables) -> Interactions:
    """Interactions from a ratings table whose (user, item, rating, time) columns are `roles`,
    its ties of time shuffled (`_ties_shuffled`)."""
    user, item, rating, time = (_to_numpy(release.where(name), table, c) for c in roles)
    return _ties_shuffled(from_columns(release.path, user, item, time, rating, **tables))


def _ties_shuffled(log: Interactions) -> Interactions:
    """The log with each user's rows in time order and the rows of one user and second in a
    random order (seed `TIE_SEED`, the same on every load), for a GroupLens release. Ties keep
    the log's order (`Interactions.time_order`), and most releases list a user's ratings by
    movie id: the held-out last rating of a second would be its highest id. After
    `from_columns`, so that its messages name the file's rows."""
    shuffled = np.random.default_rng(TIE_SEED).permutation(len(log))
    return log.take(np.lexsort((shuffled, log.timestamp, log.user)))


def tie_order_notes(log: Interactions) -> list[str]:
    """One line when the log lists the rows of one user and timestamp by increasing item id, as
    GroupLens's ratings.csv does (read as a file), or by decreasing id: nine tied pairs in ten
    or more one way, and at least 20 rows and one in a hundred tied with the row before. Ties
    keep the log's order, which the models take for the order things happened, and the
    temporal protocol holds out a user's last row: mostly the highest (or lowest) id of its
    timestamp. Ids compare as numbers when all are decimal, else as text ('item_10' before
    'item_9'), so ids such as 'item_9' listed in their number order may be noted either way, or
    not at all. [] for any other log, and for a release, skipped without sorting (`load`
    shuffles its ties)."""
    if is_release(log.source):
        return []
    order = log.time_order()
    user, timestamp = log.user[order], log.timestamp[order]
    tied = (user[1:] == user[:-1]) & (timestamp[1:] == timestamp[:-1])        # [n - 1]
    if tied.sum() < max(20, len(log) / 100):
        return []
    ids = log.item_ids
    numeric = bool(np.char.isdecimal(ids).all() and np.char.str_len(ids).max() < 19)
    rank = np.empty(len(ids), np.int64)                                      # [I] in id order
    rank[np.argsort(ids.astype(np.int64) if numeric else ids, kind="stable")] = np.arange(len(ids))
    item = rank[log.item[order]]                                             # [n]
    up, down = tied & (item[1:] > item[:-1]), tied & (item[1:] < item[:-1])  # [n - 1]
    ordered, way, before = ((up, "increasing", "lower") if up.sum() >= down.sum() else
                            (down, "decreasing", "higher"))
    if ordered.sum() < 0.9 * tied.sum():
        return []
    last = np.flatnonzero(np.append(user[1:] != user[:-1], True))            # [U] positions
    held = last[np.bincount(log.user)[user[last]] >= HELD_OUT_FROM]          # test rows
    held_out = int(ordered[held - 1].sum())
    return [f"{log.source}: {math.floor(100 * tied.sum() / len(log))}% of its rows share their "
            f"user's timestamp with the row before, and it lists "
            f"{math.floor(100 * ordered.sum() / tied.sum())}% of those by {way} item id; ties "
            "keep the log's order, which models learn as the order things happened"
            + (f", and for {held_out} users the last row, which the temporal protocol holds "
               f"out, comes after a {before} id of its timestamp" if held_out else "")
            + ": write ties in the order they happened, or in a random one (README: Splits)"]


def _to_numpy(where: str, table: pa.Table, name: str) -> np.ndarray:
    return _column_numpy(where, name, table.column(name))


def _column_numpy(where: str, name: str, column: pa.ChunkedArray) -> np.ndarray:
    """[n] NumPy values of a column without missing values; timestamps and dates as
    datetime64 in their own unit (`from_columns` makes seconds of a time column)."""
    if column.null_count:
        _refuse(where, name, pc.is_null(column).to_numpy(zero_copy_only=False), "missing values")
    return column.to_numpy()


def _year_from_title(titles: pa.ChunkedArray) -> np.ndarray:
    """[n] int32 year in a trailing `(YYYY)` of each title, 0 when absent."""
    match = pc.extract_regex(titles, r"\((?P<year>\d{4})\)\s*$")
    years = pc.struct_field(match, "year").fill_null("0")
    return pc.cast(years, pa.int32()).to_numpy(zero_copy_only=False)


GENRES_TABLE_BYTES = 1 << 30    # at most, the dense multi-hot table of item.genres


def _multi_hot(genre_lists: pa.ChunkedArray, source: str,
               name: str) -> tuple[np.ndarray, tuple[str, ...]]:
    """[n, g] float32 multi-hot of `|`-joined genre strings, and the g genre names; a
    DataError naming the column `name` of `source` when the dense table would take more than
    GENRES_TABLE_BYTES."""
    lists = pc.split_pattern(genre_lists, "|").combine_chunks()
    flat = pc.utf8_trim_whitespace(lists.flatten())                    # "Action | Comedy"
    rows = pc.list_parent_indices(lists).to_numpy()
    names, codes = np.unique(flat.to_numpy(zero_copy_only=False).astype(str), return_inverse=True)
    listed = (names != "(no genres listed)") & (names != "")            # "", "Action|"
    size = 4 * len(lists) * int(listed.sum())                           # [n, g] float32
    if size > GENRES_TABLE_BYTES:
        raise DataError(f"{source}: column {name!r} (item.genres) has {int(listed.sum()):,} "
                        f"distinct genre names over {len(lists):,} items: its dense multi-hot "
                        f"table would take {size / 2**30:.1f} GiB (at most "
                        f"{GENRES_TABLE_BYTES / 2**30:g} GiB); map item.genres to a column of a "
                        "few genres joined by '|' (MovieLens has 20), or leave it out")
    matrix = np.zeros((len(lists), len(names)), dtype=np.float32)
    matrix[rows, codes] = 1.0
    return matrix[:, listed], tuple(names[listed])


def _read_ml100k(release: _Release) -> Interactions:
    ratings = _read_delimited(release, "u.data", ["user", "item", "rating", "time"], "\t")
    items = None
    if release.has("u.item"):
        genre_columns = [f"g{i}" for i in range(len(ML100K_GENRES))]
        table = _read_delimited(release, "u.item",
                                ["item", "title", "released", "video", "url"] + genre_columns,
                                "|", encoding="latin-1", types={"released": pa.string()})
        released = pc.utf8_slice_codeunits(table.column("released"), -4)
        year = pc.cast(pc.if_else(pc.match_substring_regex(released, r"^\d{4}$"), released, "0"),
                       pa.int32()).to_numpy(zero_copy_only=False)
        genres = np.stack([table.column(c).to_numpy() for c in genre_columns], 1).astype(np.float32)
        items = dict(catalogue=table.column("item").to_numpy().astype(str), genre_names=ML100K_GENRES,
                     item_features={"genres": genres, "year": year,
                                    "title": table.column("title").to_numpy(zero_copy_only=False).astype(str)})
    users = _user_table(release, "u.user", ["user", "age", "gender", "occupation", "zip"], "|")
    return _ratings(release, "u.data", ratings, ("user", "item", "rating", "time"),
                    user_table=users, **(items or {}))


def _read_ml1m(release: _Release) -> Interactions:
    ratings = _read_delimited(release, "ratings.dat", ["user", "item", "rating", "time"], "::")
    items = None
    if release.has("movies.dat"):
        table = _read_delimited(release, "movies.dat", ["item", "title", "genres"], "::",
                                encoding="latin-1")
        items = _movies_table(table, release.where("movies.dat"))
    users = _user_table(release, "users.dat", ["user", "gender", "age", "occupation", "zip"], "::")
    return _ratings(release, "ratings.dat", ratings, ("user", "item", "rating", "time"),
                    user_table=users, **(items or {}))


def _user_table(release: _Release, name: str, columns: list[str], delimiter: str):
    """(user ids [u] str, {feature: [u] str}) from a GroupLens user file, or None without one;
    every column but `user` and `zip` is a feature."""
    if not release.has(name):
        return None
    table = _read_delimited(release, name, columns, delimiter, types={"zip": pa.string()})
    return (table.column("user").to_numpy().astype(str),
            {c: table.column(c).to_numpy(zero_copy_only=False).astype(str)
             for c in columns if c not in ("user", "zip")})


def _read_ml_latest(release: _Release) -> Interactions:
    ratings = _read_delimited(release, "ratings.csv", ["userId", "movieId", "rating", "timestamp"],
                              ",", header=True)
    items = None
    if release.has("movies.csv"):
        table = _read_delimited(release, "movies.csv", ["movieId", "title", "genres"], ",",
                                header=True)
        items = _movies_table(table.rename_columns(
            ["item" if c == "movieId" else c for c in table.column_names]),
            release.where("movies.csv"))
    return _ratings(release, "ratings.csv", ratings, ("userId", "movieId", "rating", "timestamp"),
                    **(items or {}))


def _movies_table(table: pa.Table, where: str) -> dict:
    """Catalogue and item features of a movies table (file `where`) with item, title and
    `|`-joined genres."""
    genres, names = _multi_hot(table.column("genres"), where, "genres")
    titles = table.column("title")
    return dict(catalogue=table.column("item").to_numpy(zero_copy_only=False).astype(str),
                genre_names=names,
                item_features={"genres": genres, "year": _year_from_title(titles),
                               "title": titles.to_numpy(zero_copy_only=False).astype(str)})


# ---------------------------------------------------------------- generic CSV / Parquet


def parse_columns(text: str) -> dict[str, str]:
    """`user=a,item=b,time=c` -> {'user': 'a', 'item': 'b', 'time': 'c'}."""
    mapping = {}
    for part in filter(None, text.split(",")):
        role, sep, name = part.partition("=")
        if not sep or not role.strip() or not name.strip():
            raise DataError(f"--columns: {part!r} is not ROLE=COLUMN")
        role, name = role.strip(), name.strip()
        if role in ("user.", "item."):
            raise DataError(f"--columns: {part!r} names no feature; write {role}NAME={name}")
        if role in mapping:
            raise DataError(f"--columns: role {role!r} is given twice ({mapping[role]!r} and "
                            f"{name!r}); give each role once")
        mapping[role] = name
    return mapping


def load_table(path: str, columns: dict[str, str], delimiter: str | None = None) -> Interactions:
    """Reads a generic CSV, TSV or Parquet log.

    Args:
        path: the file.
        columns: role -> column name (`user`, `item`, `time`, optional `rating`, and
            `user.NAME` / `item.NAME` side features); missing roles are looked up among common
            names (user_id, userId, item_id, movieId, timestamp, rating, ...).
        delimiter: of a text log; None detects it from the header (a `.tsv` is tab-separated).
            Unless it is `,`, ratings written with a decimal comma (`3,5`) are read as numbers.
    """
    if path.endswith(".parquet"):
        mapping = _resolve_columns(path, _parquet_column_names(path), columns)
        table = _read_parquet(path, sorted(set(mapping.values())))
    else:
        delimiter, mapping = _text_columns(path, columns, delimiter)
        table = _read_text(path, mapping, delimiter)
    arrays = {name: _to_numpy(path, table, name) for name in table.column_names}
    return _log_from_roles(path, mapping, arrays)


def _log_from_roles(source: str, mapping: dict[str, str], arrays: dict[str, np.ndarray],
                    items: dict | None = None) -> Interactions:
    """`Interactions` from the columns `arrays` (name -> [n]) that `mapping` gives roles
    (`user`, `item`, `time`, optional `rating`, `user.NAME` and `item.NAME` side features,
    each id's last value in file order).

    Args:
        items: the catalogue, item features and genre names of an item table (as
            `from_columns` takes them), or None for the log's own items. Side features read
            from the log add to its features; items the log lacks get '' or 0.
    """
    values = {role: arrays[name] for role, name in mapping.items()}
    user, item = values.pop("user"), values.pop("item")
    rating = values.pop("rating", None)
    timestamp = values.pop("time")
    item_features = {}
    user_features = {}
    for role, column in values.items():
        kind, _, name = role.partition(".")
        if role == "item.genres":
            column = _genres_text(source, mapping[role], column, items)
        elif role == "item.year":
            column = whole_years(source, mapping[role], column)
        (user_features if kind == "user" else item_features)[name] = column
    interactions = from_columns(source, user, item, timestamp, rating, user_rows=user_features,
                                item_rows=item_features, names=mapping, **(items or {}))
    interactions = dataclasses.replace(interactions,
                                       unread_columns=getattr(mapping, "unread", ()))
    if "genres" in item_features:           # one text an item (no item table), then multi-hot
        genres, names = genres_multi_hot(interactions.item_features["genres"], source,
                                         mapping["item.genres"])
        interactions = dataclasses.replace(
            interactions, item_features={**interactions.item_features, "genres": genres},
            genre_names=names)
    return interactions


def _genres_text(source: str, name: str, values: np.ndarray, items: dict | None) -> np.ndarray:
    """[n] a log's `item.genres` column: text of genre names joined by `|`, as in MovieLens
    (`Action|Comedy`); `genres_multi_hot` reads it once it holds one value an item."""
    values = np.asarray(values)
    if items is not None or _arrow_text(values) is None:
        raise genres_error(source, name, items is not None)
    return values


def genres_error(source: str, name: str, beside_table: bool) -> DataError:
    """The DataError of an `item.genres` column beside an item table or, if not, not text."""
    if beside_table:
        return DataError(f"{source}: column {name!r} (item.genres) beside an item table: the "
                         "table's genres are the items' genres; leave item.genres out")
    return DataError(f"{source}: column {name!r} (item.genres) is not text; give each item's "
                     "genre names joined by '|' (Action|Comedy)")


def genres_multi_hot(values: np.ndarray, source: str,
                     name: str) -> tuple[np.ndarray, tuple[str, ...]]:
    """([n, g] float32 multi-hot, the g genre names) of [n] texts of names joined by `|`, the
    column `name` of `source` (`_multi_hot`)."""
    return _multi_hot(pa.chunked_array([pa.array(values, pa.string())]), source, name)


def whole_years(source: str, name: str, values: np.ndarray) -> np.ndarray:
    """[n] int32 of an `item.year` column (a log's or an item table's), refused unless whole
    numbers."""
    years = _numeric(source, name, _from_text(source, name, np.asarray(values), (pa.int64(),)),
                     NOT_YEARS)
    if years.dtype.kind == "f":
        _refuse(source, name, years != np.round(years), NOT_WHOLE_YEARS)
    _refuse(source, name, np.abs(years) >= 2 ** 31, YEARS_OUT_OF_RANGE)
    return years.astype(np.int32)


NOT_YEARS = "not years as item.year takes them, whole numbers such as 1995"
NOT_WHOLE_YEARS = "years that are not whole numbers"
YEARS_OUT_OF_RANGE = "years beyond ±2^31"


def _last_per_id(ids: tuple[np.ndarray, np.ndarray], features: dict[str, np.ndarray]):
    """(distinct ids [d] str, name -> [d] the last value of the feature in file order).

    Args:
        ids: (text [t], codes [n]) as `id_codes` gives them.
        features: name -> [n] values.
    """
    if not features:
        return None
    text, codes = ids
    reversed_codes, last = np.unique(codes[::-1], return_index=True)
    rows = len(codes) - 1 - last
    return text[reversed_codes], {name: values[rows] for name, values in features.items()}


def _parquet_column_names(path: str) -> list[str]:
    try:
        return parquet_file(path).schema_arrow.names
    except (pa.ArrowInvalid, OSError) as error:
        raise unreadable_parquet(path, error) from None


def unreadable_parquet(path: str, error: Exception) -> DataError:
    """The DataError of a `.parquet` file Arrow cannot read, saying so when it is text (a CSV
    named .parquet)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
        codecs.getincrementaldecoder("utf-8")().decode(head)   # a last character cut is text
        text = bool(head) and not head.startswith(b"PAR1") and b"\0" not in head
    except (OSError, UnicodeDecodeError):
        text = False
    advice = "; it is text, not Parquet (a CSV named .parquet?)" if text else ""
    return DataError(f"{path}: not a readable Parquet file: {_one_line(error).rstrip('.')}"
                     f"{advice}")


def _text_suffix(path: str) -> str | None:
    """`.csv`, `.tsv` or `.txt` for a text log (also when gzip-compressed), else None."""
    suffix = os.path.splitext(path[:-len(".gz")] if path.endswith(".gz") else path)[1]
    return suffix if suffix in TEXT_SUFFIXES else None


def _text_columns(path: str, columns: dict[str, str],
                  delimiter: str | None) -> tuple[str, dict[str, str]]:
    """The delimiter of a text log and its role -> column mapping; an explicit `delimiter` that
    does not split the header into the needed columns is a DataError naming both."""
    if _text_suffix(path) is None:
        raise DataError(f"{path}: unknown format: expected .csv, .tsv or .parquet, or a "
                        "GroupLens release folder or .zip")
    head = _text_head(path)
    detected = _detect_delimiter(path, head)
    if delimiter is None or delimiter == detected:
        return detected, _resolve_columns(path, _header_names(path, head, detected), columns)
    try:
        return delimiter, _resolve_columns(path, _header_names(path, head, delimiter), columns)
    except DataError:
        header = _first_lines(head, 1).decode("utf-8-sig", errors="replace")
        fits = len(_header_names(path, head, detected)) > 1
        advice = (f"it is {detected!r}-separated: pass --delimiter {detected!r} or leave it out"
                  if fits else "pass the character that separates its columns")
        raise DataError(f"{path}: --delimiter {delimiter!r} does not split the header "
                        f"{header!r} into the needed columns; {advice}") from None


def _first_unreadable_time(text) -> int:
    """The first row of ISO dates and times `text` ([n] Arrow text that no one timestamp type
    reads all of) whose rows up to it no one type reads: found by bisecting prefixes."""
    kinds = [kind for kind in TIME_TYPES if pa.types.is_timestamp(kind)]

    def readable(end: int) -> bool:
        for kind in kinds:
            try:
                pc.cast(text[:end], kind)
                return True
            except pa.ArrowInvalid:
                continue
        return False
    read, unread = 0, len(text)
    while unread - read > 1:
        middle = (read + unread) // 2
        read, unread = (middle, unread) if readable(middle) else (read, middle)
    return unread - 1


NOT_TEXT = {b"\x1f\x8b": "it is gzip-compressed: rename it {path}.gz and pass that",
            b"PAR1": "it is a Parquet file: rename it {stem}.parquet and pass that",
            b"\xff\xfe": "it is UTF-16 text: save it as UTF-8",
            b"\xfe\xff": "it is UTF-16 text: save it as UTF-8"}


def read_titles(path: str) -> dict[str, str]:
    """item id -> title from a text table with an item id column (any name the loader knows,
    e.g. GroupLens's `movieId`) and a `title` column: a GroupLens `movies.csv` as it is, or
    any other delimiter the loader detects.

    Raises:
        DataError: one line naming the file and what it lacks.
    """
    head = _text_head(path)
    delimiter = _detect_delimiter(path, head)
    names = _header_names(path, head, delimiter)
    ids = next((name for name in DEFAULT_COLUMNS["item"] if name in names), None)
    if ids is None or "title" not in names:
        raise DataError(f"{path}: needs an item id column (one of "
                        f"{', '.join(DEFAULT_COLUMNS['item'])}) and a title column; it has "
                        f"{', '.join(names)}")
    try:
        table = pacsv.read_csv(path, parse_options=pacsv.ParseOptions(delimiter=delimiter),
                               convert_options=pacsv.ConvertOptions(
                                   include_columns=[ids, "title"],
                                   column_types={ids: pa.string(), "title": pa.string()}))
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(f"{path}: cannot parse: {_one_line(error)}") from None
    return dict(zip(table.column(ids).to_pylist(), table.column("title").to_pylist()))


def _text_head(path: str) -> bytes:
    """The first 64 KiB of a text log (decompressed if `.gz`); a DataError saying what would
    work when its first KB is not UTF-8 text or it is empty."""
    try:
        with pa.input_stream(path) as stream:          # decompresses by the file's suffix
            head = stream.read(1 << 16)
    except OSError as error:                           # e.g. a .gz that is not gzip data
        advice = "; if it is not gzip-compressed, drop .gz from its name" if path.endswith(
            ".gz") else ""
        raise DataError(f"{path}: cannot read it: {_one_line(error)}{advice}") from None
    first = head[:1024]
    for signature, advice in NOT_TEXT.items():
        if first.startswith(signature):
            stem = os.path.splitext(path)[0]
            raise DataError(f"{path}: not a text CSV; {advice.format(path=path, stem=stem)}")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(first, final=False)
        problem = f"a NUL byte at offset {first.index(0)}" if 0 in first else None
    except UnicodeDecodeError as error:
        problem = f"a byte that is not UTF-8 at offset {error.start}"
    if problem:
        raise DataError(f"{path}: not a text CSV ({problem}); pass a UTF-8 .csv or .tsv "
                        "(or either gzip-compressed, as .csv.gz or .tsv.gz) or a .parquet file")
    if not head.strip():
        raise DataError(f"{path}: the log is empty")
    return head


def _detect_delimiter(path: str, head: bytes) -> str:
    """Tab for a `.tsv`; otherwise the one of DELIMITERS that splits the header into the most
    fields and the second line into as many (`,` on a tie)."""
    if _text_suffix(path) == ".tsv":
        return "\t"
    best, most = ",", 1
    for delimiter in DELIMITERS:
        try:
            fields = _parse_text(_first_lines(head, 2), delimiter).num_columns
        except pa.ArrowInvalid:                        # the second line splits differently
            continue
        if fields > most:
            best, most = delimiter, fields
    return best


def _header_names(path: str, head: bytes, delimiter: str) -> list[str]:
    """The column names of the header line, split by Arrow (quotes respected)."""
    try:
        return _parse_text(_first_lines(head, 1), delimiter).column_names
    except pa.ArrowInvalid as error:
        raise DataError(f"{path}: cannot parse the header: {_one_line(error)}") from None


def _first_lines(head: bytes, count: int) -> bytes:
    """The first `count` lines of `head` that are not empty (Arrow skips empty lines too)."""
    return b"\n".join([line for line in head.splitlines() if line][:count])


def _parse_text(lines: bytes, delimiter: str) -> pa.Table:
    """Arrow's table of a few whole lines (Arrow reads no header from a line without its end)."""
    return pacsv.read_csv(_in_arrow_memory(lines + b"\n"),
                          parse_options=pacsv.ParseOptions(delimiter=delimiter))


def _in_arrow_memory(data: bytes) -> pa.BufferReader:
    """A copy of `data` in Arrow's memory, for Arrow's CSV reader to read from. Its readahead
    runs on Arrow's threads, which need the interpreter's lock to read or release a Python
    object (`io.BytesIO`, or the bytes themselves); if the parse fails and the process exits at
    once, one still doing so during the interpreter's finalization aborts the process
    ("terminate called without an active exception", exit -6)."""
    copy = pa.allocate_buffer(len(data))                  # its exact size (a stream's doubles)
    pa.FixedSizeBufferWriter(copy).write(data)
    return pa.BufferReader(copy)


def unread_columns_note(names, offer_rating: bool) -> str:
    """One line naming a generic log's columns that no role reads, and how to read one (as
    the rating too when `offer_rating`: the log has none and `rating=none` was not given)."""
    first = names[0]
    ways = ([f"rating={first}"] if offer_rating else []) + [f"user.{first}={first}",
                                                             f"item.{first}={first}"]
    return (f"the log's columns {list(names)} are not read: map one with --columns, as "
            f"{', '.join(ways[:-1])} or {ways[-1]}")


# A data frame's index written beside its columns: pandas's in Parquet, `to_csv`'s unnamed one.
INDEX_COLUMN = re.compile(r"__index_level_\d+__|Unnamed: \d+|")


class ColumnMapping(dict):
    """role -> column name, as `_resolve_columns` finds it; `unread`: the file's other
    columns (`unread_of`); `unrated`: `rating=none` was given, so no column is the rating."""
    unread: tuple[str, ...] = ()
    unrated: bool = False

    @property
    def rating_open(self) -> bool:
        """No column is the rating, and `rating=none` was not given: one may be mapped."""
        return "rating" not in self and not self.unrated

    def unread_of(self, names) -> tuple[str, ...]:
        """The columns of `names` that no role reads, but a data frame's index."""
        return tuple(name for name in names
                     if name not in self.values() and not INDEX_COLUMN.fullmatch(name))


def _header_mistake(names: list[str], wanted) -> str:
    """What a header that no mapping can read needs ("" for none): one column holding another
    delimiter, or `wanted` names with spaces around them (after ", "), which --columns cannot
    give."""
    if len(names) == 1:
        delimiter = next((d for d in ",;|\t" if d in names[0]), None)
        if delimiter is not None:
            return f"the header is one column: pass --delimiter {delimiter!r}"
    spaced = [name for name in names if name != name.strip() and name.strip() in wanted]
    if spaced:
        return (f"the header names {spaced[:3]} have spaces around them, which --columns "
                "cannot name: write the file without them")
    return ""


def _spaced_note(names: list[str]) -> str:
    """' (...)' naming the header names with spaces around them, which --columns cannot name
    (the column of a role may be one of them), or ''."""
    spaced = [name for name in names if name != name.strip()]
    return (f" (the header names {spaced[:3]} have spaces around them, which --columns cannot "
            "name: write the file without them to map one)" if spaced else "")


def _resolve_columns(path: str, names: list[str], columns: dict[str, str]) -> ColumnMapping:
    for role in columns:                      # a misspelt role first, not the role it missed
        if role not in DEFAULT_COLUMNS and not role.startswith(("user.", "item.")):
            raise DataError(f"--columns: unknown role {role!r}; use user, item, time, rating, "
                            "user.NAME or item.NAME")
    mapping = ColumnMapping()
    for role, candidates in DEFAULT_COLUMNS.items():
        if role in columns:
            mapping[role] = columns[role]
        elif (found := next((c for c in candidates if c in names), None)) is not None:
            mapping[role] = found
        elif role != "rating":
            raise DataError(f"{path}: missing required column for {role!r}: none of "
                            f"{list(candidates)} is present (columns: {names}); "
                            + (_header_mistake(names, candidates)
                               or f"map it with --columns {role}=NAME" + _spaced_note(names)))
    for role, name in columns.items():
        mapping[role] = name
    mapping.unrated = mapping.get("rating") == NO_RATING
    if mapping.unrated:
        del mapping["rating"]
    for role, name in mapping.items():
        if name not in names:
            mistake = _header_mistake(names, [name])
            raise DataError(f"{path}: missing required column {name!r} (for {role}); "
                            f"columns: {names}" + (f"; {mistake}" if mistake else ""))
    counts = collections.Counter(names)
    for role, name in mapping.items():
        if counts[name] > 1:
            raise DataError(f"{path}: the column {name!r} (for {role}) is in the header "
                            f"{counts[name]} times; give the columns distinct names")
    roles_of = collections.defaultdict(list)                  # column -> the core roles it has
    for role in DEFAULT_COLUMNS:
        if role in mapping:
            roles_of[mapping[role]].append(role)
    for name, roles in roles_of.items():
        if len(roles) > 1:
            found = "rating" in roles and "rating" not in columns     # a common name, not given
            raise DataError(f"{path}: the column {name!r} would be read as both {roles[0]} and "
                            f"{roles[1]}; give each of user, item, time and rating a column of "
                            "its own (--columns ROLE=COLUMN"
                            + (f", or rating={NO_RATING} for a log without ratings)" if found
                               else ")"))
    mapping.unread = mapping.unread_of(names)
    return mapping


# INT96 timestamps (Spark's, Hive's and Impala's legacy ones) in microseconds, as DuckDB reads
# them: Arrow's default, nanoseconds, wraps dates after 2262 around in silence.
INT96_UNIT = "us"


def parquet_file(path: str) -> pq.ParquetFile:
    """A Parquet file, its INT96 timestamps read in `INT96_UNIT`."""
    return pq.ParquetFile(path, coerce_int96_timestamp_unit=INT96_UNIT)


def _read_parquet(path: str, include: list[str]) -> pa.Table:
    """Reads the needed columns a row group at a time."""
    parquet = parquet_file(path)
    try:
        batches = list(parquet.iter_batches(columns=include, batch_size=1 << 20))
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(f"{path}: cannot parse: {_one_line(error)}") from None
    return pa.Table.from_batches(batches, schema=parquet.schema_arrow.empty_table()
                                 .select(include).schema)


def _read_text(path: str, mapping: dict[str, str], delimiter: str) -> pa.Table:
    """Reads the needed columns in blocks of 16 MiB (decompressed if `.gz`). Ids are read as
    text (`007` is not `7`; an unquoted `NA`, `null`, ... is missing, a quoted `"NA"` an id, as
    R writes them); time and rating as text too, then cast as whole columns by `_as_number`,
    so that no late row can break a type inferred from the first block."""
    roles = {role: name for role, name in mapping.items()
             if role in ("user", "item", "time", "rating")}
    table = _read_csv(path, delimiter, sorted(set(mapping.values())),
                      column_types={name: pa.string() for name in roles.values()},
                      null_values=MISSING_IDS.to_pylist(), strings_can_be_null=True,
                      quoted_strings_can_be_null=False)
    texts = [name for name in table.column_names if name not in roles.values()
             and pa.types.is_string(table.column(name).type) and table.column(name).null_count]
    if texts:                  # side features' text, as Arrow reads it by default: NA is text
        again = _read_csv(path, delimiter, texts, column_types={n: pa.string() for n in texts})
        for name in texts:
            table = table.set_column(table.column_names.index(name), name, again.column(name))
    table = _as_number(table, mapping["time"], TIME_TYPES)
    if "rating" in mapping:
        table = _as_number(table, mapping["rating"], (pa.float64(),),
                           decimal_comma=delimiter != ",")
    return table


def _read_csv(path: str, delimiter: str, columns: list[str], **convert) -> pa.Table:
    """The `columns` of a text log, read in blocks of 16 MiB with `pyarrow.csv.ConvertOptions`
    `convert`; a DataError naming the file when it does not parse."""
    try:
        return pacsv.open_csv(path, read_options=pacsv.ReadOptions(block_size=BLOCK_SIZE),
                              parse_options=pacsv.ParseOptions(delimiter=delimiter),
                              convert_options=pacsv.ConvertOptions(include_columns=columns,
                                                                   **convert)).read_all()
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(f"{path}: cannot parse: {_one_line(error)}") from None


TIME_TYPES = (pa.int64(), pa.float64(), pa.timestamp("ns"), pa.timestamp("ns", tz="UTC"),
              pa.timestamp("us"), pa.timestamp("us", tz="UTC"))   # us: before 1677, after 2262
DATE_LIKE = r"^\s*[+-]?\d{4,}-\d\d-\d\d"        # text a timestamp cast may read
NUMBER_LIKE = r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$"
MISSING = pa.array(pacsv.ConvertOptions().null_values)        # Arrow's markers of a missing value
MISSING_IDS = pc.filter(MISSING, pc.not_equal(MISSING, ""))   # an empty id has its own message


def _marked_missing(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """A text column with Arrow's missing-value markers (empty, `NA`, `null`, `nan`, ...) as
    missing values, as Arrow reads them in a column it types itself."""
    return pc.if_else(pc.is_in(column, value_set=MISSING), pa.scalar(None, pa.string()), column)


def _as_number(table: pa.Table, name: str, types: tuple[pa.DataType, ...],
               decimal_comma: bool = False) -> pa.Table:
    """`table` with its text column `name` cast to the first of `types` that reads all of it,
    Arrow's missing-value markers (empty, `NA`, `nan`, ...) as missing and, with
    `decimal_comma`, `3,5` as 3.5 when nothing else fits; left as text when no type fits,
    for `_numeric` to name the first bad value."""
    text = _marked_missing(table.column(name))
    tries = [text, pc.replace_substring(text, ",", ".")] if decimal_comma else [text]
    for candidate in tries:
        for kind in types:
            if pa.types.is_timestamp(kind) and not _dates_only(candidate):
                continue                                  # a cast that fails, and slowly
            if pa.types.is_integer(kind) and _any_hex(candidate):
                continue          # Arrow reads 0x10 as 16 (0xFFFFFFFFFFFFFFFF as -1), DuckDB not
            try:
                return table.set_column(table.column_names.index(name), name,
                                        pc.cast(candidate, kind))
            except pa.ArrowInvalid:
                continue
    return table.set_column(table.column_names.index(name), name, text)


def _any_hex(text: pa.ChunkedArray) -> bool:
    """Whether some value of `text` is hexadecimal as Arrow's integer cast reads it: `0x` or
    `0X` first (it reads no sign or space before them)."""
    return bool(pc.any(pc.starts_with(text, "0x", ignore_case=True)).as_py())


def _dates_only(text: pa.ChunkedArray) -> bool:
    """Whether every value of `text` looks like an ISO date (`DATE_LIKE`)."""
    return bool(pc.all(pc.match_substring_regex(text, DATE_LIKE)).as_py())


def _one_line(error: Exception) -> str:
    """An error's message on one line, at most 300 characters."""
    return " ".join(str(error).split())[:300]


# ---------------------------------------------------------------- TensorFlow Datasets


def load_tfds(name: str, data_dir: str | None = None) -> Interactions:
    """Loads `movielens/*-ratings` (and its `-movies` catalogue) from TensorFlow Datasets."""
    if not re.fullmatch(r"movielens/(%s)-ratings" % "|".join(map(re.escape, TFDS_NAMES)), name):
        raise DataError(f"tfds:{name}: unsupported; use one of "
                        f"{[f'tfds:movielens/{n}-ratings' for n in TFDS_NAMES]}")
    import tensorflow_datasets as tfds
    try:
        for config in (name, name.replace("-ratings", "-movies")):
            builder = tfds.builder(config, data_dir=data_dir)
            if not builder.is_prepared() and _downloads(builder):
                _check_download_host(f"tfds:{name}", getattr(builder.builder_config,
                                                              "download_url", None),
                                     builder.data_dir)
        ratings = _tfds_columns(tfds.load(name, split="train", data_dir=data_dir))
        movies = _tfds_columns(tfds.load(name.replace("-ratings", "-movies"), split="train",
                                         data_dir=data_dir))
        genre_labels = tfds.builder(name.replace("-ratings", "-movies"), data_dir=data_dir
                                    ).info.features["movie_genres"].feature.names
    except DataError:
        raise
    except ModuleNotFoundError as error:          # a package TFDS imports only when it downloads
        raise DataError(f"tfds:{name}: TensorFlow Datasets needs the package {error.name!r} to "
                        f"download; install it (pip install {error.name}) and try again") from None
    except Exception as error:  # TFDS raises many kinds of download and preparation errors.
        raise DataError(
            f"tfds:{name}: could not load it ({type(error).__name__}: {_one_line(error)}). "
            f"TFDS downloads a data set the first time; without network access, "
            f"{OFFLINE_ADVICE}") from None
    genres, genre_names = _tfds_genres(movies, genre_labels, f"tfds:{name}")
    titles = _tfds_text(movies["movie_title"])
    item_features = {"genres": genres, "title": titles,
                     "year": _year_from_title(pa.chunked_array([pa.array(titles)]))}
    user_columns = {"user_gender": "gender", "bucketized_user_age": "age",
                    "user_occupation_label": "occupation"}
    user_rows = {name: _tfds_text(ratings[column])
                 for column, name in user_columns.items() if column in ratings}
    return from_columns(f"tfds:{name}", _tfds_text(ratings["user_id"]),
                        _tfds_text(ratings["movie_id"]), ratings["timestamp"],
                        ratings["user_rating"], catalogue=_tfds_text(movies["movie_id"]),
                        item_features=item_features, genre_names=genre_names,
                        user_rows=user_rows)


def _tfds_text(values: np.ndarray) -> np.ndarray:
    """[n] a TFDS column -> [n] str: bytes decoded as UTF-8 (TFDS stores MovieLens titles so,
    and real ones hold letters such as é), numbers and booleans as NumPy writes them."""
    if values.dtype == object:
        return pa.array(values, pa.binary()).cast(pa.string()).to_numpy(
            zero_copy_only=False).astype(str)
    return values.astype(str)


def _tfds_genres(movies: dict, labels: list[str], source: str
                 ) -> tuple[np.ndarray, tuple[str, ...]]:
    """[n, g] multi-hot of the movies' genre labels (`movie_genres`, indexes into TFDS's
    ClassLabel `labels`) and the g genre names, as `_multi_hot` reads a `|`-joined genres
    column (the genres that occur, by name, "(no genres listed)" none): what the latest
    releases' GroupLens files give. For 100k and 1m, TFDS names two genres otherwise than
    their files ("Children" for "Children's", "Unknown" for ml-100k's "unknown")."""
    lists = pa.ListArray.from_arrays(
        np.searchsorted(movies["movie_genres_rows"], np.arange(len(movies["movie_id"]) + 1)
                        ).astype(np.int32),
        pa.array(np.asarray(labels, dtype=object)[movies["movie_genres"]], pa.string()))
    joined = pc.binary_join(lists, "|")
    return _multi_hot(pa.chunked_array([joined]), source, "movie_genres")


OFFLINE_ADVICE = ("prepare it elsewhere and pass its data directory with --data-dir, or pass "
                  "the GroupLens release instead: --data path/to/ml-100k.zip (or its unpacked "
                  "folder)")


def _downloads(builder) -> bool:
    """Whether preparing `builder` would download: not when its `download_and_prepare` is not
    TFDS's own (`tfds.testing.mock_data` makes it a no-op that fakes the data)."""
    prepare = type(builder).download_and_prepare
    return getattr(prepare, "__module__", "").startswith("tensorflow_datasets.core")


def _check_download_host(source: str, url: str | None, data_dir: str,
                         timeout: float = 10.0) -> None:
    """Raises a one-line DataError at once when the host TFDS would download `url` from cannot
    be reached (TFDS itself retries a failed download for minutes). Through a proxy, TFDS's
    own attempt tells."""
    address = urllib.parse.urlsplit(url or "")
    host = address.hostname
    proxies = urllib.request.getproxies()
    if host is None or ({"https", "all"} & set(proxies) and not urllib.request.proxy_bypass(host)):
        return
    try:
        port = address.port or (80 if address.scheme == "http" else 443)
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as error:
        raise SourceNotFound(f"{source}: not prepared in {data_dir}, and {host}, where TFDS "
                             f"would download it from, cannot be reached "
                             f"({_one_line(error)}); {OFFLINE_ADVICE}") from None


def _tfds_columns(dataset, batch_size: int = 65536) -> dict[str, np.ndarray]:
    """Whole columns of a TFDS split, read in large ragged batches; list features come back
    flat with `NAME_rows` giving each value's row."""
    columns: dict[str, list] = {}
    offset = 0
    for batch in dataset.ragged_batch(batch_size):
        size = None
        for key, value in batch.items():
            if hasattr(value, "flat_values"):
                columns.setdefault(key, []).append(value.flat_values.numpy())
                rows = value.value_rowids().numpy() + offset
                columns.setdefault(key + "_rows", []).append(rows)
                size = value.nrows().numpy()
            else:
                columns.setdefault(key, []).append(value.numpy())
                size = len(value)
        offset += int(size)
    return {key: np.concatenate(parts) for key, parts in columns.items()}
