"""features.prepare: DuckDB's out-of-core preparation equals the in-memory path exactly."""
import json
import os
import subprocess
import sys
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tworec.features import DataError, shards
import tworec.features.prepare as prepare_module
from tworec.features.inputs import prepare
from tworec.features.prepare import SPLIT_CODES, main, prepare_shards
from tworec.features.sources import load
from tworec.features.splits import temporal_split
from tworec.features.stream import PreparedLog
from tworec.features.synthetic import PRESETS, generate

LENGTH = 5


def _log_table(seed: int = 0) -> pa.Table:
    """The tiny synthetic log as a Parquet table, with what the SQL must get right: timestamps
    coarsened into ties, rows shuffled out of time order, a few exactly repeated rows and some
    users with fewer than 3 rows."""
    log = generate(PRESETS["tiny"], seed=seed)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(log))
    users = log.user_ids[log.user][order]
    items = log.item_ids[log.item][order]
    timestamps = log.timestamp[order] // 86_400                     # many ties within a day
    ratings = log.rating[order]
    repeats = rng.choice(len(order), 30, replace=False)              # duplicates, dropped on load
    short = np.array(["short-a", "short-a", "short-b"])              # users of 2 and 1 rows
    return pa.table({
        "user_id": np.concatenate([users, users[repeats], short]),
        "item_id": np.concatenate([items, items[repeats], items[:3]]),
        "timestamp": np.concatenate([timestamps, timestamps[repeats], timestamps[:3]]),
        "rating": np.concatenate([ratings, ratings[repeats], ratings[:3]]).astype(np.float32)})


def _prepared(folder: str) -> dict[str, np.ndarray]:
    table = pq.read_table(os.path.join(folder, "shards"))
    table = table.sort_by("row")
    history = table.column("history").combine_chunks()
    return {"row": table.column("row").to_numpy(), "user": table.column("user").to_numpy(),
            "item": table.column("item").to_numpy(),
            "history": history.flatten().to_numpy().reshape(len(table), history.type.list_size),
            "timestamp": table.column("timestamp").to_numpy(),
            "rating": table.column("rating").to_numpy(), "split": table.column("split").to_numpy()}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """One log written as one Parquet file and as 3 shards, both prepared."""
    root = tmp_path_factory.mktemp("prepare")
    table = _log_table()
    pq.write_table(table, root / "log.parquet")
    (root / "shards").mkdir()
    cuts = [0, 1000, 2500, len(table)]
    for part, (start, stop) in enumerate(zip(cuts[:-1], cuts[1:])):
        pq.write_table(table.slice(start, stop - start), root / "shards" / f"part-{part}.parquet")
    one = prepare_shards(str(root / "log.parquet"), str(root / "one"), history_length=LENGTH,
                         memory_limit="256MiB")
    three = prepare_shards(str(root / "shards"), str(root / "three"), history_length=LENGTH,
                           memory_limit="256MiB")
    return root, one, three


def assert_equal_to_the_in_memory_path(source: str, folder: str, manifest: dict,
                                       length: int = LENGTH):
    """The prepared rows, vocabularies, counts and manifest are what `load`, `temporal_split`
    and `inputs.prepare` give for `source`."""
    interactions = load(source)
    split = temporal_split(interactions)
    inputs = prepare(interactions, split, length)
    got = _prepared(folder)
    assert len(got["row"]) == len(interactions)
    # the rows kept are the in-memory rows in the same order; split labels per row
    expected_split = np.zeros(len(interactions), np.int8)
    for part, code in SPLIT_CODES.items():
        expected_split[getattr(split, part)] = code
    np.testing.assert_array_equal(got["split"], expected_split)
    np.testing.assert_array_equal(got["timestamp"], interactions.timestamp)
    if interactions.rating is not None:
        np.testing.assert_array_equal(got["rating"], interactions.rating)
    for part, code in SPLIT_CODES.items():
        rows = got["split"] == code
        examples = inputs.examples[part]
        np.testing.assert_array_equal(got["user"][rows], examples["user"])
        np.testing.assert_array_equal(got["item"][rows], inputs.item_index[examples["item"]])
        np.testing.assert_array_equal(got["history"][rows], examples["history"])
    for name, vocabulary in (("users", inputs.users), ("items", inputs.items)):
        table = pq.read_table(os.path.join(folder, f"{name}.parquet"))
        np.testing.assert_array_equal(table.column("id").to_numpy().astype(str), vocabulary.ids)
        np.testing.assert_array_equal(table.column("index").to_numpy(),
                                      np.arange(len(vocabulary)) + 2)
    items = pq.read_table(os.path.join(folder, "items.parquet"))
    counts = np.bincount(interactions.item[split.train], minlength=interactions.num_items)
    codes = {item_id: code for code, item_id in enumerate(interactions.item_ids)}
    np.testing.assert_array_equal(
        items.column("count").to_numpy(),
        counts[[codes[i] for i in items.column("id").to_numpy().astype(str)]])
    assert manifest["split"] == split.sizes()
    assert manifest["short_users"] == split.short_users
    assert manifest["dropped"] == interactions.dropped
    with open(os.path.join(folder, "manifest.json")) as f:
        assert manifest == json.load(f)
    return interactions


def test_split_vocabularies_histories_counts_equal_the_in_memory_path(logs):
    root, manifest, _ = logs
    interactions = assert_equal_to_the_in_memory_path(str(root / "log.parquet"),
                                                      str(root / "one"), manifest)
    assert interactions.dropped == {"duplicate_row": 30}
    assert manifest["short_users"] == 2


def test_no_history_asked_gives_one_pad_slot_as_the_in_memory_path(logs, tmp_path):
    """history_length 0: every row's one slot is PAD, never the previous item."""
    root, _, _ = logs
    manifest = prepare_shards(str(root / "log.parquet"), str(tmp_path / "none"),
                              history_length=0, memory_limit="256MiB")
    assert_equal_to_the_in_memory_path(str(root / "log.parquet"), str(tmp_path / "none"),
                                       manifest, length=0)
    assert (_prepared(str(tmp_path / "none"))["history"] == 0).all()
    prepared = PreparedLog.load(str(tmp_path / "none"))        # what fit_prepared validates
    assert (prepared.history_length, prepared.history_slots) == (0, 1)


def test_three_shards_prepare_as_one_file(logs):
    root, one, three = logs
    first, second = _prepared(str(root / "one")), _prepared(str(root / "three"))
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    for name in ("users.parquet", "items.parquet"):
        assert pq.read_table(root / "one" / name).equals(pq.read_table(root / "three" / name))
    assert {k: v for k, v in one.items() if k not in ("source", "seconds", "rows_per_second")} \
        == {k: v for k, v in three.items() if k not in ("source", "seconds", "rows_per_second")}


def test_duckdb_runs_under_the_memory_limit_given(logs):
    _, one, _ = logs
    assert one["duckdb"]["memory_limit"] == "256.0 MiB"


# ------------------------------------------------------------------ what prepare refuses or drops


def _write(folder, table: pa.Table, items: pa.Table | None = None) -> str:
    """`table` as a shard in `folder`, with `items` as its item table; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    pq.write_table(table, os.path.join(folder, "part-0.parquet"))
    if items is not None:
        pq.write_table(items, os.path.join(folder, "items.parquet"))
    return str(folder)


def _three_ways(source: str, out: str) -> list[str]:
    """The one-line DataError messages of `load`, `describe` and `prepare` on `source`;
    `prepare` must refuse before it starts labelling the rows."""
    import importlib
    prepare = importlib.import_module("tworec.features.prepare")

    def reached(*args, **kwargs):
        raise AssertionError("prepare labelled the rows before refusing them")
    messages = []
    for call in (lambda: load(source), lambda: shards.describe(source),
                 lambda: prepare_shards(source, out, memory_limit="256MiB")):
        with pytest.MonkeyPatch.context() as patch, pytest.raises(DataError) as error:
            patch.setattr(prepare, "_labelled_sql", reached)
            call()
        messages.append(str(error.value))
        assert "\n" not in messages[-1]
    assert not os.path.exists(out)
    return messages


LOG = {"user_id": ["a", "a", "b", "b"], "item_id": ["x", "y", "x", "z"], "timestamp": [1, 2, 3, 4],
       "rating": [1.0, 2.0, 3.0, 4.0]}


@pytest.mark.parametrize("column, values, expected", [
    ("user_id", ["a", None, "b", "b"], "column 'user_id' has 1 missing"),
    ("timestamp", pa.array([1, 2, None, 4]), "column 'timestamp' has 1 missing"),
    ("timestamp", [1.0, 2.0, float("nan"), 4.0], "column 'timestamp' has 1 missing or NaN values"),
    ("rating", [1.0, float("nan"), 3.0, float("nan")], "column 'rating' has 2 missing or NaN"),
    ("item_id", ["x", "y", "", ""], "column 'item_id' has 2 empty ids (first at row 2)"),
    ("user_id", ["a", "", "b", "b"], "column 'user_id' has 1 empty ids (first at row 1)"),
    ("rating", ["1", "2", "x", "4"],
     "column 'rating' is not numeric (first value that is not a number: 'x'"),
    ("rating", ["1", "NA", "3", "4"], "column 'rating' has 1 missing"),
    ("rating", ["1", "2", "4,5", "4"], "column 'rating' is not numeric (first value that is not "
     "a number: '4,5', at row 2; write numbers with a decimal point)"),
    ("timestamp", ["1", "2", "nan", "4"], "column 'timestamp' has 1 missing"),
    ("rating", ["1", "NAN", "3", "4"], "column 'rating' has 1 missing or NaN values (first at "
                                       "row 1)"),
    ("rating", pa.array(["1", "2", "x", "4"]).dictionary_encode(),
     "column 'rating' is not numeric (first value that is not a number: 'x'"),
    ("timestamp", ["1", "inf", "3", "4"], "column 'timestamp' has 1 times that are infinite or "
                                          "beyond ±2^63 seconds (first at row 1)"),
    ("timestamp", [1.0, 2.0, 3.0, float("-inf")], "column 'timestamp' has 1 times that are "
                                                  "infinite or beyond ±2^63 seconds (first at "
                                                  "row 3)"),
    ("timestamp", [1.0, 1e19, 3.0, 4.0], "has 1 times that are infinite or beyond ±2^63 "
                                         "seconds (first at row 1)"),
    ("timestamp", ["1", "2", "-99999999999999999999", "4"],
     "has 1 times that are infinite or beyond ±2^63 seconds (first at row 2)"),
    ("timestamp", pa.array([1, 2, 3, 2**63 + 5], pa.uint64()),
     "has 1 times that are infinite or beyond ±2^63 seconds (first at row 3)"),
    ("timestamp", pa.array([Decimal(1), Decimal(2), Decimal(10**20), Decimal(4)],
                           pa.decimal128(38, 0)),
     "has 1 times that are infinite or beyond ±2^63 seconds (first at row 2)"),
    ("rating", [1.0, 1e300, 3.0, 4.0], "column 'rating' has 1 ratings that are infinite or "
                                       "beyond float32's ±3.4e38 (first at row 1)"),
    ("rating", ["1", "2", "-1e39", "4"], "column 'rating' has 1 ratings that are infinite or "
                                         "beyond float32's ±3.4e38 (first at row 2)"),
    ("rating", [1.0, 2.0, 3.0, float("inf")], "column 'rating' has 1 ratings that are infinite "
                                              "or beyond float32's ±3.4e38 (first at row 3)"),
    ("rating", pa.nulls(4), "column 'rating' has 4 missing"),
    ("user_id", pa.array([b"a", b"", b"b", b"b"]).dictionary_encode(),
     "column 'user_id' has 1 empty ids (first at row 1)"),
    ("item_id", pa.array([b"x", b"y", b"\xff", b"\xc3"]),
     "column 'item_id' has 2 ids that are not UTF-8 text (first at row 2); write the ids as "
     "text (bytes such as UUIDs as hex)"),
    ("user_id", ["a", "a\x00", "b", "b\x00c"], "column 'user_id' has 2 ids holding a NUL "
     "character (first at row 1); strip it from the ids"),       # NumPy's text read a\0 as a
    ("item_id", pa.array([b"x", b"y", b"x\x00", b"z"]), "column 'item_id' has 1 ids holding a "
     "NUL character (first at row 2)"),
    ("user_id", pa.array([1, 1, 2, 2], pa.timestamp("s")), "column 'user_id' holds "),
    ("item_id", pa.array([5, 6, 5, 7], pa.date32()), "values, which are not read as ids; map "
     "the role to a column of text or integer ids"),       # load and prepare wrote other text
    ("item_id", [True, False, True, True], "column 'item_id' holds bool"),
    ("timestamp", [True, False, True, True], "column 'timestamp' is of type bool, which "),
    ("item_id", [1.0, float("nan"), 2.0, float("nan")], "column 'item_id' has 2 missing"),
    ("user_id", pa.array([1, 1, 2, 2], pa.time64("us")), "values, which are not read as ids"),
    *(("rating", ["1", text, "3", "4"], "column 'rating' is not numeric (first value that is "
       f"not a number: {text!r}, at row 1)") for text in ("\u0661", "\uff10", "1\xa0")),
], ids=["null-user", "null-time", "nan-time", "nan-rating", "empty-item", "empty-user",
        "text-rating", "NA-text-rating", "decimal-comma-rating", "nan-text-time", "NAN-text-rating",
        "dictionary-text-rating", "inf-text-time", "inf-time", "1e19-time", "huge-text-time",
        "uint64-time", "decimal-1e20-time", "1e300-rating", "text-1e39-rating", "inf-rating",
        "null-typed-rating", "dictionary-binary-empty-user", "binary-not-utf8-item",
        "nul-user", "binary-nul-item", "timestamp-user", "date-item", "bool-item",
        "bool-time", "nan-float-item", "time-of-day-user", "arabic-indic-rating",
        "full-width-rating", "nbsp-rating"])
def test_prepare_refuses_the_values_load_refuses(tmp_path, column, values, expected):
    source = _write(tmp_path / "log", pa.table({**LOG, column: values}))
    for message in _three_ways(source, str(tmp_path / "out")):
        assert expected in message, message


def test_prepare_refuses_an_empty_log_and_one_without_a_known_item(tmp_path):
    empty = _write(tmp_path / "empty", pa.table(LOG).slice(0, 0))
    assert _three_ways(empty, str(tmp_path / "out")) == [f"{empty}: the log is empty"] * 3
    unknown = _write(tmp_path / "unknown", pa.table(LOG), pa.table({"item_id": ["q", "r"]}))
    assert _three_ways(unknown, str(tmp_path / "out")) == [
        f"{unknown}: no interaction's item is in the item table (the log has 'x', the item "
        "table 'q'); write the item table's id column with the log's item ids"] * 3


@pytest.mark.parametrize("items, expected", [
    (pa.table({"sku": ["x", "y"]}), "the item table needs the log's item column 'item_id'; it "
                                    "has sku"),
    (pa.table({"item_id": ["x", "y", "x"]}), "item 'x' appears 2 times; the item table has one "
                                             "row per item"),
    (pa.table({"item_id": ["x", ""]}), "column 'item_id' has 1 empty ids (first at row 1)"),
], ids=["no-id-column", "repeated-id", "empty-id"])
def test_prepare_checks_the_item_table_as_load_does(tmp_path, items, expected):
    source = _write(tmp_path / "log", pa.table(LOG), items)
    for message in _three_ways(source, str(tmp_path / "out")):
        assert message == f"{source}/items.parquet: {expected}" or message.startswith(
            f"{source}/items.parquet: {expected};"), message


def test_prepare_counts_the_rows_it_drops_as_load_does(tmp_path, capsys):
    table = pa.table({"user_id": ["a", "a", "a", "b", "b", "b", "b"],
                      "item_id": ["x", "x", "q", "x", "y", "r", "r"],
                      "timestamp": [1, 1, 2, 3, 4, 5, 5]})     # 2 repeats, 2 distinct unknown
    source = _write(tmp_path / "log", table, pa.table({"item_id": ["x", "y", "z"]}))
    expected = {"duplicate_row": 2, "item_not_in_catalogue": 2}
    assert load(source).dropped == shards.describe(source)["dropped"] == expected
    manifest = prepare_shards(source, str(tmp_path / "out"), history_length=2)
    assert manifest["dropped"] == expected and manifest["rows"] == 3
    assert_equal_to_the_in_memory_path(source, str(tmp_path / "out"), manifest, length=2)
    assert main(["--data", source, "--out", str(tmp_path / "cli")]) == 0
    assert json.loads(capsys.readouterr().out)["dropped"] == expected


def test_prepare_says_what_it_reads_and_where_it_writes(tmp_path, capsys):
    (tmp_path / "log.csv").write_text("user_id,item_id,timestamp\na,x,1\n")
    with pytest.raises(DataError, match=r"log.csv: not Parquet; this reads only a folder or "
                                        r"glob of Parquet shards or one \.parquet file"):
        prepare_shards(str(tmp_path / "log.csv"), str(tmp_path / "out"))
    source = _write(tmp_path / "log", pa.table(LOG))
    (tmp_path / "taken").write_text("")
    with pytest.raises(SystemExit):
        main(["--data", source, "--out", str(tmp_path / "taken")])
    error = capsys.readouterr().err
    assert error == (f"error: {tmp_path / 'taken'}: a file, not a folder; pass a new or empty "
                     "folder\n")                   # no "(see --help)": the options were right


def test_an_out_folder_inside_the_log_or_under_a_file_is_refused_before_any_work(
        tmp_path, monkeypatch):
    """--out inside --data was prepared, and the log then read the prepared shards as its own;
    --out under a file failed with NotADirectoryError after the log was checked."""
    source = _write(tmp_path / "log", pa.table(LOG))
    (tmp_path / "afile").write_text("")
    monkeypatch.setattr(prepare_module, "parquet_log", None)              # no work at all
    for data, out, expected in (
            (source, f"{source}/prepared", f"--out {source}/prepared: inside the log's folder "
             f"{source}, where the prepared shards would be read as the log's; pass a folder "
             "outside it"),
            (f"{tmp_path}/*/*.parquet", f"{source}/deeper/prepared", f"--out {source}/deeper/"
             f"prepared: inside the log's folder {tmp_path}, where the prepared shards would be "
             "read as the log's; pass a folder outside it"),
            (source, f"{tmp_path}/afile/sub", f"{tmp_path}/afile/sub: cannot be made: "
             f"{tmp_path}/afile is a file, not a folder; pass a new or empty folder in a folder "
             "you can write")):
        with pytest.raises(DataError) as error:
            prepare_shards(data, out)
        assert str(error.value) == expected
    assert not os.path.exists(f"{source}/prepared")
    for hidden in ("_prepared", ".cache/prepared"):     # never read as shards: allowed there
        assert prepare_module._check_out_folder(source, f"{source}/{hidden}") is None


def test_sizes_out_of_range_are_refused_naming_them_before_any_work(tmp_path, capsys):
    """rows_per_shard=0 wrote empty shards until stopped; --history-length 20000 (a LAG a
    slot) ran for minutes on 5 rows; --memory-limit 1e20 or 1e400 ended in a traceback."""
    source = _write(tmp_path / "log", pa.table(LOG))
    for sizes, expected in (({"rows_per_shard": 0}, "rows_per_shard must be from 1 up, got 0"),
                            ({"block_rows": -1}, "block_rows must be from 1 up, got -1"),
                            ({"history_length": 1001},
                             "history_length must be from 0 to 1,000, got 1001")):
        with pytest.raises(ValueError) as error:
            prepare_shards(source, str(tmp_path / "out"), **sizes)
        assert str(error.value) == expected
    for options, expected in ((["--history-length", "20000"], "--history-length must be from "
                               "0 to 1,000, got 20000"),
                              (["--memory-limit", "1e20"], "--memory-limit: '1e20' is not a "
                               "memory size of at least 1MiB and at most 1PiB, such as 1GB or "
                               "512MiB"),
                              (["--memory-limit", "1e400"], "'1e400' is not a memory size"),
                              (["--memory-limit", "1.5PiB"], "at most 1PiB")):
        with pytest.raises(SystemExit):
            main(["--data", source, "--out", str(tmp_path / "out"), *options])
        error = capsys.readouterr().err
        assert expected in error and error.count("\n") == 1, error
    assert not os.path.exists(tmp_path / "out")


# ------------------------------------------------------------------ times below a second, dates


def test_empty_shards_of_null_columns_are_read_on_both_paths(tmp_path):
    """An empty day's export types its text columns `null`: the shard set was refused
    ("column 'item_id' is null, but string in ..."), blaming every good shard when the empty
    one sorted first."""
    table = _log_table()
    empty = pa.table({name: pa.nulls(0) for name in table.column_names})
    folder = tmp_path / "log"
    folder.mkdir()
    for day, part in enumerate([empty, table.slice(0, 2000), empty, table.slice(2000)]):
        pq.write_table(part, folder / f"day-{day}.parquet")
    manifest = prepare_shards(str(folder), str(tmp_path / "out"), history_length=LENGTH,
                              memory_limit="256MiB")
    log = assert_equal_to_the_in_memory_path(str(folder), str(tmp_path / "out"), manifest)
    assert [shard["rows"] for shard in shards.describe(str(folder))["shards"]] == [
        0, 2000, 0, len(table) - 2000]
    assert len(log) == len(table) - 30                              # the 30 repeated rows


def test_a_corrupt_page_is_named_in_one_line_on_every_path(tmp_path):
    """A shard whose footer reads but whose data does not: `load` said "Corrupt snappy
    compressed data." naming no file, `describe` and `prepare` printed DuckDB's traceback."""
    source = _write(tmp_path / "log", _log_table())
    pq.write_table(_log_table(1), tmp_path / "log" / "part-1.parquet")
    broken = tmp_path / "log" / "part-1.parquet"
    data = bytearray(broken.read_bytes())
    data[8:2000] = bytes(byte ^ 0x5A for byte in data[8:2000])      # pages, not the footer
    broken.write_bytes(bytes(data))
    for message in _three_ways(source, str(tmp_path / "out")):
        assert message.startswith(f"{broken}: cannot read column 'user_id': "), message


def test_a_column_twinned_but_for_case_is_refused_out_of_core(tmp_path):
    """DuckDB's names ignore case: `timestamp` read the text column `Timestamp`."""
    source = _write(tmp_path / "log", pa.table({**LOG, "Timestamp": ["d", "c", "b", "a"]}))
    assert load(source).timestamp.tolist() == [1, 2, 3, 4]
    message = (f"{source}/part-0.parquet: columns 'timestamp' and 'Timestamp' differ only in "
               "case, which describe and prepare (DuckDB) do not tell apart: rename one, or "
               "load the log in memory")
    with pytest.raises(DataError, match=None) as error:
        shards.describe(source)
    assert str(error.value) == message
    with pytest.raises(DataError, match=None) as error:
        prepare_shards(source, str(tmp_path / "out"))
    assert str(error.value) == message
    items = _write(tmp_path / "items", pa.table(LOG),          # the item table's too
                   pa.table({"Item_id": ["x", "Z", "y"], "item_id": ["x", "y", "z"]}))
    assert len(load(items)) == 4
    with pytest.raises(DataError, match=None) as error:
        shards.describe(items)
    assert str(error.value) == (f"{items}/items.parquet: columns 'item_id' and 'Item_id' "
                                "differ only in case, which describe and prepare (DuckDB) do "
                                "not tell apart: rename one, or load the log in memory")


def test_shards_are_read_as_their_files_hold_them_on_both_paths(tmp_path, monkeypatch):
    """Out of core, DuckDB read a `rating=1/` folder as a column that replaced each file's own
    ratings, a file name's `?` as a glob (`p?1.parquet` also read `pa1.parquet`: its rows
    twice), a './' path under another name (the rows' positions were lost), wrote binary
    ids as escapes ('\\xC3\\xA9' for 'é'); a float32 id is written as its float64 on both
    paths (NumPy wrote 2e7 as 2e+07, DuckDB wrote 0.1 as 0.1)."""
    table = _log_table()
    users = [("é" + user).encode() for user in table.column("user_id").to_pylist()]
    _, items = np.unique(table.column("item_id").to_numpy(zero_copy_only=False),
                         return_inverse=True)
    items = np.where(items % 2, items * np.float32(0.1), items * np.float32(1e7))
    table = table.set_column(0, "user_id", pa.array(users, pa.binary())).set_column(
        1, "item_id", pa.array(items.astype(np.float32)))
    folder = tmp_path / "rating=1"
    folder.mkdir()
    cuts = [0, 900, 2000, len(table)]
    for name, start, stop in zip(["p?1", "pa1", "p[2]"], cuts[:-1], cuts[1:]):
        pq.write_table(table.slice(start, stop - start), folder / f"{name}.parquet")
    monkeypatch.chdir(tmp_path)
    manifest = prepare_shards("./rating=1", str(tmp_path / "out"), history_length=LENGTH,
                              memory_limit="256MiB")
    log = assert_equal_to_the_in_memory_path("./rating=1", str(tmp_path / "out"), manifest)
    assert sorted(set(log.rating.tolist())) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(user.startswith("é") for user in log.user_ids)
    assert {"20000000.0", "0.10000000149011612"} <= set(log.item_ids)    # as float64 writes them
    assert shards.describe("./rating=1")["interactions"] == len(log)


@pytest.mark.parametrize("item_types", [(pa.int16(), pa.int32(), pa.int64()),
                                        (pa.float32(), pa.float64(), pa.float32()),
                                        (pa.float16(), pa.float32(), pa.float16())],
                         ids=["integer-items", "float-items", "float16-items"])
def test_shards_whose_columns_differ_only_in_width_read_as_one_file_on_both_paths(tmp_path,
                                                                                item_types):
    """Shards written by other writers (ids of 16, 32 and 64 bits; string, large_string and
    dictionary text; times in ms and us; float32 and float64 ratings) read as one file of the
    widest types would, in memory and out of core; they were refused as other schemas."""
    table = _log_table()
    _, items = np.unique(table.column("item_id").to_numpy(zero_copy_only=False),
                         return_inverse=True)
    items = items * (0.1 if pa.types.is_floating(item_types[0]) else 1)
    micros = (table.column("timestamp").to_numpy() * 86_400 * 10**6
              + np.arange(len(table)) % 7 * 150)          # rows of a second apart by 150 us
    cuts = [0, 900, 2000, len(table)]
    wide = pa.schema([("user_id", pa.large_string()), ("item_id", pa.float64()
                      if pa.types.is_floating(item_types[0]) else pa.int64()),
                      ("timestamp", pa.timestamp("us")), ("rating", pa.float64())])
    folder, parts = tmp_path / "shards", []
    folder.mkdir()
    for index, (start, stop, text, item_type, unit, real) in enumerate(zip(
            cuts[:-1], cuts[1:], [pa.string(), pa.large_string(), None], item_types,
            ["ms", "us", "us"], [pa.float32(), pa.float64(), pa.float32()])):
        users = table.column("user_id").slice(start, stop - start)
        parts.append(pa.table({
            "user_id": users.dictionary_encode() if text is None else users.cast(text),
            "item_id": pa.array(items[start:stop]).cast(item_type, safe=False),
            "timestamp": pa.array(micros[start:stop] // (1000 if unit == "ms" else 1),
                                  pa.timestamp(unit)),
            "rating": table.column("rating").slice(start, stop - start).cast(real)}))
        pq.write_table(parts[-1], folder / f"part-{index}.parquet")
    pq.write_table(pa.concat_tables([part.cast(wide) for part in parts]),
                   tmp_path / "whole.parquet")
    expected, log = load(str(tmp_path / "whole.parquet")), load(str(folder))
    for name in ("user_ids", "item_ids", "user", "item", "timestamp", "rating"):
        np.testing.assert_array_equal(getattr(log, name), getattr(expected, name), err_msg=name)
    manifest = prepare_shards(str(folder), str(tmp_path / "out"), history_length=LENGTH,
                              memory_limit="256MiB")
    assert_equal_to_the_in_memory_path(str(folder), str(tmp_path / "out"), manifest)
    assert shards.describe(str(folder))["interactions"] == len(log)


@pytest.mark.parametrize("times", [
    pa.array(np.array([10_900, 10_200, 5_000, 1_000, 10_900, 10_950, 10_100, 10_500],
                      "datetime64[ms]")),
    pa.array([10.9, 10.2, 5.0, 1.0, 10.9, 10.95, 10.1, 10.5]),
    pa.array(np.array([10_900, 10_200, 5_000, 1_000, 10_900, 10_950, 10_100, 10_500],
                      "timedelta64[ms]")),
    pa.array(["10.9", "10.2", "5", "1", "10.9", "10.95", "10.1", "10.5"]),
], ids=["timestamp-ms", "float-seconds", "duration-ms", "text-seconds"])
def test_rows_within_one_second_keep_their_true_order_on_both_paths(tmp_path, times):
    # u: d c b a in time, a repeated exactly; v: f e e in time, its e rows apart by 0.45 s
    table = pa.table({"user_id": ["u", "u", "u", "u", "u", "v", "v", "v"],
                      "item_id": ["a", "b", "c", "d", "a", "e", "f", "e"], "timestamp": times})
    source = _write(tmp_path / "log", table)
    manifest = prepare_shards(source, str(tmp_path / "out"), history_length=3)
    log = assert_equal_to_the_in_memory_path(source, str(tmp_path / "out"), manifest, length=3)
    assert log.dropped == {"duplicate_row": 1}                  # only the exact repeat
    summary = shards.describe(source)
    assert summary["dropped"] == {"duplicate_row": 1} and summary["interactions"] == 7
    assert log.timestamp.tolist() == [10, 10, 5, 1, 10, 10, 10]
    assert log.item_ids[log.item].tolist() == ["b", "a", "c", "d", "f", "e", "e"]  # placed
    split = temporal_split(log)
    assert log.item_ids[log.item[np.sort(split.test)]].tolist() == ["a", "e"]
    assert log.item_ids[log.item[np.sort(split.validation)]].tolist() == ["b", "e"]
    assert log.item_ids[log.item[np.sort(split.train)]].tolist() == ["c", "d", "f"]
    assert sorted(log.timestamp[split.test].tolist()) == [10, 10]


def test_durations_are_seconds_truncated_toward_zero_on_both_paths(tmp_path):
    # u's rows lie within one second 200 days in, 1 ns apart: as float64 all three are
    # late + 4, and log order would make c the latest
    late = 200 * 86_400 * 10**9
    ticks = [late + 5, late + 3, late + 4, -1_500_000_000, -400_000_000, 2_500_000_000]
    source = _write(tmp_path / "log", pa.table({
        "user_id": ["u", "u", "u", "v", "v", "v"], "item_id": ["a", "b", "c", "a", "b", "c"],
        "timestamp": pa.array(np.array(ticks, "timedelta64[ns]"))}))
    manifest = prepare_shards(source, str(tmp_path / "out"), history_length=2)
    log = assert_equal_to_the_in_memory_path(source, str(tmp_path / "out"), manifest, length=2)
    assert log.timestamp.tolist() == [200 * 86_400] * 3 + [-1, 0, 2]
    split = temporal_split(log)
    assert log.item_ids[log.item[np.sort(split.test)]].tolist() == ["a", "c"]    # latest by ns
    assert shards.describe(source)["time_range"] == [-1, 200 * 86_400]


@pytest.mark.parametrize("unit", ["s", "ms", "us"])
def test_timestamps_beyond_1677_to_2262_are_seconds_on_both_paths(tmp_path, unit):
    """Nanoseconds cannot hold them, so out of core they are not read through them."""
    times = np.array(["3000-01-01T00:00:00.5", "1500-01-01T00:00:00.5", "2000-01-01",
                      "1500-01-01"], "datetime64[ms]").astype(f"datetime64[{unit}]")
    source = _write(tmp_path / "log", pa.table({"user_id": ["u", "u", "v", "v"],
                                                "item_id": ["a", "b", "a", "b"],
                                                "timestamp": pa.array(times)}))
    manifest = prepare_shards(source, str(tmp_path / "out"), history_length=2)
    log = assert_equal_to_the_in_memory_path(source, str(tmp_path / "out"), manifest, length=2)
    half_past = -14831769600 if unit == "s" else -14831769599            # toward zero
    assert log.timestamp.tolist() == [32503680000, half_past, 946684800, -14831769600]
    assert shards.describe(source)["time_range"] == [-14831769600, 32503680000]


def test_a_date_column_is_seconds_on_both_paths(tmp_path):
    days = pa.array(np.array([3, 1, 2, 1, 5], "datetime64[D]"))
    source = _write(tmp_path / "log", pa.table({"user_id": ["u", "u", "u", "v", "v"],
                                                "item_id": ["a", "b", "c", "a", "b"],
                                                "timestamp": days}))
    manifest = prepare_shards(source, str(tmp_path / "out"), history_length=2)
    log = assert_equal_to_the_in_memory_path(source, str(tmp_path / "out"), manifest, length=2)
    assert log.timestamp.tolist() == [3 * 86_400, 86_400, 2 * 86_400, 86_400, 5 * 86_400]
    assert shards.describe(source)["time_range"] == [86_400, 5 * 86_400]


def test_iso_text_times_load_as_in_a_csv_and_out_of_core_are_refused_in_one_line(tmp_path):
    import importlib
    times = ["2020-01-02 10:00:00", "2020-01-01T10:00:00.5", "2020-01-01", "2020-01-03"]
    source = _write(tmp_path / "log", pa.table({**LOG, "timestamp": times}))
    rows = zip(LOG["user_id"], LOG["item_id"], times, LOG["rating"])
    (tmp_path / "log.csv").write_text("user_id,item_id,timestamp,rating\n" + "".join(
        ",".join(map(str, row)) + "\n" for row in rows))
    log, text = load(source), load(str(tmp_path / "log.csv"))
    assert log.timestamp.tolist() == text.timestamp.tolist() == [
        1577959200, 1577872800, 1577836800, 1578009600]
    assert log.item_ids[log.item].tolist() == text.item_ids[text.item].tolist()
    out = str(tmp_path / "out")
    prepare_module = importlib.import_module("tworec.features.prepare")
    for call in (lambda: shards.describe(source),
                 lambda: prepare_shards(source, out, memory_limit="256MiB")):
        with pytest.MonkeyPatch.context() as patch, pytest.raises(DataError) as error:
            patch.setattr(prepare_module, "_labelled_sql", lambda *a, **k: pytest.fail("labelled"))
            call()
        assert str(error.value) == (
            f"{source}: column 'timestamp' holds text that is not a number "
            "('2020-01-02 10:00:00' at row 0); read out of core, a text time must be a number: "
            "write the column as a Parquet timestamp (pyarrow.compute.cast(column, "
            "pyarrow.timestamp('us'))), or load the log in memory, which reads ISO dates and "
            "times")
    assert not os.path.exists(out)


@pytest.mark.parametrize("ratings", [[3.4028235e38, -3.4028235e38, 1.0, 2.0],
                                     ["3.4028235e38", "-3.4028235e38", "1", "2"]])
def test_ratings_that_round_to_float32s_largest_load_on_both_paths(tmp_path, ratings):
    source = _write(tmp_path / "log", pa.table({**LOG, "rating": ratings}))
    largest = float(np.finfo(np.float32).max)
    assert load(source).rating.tolist() == [largest, -largest, 1.0, 2.0]
    assert shards.describe(source)["interactions"] == 4
    assert prepare_shards(source, str(tmp_path / "out"))["rows"] == 4


@pytest.mark.parametrize("column, values, advice", [
    ("timestamp", pa.array([b"1", b"2", b"3", b"4"], pa.binary()), "integers, floats, "
     "timestamps, durations or dates, or load the log in memory, which reads bytes as text"),
    ("rating", pa.array([b"1", b"2", b"3", b"4"], pa.large_binary()),
     "integers or floats, or load the log in memory, which reads bytes as text"),
    ("timestamp", pa.array([1, 2, 3, 4], pa.time32("s")), "integers, floats, timestamps, "
     "durations or dates"),
    ("rating", pa.array([b"1", b"2", b"3", b"4"]).dictionary_encode(),
     "integers or floats, or load the log in memory, which reads bytes as text"),
], ids=["binary-time", "binary-rating", "time-of-day", "dictionary-binary-rating"])
def test_columns_of_a_type_sql_cannot_read_are_refused_out_of_core_in_one_line(
        tmp_path, column, values, advice):
    """Bytes load in memory (read as text), but DuckDB casts no BLOB (or time of day) to a
    number: out of core they are refused by type, before any value is read."""
    source = _write(tmp_path / "log", pa.table({**LOG, column: values}))
    kind = pq.read_schema(os.path.join(source, "part-0.parquet")).field(column).type
    kind = kind.value_type if pa.types.is_dictionary(kind) else kind     # the values' type
    if "bytes" in advice:
        assert getattr(load(source), column).tolist() == LOG[column]
    for call in (lambda: shards.describe(source),
                 lambda: prepare_shards(source, str(tmp_path / "out"))):
        with pytest.raises(DataError) as error:
            call()
        assert str(error.value) == (f"{source}: column {column!r} is of type {kind}, which out "
                                    f"of core is not read as a {column.replace('stamp', '')}: "
                                    f"write it as {advice}")


def test_text_times_beyond_float64_digits_load_exactly_and_out_of_core_are_refused(tmp_path):
    times = ["1577836800123456789", "1577836800123456790", "1577836800123456800", "5"]
    source = _write(tmp_path / "log", pa.table({**LOG, "timestamp": times}))
    assert load(source).timestamp.tolist() == [int(t) for t in times]   # three rows, not two
    for call in (lambda: shards.describe(source),
                 lambda: prepare_shards(source, str(tmp_path / "out"))):
        with pytest.raises(DataError) as error:
            call()
        assert str(error.value) == (
            f"{source}: column 'timestamp' holds a time beyond 2^53 as text "
            "('1577836800123456789' at row 0), which out of core is read through float64 and "
            "would lose digits: write the column as int64")


def test_prepare_notes_the_side_features_its_shards_do_not_hold(tmp_path, capsys):
    source = _write(tmp_path / "log", pa.table({**LOG, "plan": ["p"] * len(LOG["user_id"]),
                                                "color": ["c"] * len(LOG["user_id"])}))
    columns = ["--columns", "user.plan=plan,item.color=color"]
    assert main(["--data", source, "--out", str(tmp_path / "out"), *columns]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (                # before the work
        "[prepare] note: item.color, user.plan not in the prepared shards, which hold ids, "
        "histories, times and ratings: models trained on them read no side features")
    assert json.load(open(tmp_path / "out" / "manifest.json"))["not_read"] == ["item.color",
                                                                            "user.plan"]
    assert prepare_shards(source, str(tmp_path / "plain"))["not_read"] == []
    table = pa.table({"item_id": ["x", "y", "z"], "genres": ["A|B", "A", "B"], "year": [1, 2, 3]})
    with_table = _write(tmp_path / "with_table", pa.table(LOG), items=table)
    notes = []
    assert prepare_shards(with_table, str(tmp_path / "tabled"), note=notes.append)[
        "not_read"] == ["items.parquet's genres", "items.parquet's year"]
    assert notes == ["items.parquet's genres, items.parquet's year not in the prepared shards, "
                     "which hold ids, histories, times and ratings: models trained on them read "
                     "no side features"]
    extra = _write(tmp_path / "extra", pa.table({**LOG, "stars": [1, 2, 3, 4],
                                                 "__index_level_0__": [0, 1, 2, 3]}))
    pq.write_table(pa.table({**LOG, "stars": [1] * 4, "note": ["n"] * 4}),   # a later shard's
                   os.path.join(extra, "part-1.parquet"))                    # own column too
    notes = []
    prepare_shards(extra, str(tmp_path / "extra_out"), note=notes.append)
    assert notes == ["the log's columns ['stars', 'note'] are not read: map one with --columns, "
                     "as user.stars=stars or item.stars=stars"]       # the log has a rating
    assert shards.describe(extra)["unread_columns"] == ["stars", "note"]
    notes = []                           # rating=none: the log's rating is read by no role
    prepare_shards(extra, str(tmp_path / "unrated_out"), note=notes.append,
                   columns={"rating": "none"})
    assert notes == ["the log's columns ['rating', 'stars', 'note'] are not read: map one with "
                     "--columns, as user.rating=rating or item.rating=rating"]


def test_prepare_stopped_by_ctrl_c_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    from tworec.features import prepare as prepare_module
    source = _write(tmp_path / "log", pa.table(LOG))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare_module, "_write_shards", interrupted)     # mid-work
    out = tmp_path / "out"
    assert main(["--data", source, "--out", str(out)]) == 130
    assert capsys.readouterr().err == (f"error: stopped (Ctrl-C); {out} is left as it was: run "
                                       "the same command again\n")
    assert not out.exists()


def test_a_prepared_folder_given_as_a_log_is_named_as_such(tmp_path):
    """Its shards and vocabularies are .parquet files, but not a log: loading or describing it
    says what it is and what reads it (it said users.parquet lacked the item column)."""
    prepared = str(tmp_path / "prepared")
    prepare_shards(_write(tmp_path / "log", pa.table(LOG)), prepared)
    advice = (f"not a log; read it with tworec.features.stream.PreparedLog.load({prepared!r}) "
              "and tworec.retrieval.train.fit_prepared (README: logs larger than memory), or "
              "pass the log it was prepared from")
    inside = [os.path.join(prepared, "shards"), os.path.join(prepared, "shards", "*.parquet"),
              os.path.join(prepared, "shards", "part-00000.parquet")]
    for call in (load, shards.describe, lambda source: prepare_shards(source,
                                                                      str(tmp_path / "again"))):
        with pytest.raises(DataError) as error:
            call(prepared)
        assert str(error.value) == f"{prepared}: a folder that prepare wrote, {advice}"
        for source in inside:                               # its shards: a log of codes
            with pytest.raises(DataError) as error:
                call(source)
            assert str(error.value) == (f"{source}: inside {prepared}, a folder that prepare "
                                        f"wrote, {advice}")
    log = tmp_path / "log"                  # a log's own manifest.json is not prepare's
    (log / "manifest.json").write_text('{"owner": "me"}')
    os.makedirs(log / "shards")
    assert len(load(str(log))) == 4
    beside = _write(os.path.join(prepared, "logs"), pa.table(LOG))    # a log kept inside one
    assert len(load(beside)) == len(load(os.path.join(beside, "*.parquet"))) == 4


def test_a_duckdb_session_draws_no_progress_bar():
    """prepare says its own progress; DuckDB drew its bar over it (and into a library caller's
    output) for any query longer than 2 s. The setting is read in a process of its own: under
    pytest's capture DuckDB leaves the bar off by itself."""
    done = subprocess.run([sys.executable, "-c", "from tworec.features import shards\n"
                           "with shards.duckdb_session('log', '100MB') as connection:\n"
                           "    print(connection.execute(\"SELECT current_setting("
                           "'enable_progress_bar')\").fetchone()[0])"],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout == "False\n", done.stderr[-2000:]


CTRL_C = """
import os, signal, sys, threading, time
from tworec.features import shards
signal.signal(signal.SIGINT, signal.default_int_handler)
start = time.monotonic()
try:
    with shards.duckdb_session("log", "100MB") as connection:
        stop = (connection.interrupt if sys.argv[1] == "interrupt" else
                lambda: os.kill(os.getpid(), signal.SIGINT))
        threading.Timer(0.3, stop).start()
        connection.execute("SELECT COUNT(*) FROM range(2000000000) t(i) "
                           "WHERE i % 7 = 3").fetchall()
except KeyboardInterrupt:
    print(time.monotonic() - start)
"""


@pytest.mark.parametrize("how", ["interrupt", "SIGINT"])
def test_a_duckdb_query_stopped_by_ctrl_c_is_a_keyboard_interrupt(how):
    """DuckDB answers Ctrl-C during a query with its own error ("Query interrupted"), which
    prepare's one line for Ctrl-C would miss: the session raises KeyboardInterrupt. In a
    process of its own, on a query of a few seconds: DuckDB 2.0's client does not always stop
    at a SIGINT (a second query a process interrupts, and once in CI the first, ran to its
    end before it raised: 35 s on the 10^10 rows this test read)."""
    done = subprocess.run([sys.executable, "-c", CTRL_C, how], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout, done.stderr[-2000:]


def test_memory_sizes_read_up_to_the_limit_they_name():
    """The refusal named 1PiB as the largest size, and refused it: no unit read it."""
    from tworec.features.shards import memory_bytes
    assert memory_bytes("1PiB") == 2 ** 50 and memory_bytes("1PB") == 10 ** 15
    assert memory_bytes("512MiB") == 512 << 20
