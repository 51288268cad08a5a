"""Logs as Parquet shards: a folder or glob reads as the same rows in one file would, mistakes
are one line, DuckDB's summary counts exactly what loading gives, and the synthetic generator
writes shards a chunk at a time, deterministically, that load back with their item table."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tworec.features import DataError, load
from tworec.features import shards, synthetic
from tworec.features.synthetic import (SyntheticConfig, _item_features, _items, chunk_table,
                                       users_per_shard, write_shards)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_NAMES = ("user_ids", "item_ids", "user", "item", "timestamp", "rating")
SMALL = SyntheticConfig(num_users=300, num_items=200, num_interactions=9_000, num_clusters=5)


def a_log(rows: int = 120, seed: int = 0) -> pa.Table:
    """A log with duplicate rows, string and integer ids, a timestamp-typed time, a float
    rating, an item side feature, a user side feature and a column no role reads."""
    rng = np.random.default_rng(seed)
    table = pa.table({
        "uid": pa.array(np.char.add("user", rng.integers(0, 15, rows).astype(str))),
        "sku": pa.array(rng.integers(0, 30, rows), pa.int64()),
        "ts": pa.array(1_600_000_000_000 + rng.integers(-5_000, 90_000_000, rows) * 997,
                       pa.timestamp("ms")),
        "stars": pa.array(rng.integers(1, 11, rows) / 2.0),
        "note": pa.array(rng.integers(0, 3, rows).astype(str))})
    table = pa.concat_tables([table, table.slice(10, 7), table.slice(100, 3)])   # duplicates
    colour = pc_colour(table.column("sku"))
    return table.append_column("colour", colour).append_column(
        "age", pa.array(np.char.add("a", (np.arange(table.num_rows) % 4).astype(str))))


def pc_colour(sku: pa.ChunkedArray) -> pa.Array:
    return pa.array(np.array(["red", "green", "blue"])[sku.to_numpy() % 3])


MAPPING = {"user": "uid", "item": "sku", "time": "ts", "rating": "stars",
           "item.colour": "colour", "user.age": "age"}


def write_split(table: pa.Table, folder, cuts=(0, 31, 31, 95), row_group_size=9) -> list[str]:
    """`table` as shards cut at `cuts` (an empty shard included), small row groups so that a
    shard is read in several batches; returns their paths."""
    os.makedirs(folder, exist_ok=True)
    bounds = list(cuts) + [table.num_rows]
    paths = []
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        paths.append(os.path.join(folder, f"part-{index:03d}.parquet"))
        pq.write_table(table.slice(start, stop - start), paths[-1], row_group_size=row_group_size)
    return paths


def assert_same_log(got, want):
    for name in LOG_NAMES:
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        assert (getattr(got, name) is None) == (getattr(want, name) is None), name
        if getattr(want, name) is not None:
            assert getattr(got, name).dtype == getattr(want, name).dtype, name
    for table in ("item_features", "user_features"):
        assert getattr(got, table).keys() == getattr(want, table).keys(), table
        for name, values in getattr(want, table).items():
            np.testing.assert_array_equal(getattr(got, table)[name], values, err_msg=name)
    assert got.dropped == want.dropped and got.genre_names == want.genre_names


def one_line(call) -> str:
    with pytest.raises(DataError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------ reading


@pytest.mark.parametrize("columns", [MAPPING, None], ids=["mapped", "common-names"])
def test_a_folder_and_a_glob_read_as_the_log_in_one_file(tmp_path, columns):
    table = a_log()
    if columns is None:                  # user_id, item_id, timestamp, rating found by name
        table = table.rename_columns(["user_id", "item_id", "timestamp", "rating", "note",
                                      "colour", "age"])
    pq.write_table(table, tmp_path / "log.parquet")
    write_split(table, tmp_path / "shards")
    whole = load(str(tmp_path / "log.parquet"), columns=columns)
    assert whole.dropped == {"duplicate_row": 10} and len(whole) == 120
    assert_same_log(load(str(tmp_path / "shards"), columns=columns), whole)
    assert_same_log(load(str(tmp_path / "shards" / "part-*.parquet"), columns=columns), whole)


def test_shards_are_read_in_path_order_and_may_nest(tmp_path):
    table = a_log()
    pq.write_table(table, tmp_path / "log.parquet")
    write_split(table.slice(0, 50), tmp_path / "shards" / "a")
    write_split(table.slice(50), tmp_path / "shards" / "b", cuts=(0, 20))
    (tmp_path / "shards" / "_SUCCESS").write_text("")
    progress = a_log(seed=1).slice(0, 30)                     # a write in progress: other rows
    write_split(progress, tmp_path / "shards" / "b" / "_temporary" / "0")
    (tmp_path / "shards" / "_part-9.parquet").write_text("not a shard")
    whole = load(str(tmp_path / "log.parquet"), columns=MAPPING)
    assert_same_log(load(str(tmp_path / "shards"), columns=MAPPING), whole)
    for pattern in (("**", "*.parquet"), ("**", "**", "*.parquet")):   # glob lists the 2nd's
        assert_same_log(load(str(tmp_path.joinpath("shards", *pattern)), columns=MAPPING),
                        whole)                                        # files twice
    pq.write_table(progress, tmp_path / "progress.parquet")     # names the pattern spells out
    for spelt in (("b", "_temporary", "*", "*.parquet"), ("b", "_*", "0", "part-*.parquet"),
                  ("**", "_temporary", "**", "*.parquet")):
        assert_same_log(load(str(tmp_path.joinpath("shards", *spelt)), columns=MAPPING),
                        load(str(tmp_path / "progress.parquet"), columns=MAPPING))
    message = one_line(lambda: load(str(tmp_path / "shards" / "*" / "*" / "*" / "*.parquet")))
    assert "the pattern's wildcards reach only names starting with _ or ." in message


def test_shard_mistakes_are_one_line_naming_the_path_and_what_works(tmp_path):
    (tmp_path / "empty").mkdir()
    message = one_line(lambda: load(str(tmp_path / "empty")))
    assert "the folder is empty" in message and "part-*.parquet" in message
    os.makedirs(tmp_path / "writing" / "_temporary" / "0")         # a write in progress
    pq.write_table(a_log(), tmp_path / "writing" / "_temporary" / "0" / "part-0.parquet")
    assert one_line(lambda: load(str(tmp_path / "writing"))) == (
        f"{tmp_path / 'writing'}: holds only names starting with _ or . "
        f"({tmp_path / 'writing' / '_temporary'}), which are skipped as a write in progress "
        "(Spark's _temporary); pass the folder of the finished shards")    # not "empty"
    pattern = str(tmp_path / "logs" / "part-*.parquet")
    message = one_line(lambda: load(pattern))
    assert message.startswith(f"{pattern}: no file matches")

    paths = write_split(a_log(), tmp_path / "mixed")
    (tmp_path / "mixed" / "readme.txt").write_text("not a shard")
    message = one_line(lambda: load(str(tmp_path / "mixed" / "*"), columns=MAPPING))
    assert "readme.txt, which is not a .parquet file" in message and "*.parquet" in message

    for name in ("day2.csv", "nested/day3.json.gz"):     # data files a folder read skipped
        os.makedirs(tmp_path / "mixed" / os.path.dirname(name), exist_ok=True)
        (tmp_path / "mixed" / name).write_text("user_id,item_id,timestamp\nb,x,5\n")
        for read in (load, shards.describe):
            assert one_line(lambda: read(str(tmp_path / "mixed"), MAPPING)) == (
                f"{tmp_path / 'mixed' / name}: not a .parquet file, among the log's shards, "
                "where it would not be read; write it as Parquet, or move it out of the folder")
        os.remove(tmp_path / "mixed" / name)
    (tmp_path / "mixed" / "_day4.csv").write_text("")                  # hidden: skipped
    assert len(load(str(tmp_path / "mixed"), columns=MAPPING)) == 120

    retyped = a_log().set_column(0, "uid", pa.array(np.arange(a_log().num_rows)))
    pq.write_table(retyped.slice(0, 5), paths[2])
    message = one_line(lambda: load(str(tmp_path / "mixed"), columns=MAPPING))
    assert message.startswith(f"{paths[2]}: column 'uid' is int64, but string in {paths[0]}")
    assert "same schema" in message
    pq.write_table(a_log().drop_columns(["stars"]).slice(0, 5), paths[2])
    message = one_line(lambda: load(str(tmp_path / "mixed"), columns=MAPPING))
    assert message.startswith(f"{paths[2]}: no column 'stars'")

    holes = a_log().set_column(3, "stars", pa.array([None, 2.0] * (a_log().num_rows // 2)))
    pq.write_table(holes, paths[2], row_group_size=9)
    message = one_line(lambda: load(str(tmp_path / "mixed" / "*.parquet"), columns=MAPPING))
    assert message == (f"{paths[2]}: column 'stars' has {a_log().num_rows // 2} missing values "
                       "(first at row 0)")
    message = one_line(lambda: shards.describe(str(tmp_path / "mixed" / "*.parquet"), MAPPING))
    assert message == (f"{tmp_path / 'mixed' / '*.parquet'}: column 'stars' has "
                       f"{a_log().num_rows // 2} missing or NaN values (first at row 0 of "
                       f"{paths[2]})")                     # the shard and its row, as in memory


def test_linked_folders_are_read_once_and_misnamed_shards_refused(tmp_path):
    """A symlinked partition is read as a folder is (twice linked, once; a loop ends; a link
    to an ancestor reads none of its other folders; a file linked twice is read once); a
    shard named .parq or .PARQUET is refused, not skipped."""
    table = a_log()
    first = write_split(table.slice(0, 60), tmp_path / "log" / "a", cuts=(0,))[0]
    write_split(table.slice(60), tmp_path / "elsewhere" / "b", cuts=(0,))
    for link in ("b", "c"):
        os.symlink(tmp_path / "elsewhere" / "b", tmp_path / "log" / link)
    os.symlink(tmp_path / "log", tmp_path / "log" / "a" / "loop")
    os.symlink(tmp_path, tmp_path / "log" / "a" / "up")         # an ancestor: other data sets
    write_split(a_log(seed=1), tmp_path / "other", cuts=(0,))
    os.symlink(first, tmp_path / "log" / "again.parquet")
    pq.write_table(table, tmp_path / "whole.parquet")
    assert_same_log(load(str(tmp_path / "log"), columns=MAPPING),
                    load(str(tmp_path / "whole.parquet"), columns=MAPPING))
    os.makedirs(tmp_path / "g")                    # a glob reads a file once too, in order
    os.makedirs(tmp_path / "copies")
    for name, target in (("a.parquet", first), ("b.parquet", tmp_path / "whole.parquet"),
                         ("c.parquet", first)):
        os.symlink(target, tmp_path / "g" / name)
    shutil.copy(first, tmp_path / "copies" / "0.parquet")
    shutil.copy(tmp_path / "whole.parquet", tmp_path / "copies" / "1.parquet")
    assert_same_log(load(str(tmp_path / "g" / "*.parquet"), columns=MAPPING),
                    load(str(tmp_path / "copies"), columns=MAPPING))
    assert shards.find(str(tmp_path / "g" / "*.parquet")).files == (
        str(tmp_path / "g" / "a.parquet"), str(tmp_path / "g" / "b.parquet"))
    os.symlink(".", tmp_path / "log" / "self")           # the source named by a link to itself
    for source in ("log", os.path.join("log", "self")):
        assert_same_log(load(str(tmp_path / source), columns=MAPPING),
                        load(str(tmp_path / "whole.parquet"), columns=MAPPING))
    for name in ("part-9.parq", "part-9.PARQUET"):
        pq.write_table(table, tmp_path / "log" / "a" / name)
        assert one_line(lambda: load(str(tmp_path / "log"), columns=MAPPING)) == (
            f"{tmp_path / 'log' / 'a' / name}: a shard is read when its name ends .parquet; "
            "rename it so, or move it out of the folder")
        os.remove(tmp_path / "log" / "a" / name)


def test_a_column_twice_in_a_later_shard_is_refused_in_one_line(tmp_path):
    table = a_log()
    paths = write_split(table, tmp_path / "log", cuts=(0, 60))
    twice = table.slice(60).append_column("uid", table.slice(60).column("uid"))
    pq.write_table(twice, paths[1])
    for read in (lambda: load(str(tmp_path / "log"), columns=MAPPING),
                 lambda: shards.describe(str(tmp_path / "log"), MAPPING)):
        assert one_line(read) == (f"{paths[1]}: the column 'uid' is in the shard 2 times; give "
                                  "the columns distinct names")


def test_int96_shards_beside_nanosecond_ones_are_refused_saying_why(tmp_path):
    times = pa.array([1_700_000_000_000_000_000 + n for n in range(4)], pa.timestamp("ns"))
    log = pa.table({"user_id": ["a", "a", "b", "b"], "item_id": list("xyxz"), "timestamp": times})
    os.makedirs(tmp_path / "log")
    pq.write_table(log, tmp_path / "log" / "part-0.parquet", use_deprecated_int96_timestamps=True)
    pq.write_table(log, tmp_path / "log" / "part-1.parquet")
    assert one_line(lambda: load(str(tmp_path / "log"))).endswith(
        "write every shard with the same schema; if one of them is a Parquet INT96 time "
        "(Spark's legacy), it is read in microseconds, as DuckDB reads it: write the times in "
        "one unit, e.g. timestamp[us]")


def test_a_rating_column_the_first_shard_lacks_is_refused_not_dropped(tmp_path):
    """Roles are found on the first shard: a later one's ratings would be lost."""
    table = a_log().rename_columns(["rating" if name == "stars" else name
                                    for name in a_log().column_names])
    renamed = [table.drop_columns(["rating"]).slice(0, 60), table.slice(60)]
    paths = [str(tmp_path / "log" / f"part-{index}.parquet") for index in range(2)]
    os.makedirs(tmp_path / "log")
    for path, part in zip(paths, renamed):
        pq.write_table(part, path)
    columns = {role: name for role, name in MAPPING.items() if role != "rating"}
    for read in (lambda: load(str(tmp_path / "log"), columns=columns),
                 lambda: shards.describe(str(tmp_path / "log"), columns)):
        assert one_line(read) == (
            f"{paths[1]}: column 'rating' would be read as ratings, which {paths[0]} lacks; "
            "every shard needs the same columns (found there: "
            f"{', '.join(renamed[0].column_names)}), or give --columns rating=none to read no "
            "ratings")
    unrated = {**columns, "rating": "none"}          # said: no ratings, on both paths
    log = load(str(tmp_path / "log"), columns=unrated)
    summary = shards.describe(str(tmp_path / "log"), unrated)
    assert log.rating is None and not summary["has_ratings"]
    assert len(log) == summary["interactions"] == 120      # a_log's 10 repeats dropped
    assert summary["unread_columns"] == ["note", "rating"]      # the later shard's too


def test_int96_timestamps_after_2262_are_read_alike_on_both_paths(tmp_path):
    """Spark's legacy INT96 times: Arrow's nanoseconds would wrap 9999-12-31 to 1816 in silence;
    read in microseconds, as DuckDB reads them, they are what was written."""
    import datetime
    times = [datetime.datetime(*day) for day in ((2024, 1, 1), (2024, 1, 2), (9999, 12, 31),
                                                 (2024, 1, 1), (2024, 1, 3), (2820, 9, 13))]
    folder = tmp_path / "log"
    os.makedirs(folder)
    pq.write_table(pa.table({"user_id": ["a"] * 3 + ["b"] * 3, "item_id": list("xyzxyz"),
                             "timestamp": pa.array(times, pa.timestamp("us"))}),
                   folder / "part-0.parquet", use_deprecated_int96_timestamps=True)
    seconds = [int(time.replace(tzinfo=datetime.timezone.utc).timestamp()) for time in times]
    assert load(str(folder)).timestamp.tolist() == seconds
    assert load(str(folder / "part-0.parquet")).timestamp.tolist() == seconds
    assert shards.describe(str(folder))["time_range"] == [min(seconds), max(seconds)]


def test_decimal_ids_wider_than_duckdb_reads_are_refused_out_of_core(tmp_path):
    """DuckDB reads a decimal of precision over 38 as a double: 10^30 and 10^30 + 1 as one."""
    ids = pa.array([10**30, 10**30 + 1, 10**30 + 2, 6], pa.decimal256(40, 0))
    folder = tmp_path / "log"
    os.makedirs(folder)
    pq.write_table(pa.table({"user_id": ["a", "a", "b", "b"], "item_id": ids,
                             "timestamp": [1, 2, 3, 4]}), folder / "part-0.parquet")
    assert load(str(folder)).num_items == 4
    assert one_line(lambda: shards.describe(str(folder))) == (
        f"{folder}: column 'item_id' is of type decimal256(40, 0), which out of core (DuckDB) "
        "reads as floating point, merging ids; write the ids as text, or load the log in "
        "memory")


@pytest.mark.parametrize("name", ["file_index", "FILE_ROW_NUMBER"])
def test_a_column_named_as_duckdbs_row_columns_is_refused_out_of_core(tmp_path, name):
    """DuckDB would read the shard's column as its own: rows in other places, or a crash."""
    table = a_log()
    paths = write_split(table.append_column(name, pa.array(np.zeros(table.num_rows, np.int64))),
                        tmp_path / "log", cuts=(0, 60))
    assert len(load(str(tmp_path / "log"), columns=MAPPING)) > 0         # in memory: unread
    assert one_line(lambda: shards.describe(str(tmp_path / "log"), MAPPING)) == (
        f"{paths[0]}: column {name!r} has the name of a column describe and prepare (DuckDB) "
        "add to each row for its position: rename it, or load the log in memory")


def test_the_item_table_is_checked_before_the_log_is_read(tmp_path, monkeypatch):
    write_split(a_log(), tmp_path / "shards")
    pq.write_table(pa.table({"id": ["1", "2"]}), tmp_path / "shards" / "items.parquet")

    def read_columns(*args, **kwargs):
        raise AssertionError("the log was read before its item table was checked")

    monkeypatch.setattr(shards, "read_columns", read_columns)
    message = one_line(lambda: load(str(tmp_path / "shards"), columns=MAPPING))
    assert message == (f"{tmp_path / 'shards' / 'items.parquet'}: the item table needs the "
                       "log's item column 'sku'; it has id")


# ------------------------------------------------------------------ the summary


@pytest.mark.parametrize("passes", [1, 5])
def test_describe_counts_exactly_what_loading_gives(tmp_path, monkeypatch, passes):
    if passes > 1:                 # distinct rows counted over 5 disjoint sets of users
        monkeypatch.setattr(shards, "DISTINCT_ROW_BYTES", 10**9 // 100)
    table = a_log(rows=400, seed=3)
    write_split(table, tmp_path / "shards", cuts=(0, 120, 300))
    shards.write_item_table(str(tmp_path / "shards" / "items.parquet"),
                            np.arange(0, 30, 2), {"size": np.arange(15, dtype=np.int32)},
                            id_column="sku")
    for source in (str(tmp_path / "shards"), str(tmp_path / "shards" / "*.parquet")):
        log = load(source, columns=MAPPING)
        assert set(log.dropped) == {"duplicate_row", "item_not_in_catalogue"}
        summary = shards.describe(source, MAPPING)
        assert {k: summary[k] for k in log.summary()} == log.summary()
        assert summary["time_range"] == [log.timestamp.min(), log.timestamp.max()]
        assert [s["rows"] for s in summary["shards"]] == [120, 180, table.num_rows - 300]
        assert summary["duckdb"]["distinct_passes"] == passes
    pq.write_table(table, tmp_path / "log.parquet")
    log = load(str(tmp_path / "log.parquet"), columns=MAPPING)
    summary = shards.describe(str(tmp_path / "log.parquet"), MAPPING)
    assert {k: summary[k] for k in log.summary()} == log.summary()


@pytest.mark.parametrize("column, values, role, expected", [
    ("plan", ["free", None, "paid", "free"], "user.plan", "column 'plan' has 1 missing values"),
    ("year", pa.array([1990, 1991, None, 1990], pa.int64()), "item.year",
     "column 'year' has 1 missing values"),
    ("year", ["1990", "199x", "1990", "1990"], "item.year",
     "column 'year' is not years as item.year takes them, whole numbers such as 1995 (first "
     "value that is not a number: '199x', at row 1)"),
    ("year", [1990.0, 1990.5, 1990.0, 1990.0], "item.year",
     "column 'year' has 1 years that are not whole numbers (first at row 1)"),
    ("year", [1990, 2 ** 40, 1990, 1990], "item.year",
     "column 'year' has 1 years beyond ±2^31 (first at row 1)"),
    ("tags", [1, 2, 3, 4], "item.genres",
     "column 'tags' (item.genres) is not text; give each item's genre names joined by '|' "
     "(Action|Comedy)"),
], ids=["user-null", "year-null", "year-text", "year-fraction", "year-too-large",
        "genres-numbers"])
def test_describe_refuses_the_side_features_loading_refuses(tmp_path, column, values, role,
                                                            expected):
    """describe and prepare counted a log whose side features loading refuses: a null plan or
    year, years that are not whole numbers, genres that are not text."""
    path = tmp_path / "log.parquet"
    pq.write_table(pa.table({"user_id": ["a", "a", "a", "b"], "item_id": ["x", "y", "z", "x"],
                             "timestamp": [1, 2, 3, 4], column: values}), path)
    for refused in (lambda: load(str(path), {role: column}),
                    lambda: shards.describe(str(path), {role: column})):
        assert one_line(refused).startswith(f"{path}: {expected}")
    if "missing" in expected:                        # out of core: what would work, too
        assert one_line(lambda: shards.describe(str(path), {role: column})).endswith(
            "; fill them, or leave the feature out of --columns")


def test_describe_data_summarises_shards_without_the_split(tmp_path):
    write_split(a_log().rename_columns(["user_id", "item_id", "timestamp", "rating", "note",
                                        "colour", "age"]), tmp_path / "shards")
    script = os.path.join(ROOT, "scripts", "describe_data.py")
    done = subprocess.run([sys.executable, script, "--data", str(tmp_path / "shards"),
                           "--memory-limit", "200MB"], capture_output=True, text=True, timeout=120)
    summary = json.loads(done.stdout)
    assert summary["interactions"] == len(load(str(tmp_path / "shards"))) and "split" not in summary
    assert len(summary["shards"]) == 4
    done = subprocess.run([sys.executable, script, "--data", str(tmp_path / "shards"), "--split",
                           "random"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--split" in done.stderr


def test_describe_data_stopped_by_ctrl_c_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "describe_data", os.path.join(ROOT, "scripts", "describe_data.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    write_split(a_log(), tmp_path / "shards")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(shards, "describe", interrupted)
    assert script.main(["--data", str(tmp_path / "shards")]) == 130
    assert capsys.readouterr().err == "error: stopped (Ctrl-C)\n"


# ------------------------------------------------------------------ writing synthetic shards


def shard_tables(folder) -> list[pa.Table]:
    return [pq.read_table(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
            if name.startswith("part-")]


def test_write_shards_is_deterministic_and_each_chunk_its_own(tmp_path):
    upc = users_per_shard(SMALL, 3_000)
    paths = write_shards(SMALL, str(tmp_path / "a"), seed=5, rows_per_shard=3_000)
    assert len(paths) == 3 and upc == 100
    written = shard_tables(tmp_path / "a")
    for chunk, table in enumerate(written):
        assert table.equals(chunk_table(SMALL, 5, chunk, upc))
    assert written[0].column("item_id") != written[1].column("item_id")     # seeds of their own
    write_shards(SMALL, str(tmp_path / "again"), seed=5, rows_per_shard=3_000)
    assert all(a.equals(b) for a, b in zip(shard_tables(tmp_path / "again"), written))
    write_shards(SMALL, str(tmp_path / "other"), seed=6, rows_per_shard=3_000)
    assert not shard_tables(tmp_path / "other")[0].equals(written[0])
    # A 2-chunk log is the first two chunks of the 3-chunk one: a chunk depends on itself only.
    two = dataclasses.replace(SMALL, num_users=200, num_interactions=6_000)
    write_shards(two, str(tmp_path / "two"), seed=5, rows_per_shard=3_000)
    assert pa.concat_tables(shard_tables(tmp_path / "two")).equals(pa.concat_tables(written[:2]))
    with pytest.raises(FileExistsError, match="not an empty folder"):
        write_shards(SMALL, str(tmp_path / "a"), seed=5)


def test_write_shards_holds_one_chunk_at_a_time(tmp_path):
    config = SyntheticConfig(num_users=4_000, num_items=2_000, num_interactions=200_000)

    def peak(rows_per_shard: int, folder: str) -> int:
        tracemalloc.start()
        write_shards(config, str(tmp_path / folder), rows_per_shard=rows_per_shard)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak

    whole, chunked = peak(200_000, "whole"), peak(25_000, "chunked")
    assert len(shard_tables(tmp_path / "chunked")) == 8
    assert chunked < 0.3 * whole, (chunked, whole)


def test_written_shards_load_back_with_their_item_table(tmp_path):
    write_shards(SMALL, str(tmp_path / "log"), seed=2, rows_per_shard=4_000)
    log = load(str(tmp_path / "log"))
    rows = pa.concat_tables(shard_tables(tmp_path / "log"))
    assert len(log) == rows.num_rows and log.dropped == {}
    np.testing.assert_array_equal(log.user_ids[log.user], rows.column("user_id").to_numpy())
    np.testing.assert_array_equal(log.item_ids[log.item], rows.column("item_id").to_numpy())
    np.testing.assert_array_equal(log.timestamp, rows.column("timestamp").to_numpy())
    np.testing.assert_array_equal(log.rating, rows.column("rating").to_numpy())
    assert log.user_ids.tolist() == [f"u{u}" for u in range(SMALL.num_users)]
    assert log.item_ids.tolist() == [f"i{i}" for i in range(SMALL.num_items)]
    rng = np.random.default_rng(2)
    features = _item_features(SMALL, rng, *_items(SMALL, rng)[:2])
    assert log.item_features.keys() == features.keys()
    for name, values in features.items():
        np.testing.assert_array_equal(log.item_features[name], values, err_msg=name)
        assert log.item_features[name].dtype.kind == values.dtype.kind, name
    assert log.genre_names == tuple(f"genre{g}" for g in range(SMALL.num_genres))


def test_the_module_writes_a_preset_and_100m_is_for_shards_only(tmp_path, monkeypatch):
    out = str(tmp_path / "tiny")
    command = [sys.executable, "-m", "tworec.features.shards", "--synthetic", "tiny", "--out",
               out, "--rows-per-shard", "2000"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["shards"] == 4 and result["rows"] == len(load(out)) > 0    # 66 users each
    assert sorted(os.listdir(tmp_path)) == ["tiny"]                 # no partial folder left
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--out" in done.stderr
    def in_memory(*args, **kwargs):
        raise AssertionError("synthetic:100m was generated in memory")

    monkeypatch.setattr(synthetic, "generate", in_memory)
    message = one_line(lambda: load("synthetic:100m"))
    assert "--synthetic 100m --out DIR" in message


def test_an_item_tables_text_genres_and_years_read_as_a_logs(tmp_path):
    """Genres written as names joined by '|' (MovieLens's movies.csv) become the multi-hot
    table the models read; years whole numbers (text genres failed later, in NumPy's words)."""
    path = str(tmp_path / "items.parquet")
    shards.write_item_table(path, np.array(["i0", "i1", "i2"]), {
        "genres": np.array(["Action|Comedy", "Drama", "(no genres listed)"]),
        "year": np.array([1995.0, 2001.0, 0.0])})
    table = shards.read_item_table(path, "item_id")
    assert table["genre_names"] == ("Action", "Comedy", "Drama")
    assert table["item_features"]["genres"].tolist() == [[1, 1, 0], [0, 0, 1], [0, 0, 0]]
    assert table["item_features"]["year"].tolist() == [1995, 2001, 0]
    shards.write_item_table(path, np.array(["i0"]), {"year": np.array([1995.5])})
    with pytest.raises(DataError, match="'year' has 1 years that are not whole numbers"):
        shards.read_item_table(path, "item_id")
