"""Mistakes in a generic log caught before any work, each with one line naming the file and
what would work: binary files named .csv, delimiters other than ',', decimal commas."""
import argparse
import datetime as dt
import gzip
import io
import os
import subprocess
import sys
import zipfile
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tworec.features import DataError, load, sources, split
from tworec.features.sources import has_fixed_columns, is_release, read_titles, release_gaps
from tworec.pipeline import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = [("user_id", "item_id", "timestamp", "rating", "title"),
        ("a", "x", "3", "4.5", "Toy Story"),
        ("a", "y", "1", "2", "Heat"),
        ("b", "x", "2", "5", "Toy Story")]
MAPPING = {"user": "user_id", "item": "item_id", "time": "timestamp", "rating": "rating",
           "item.title": "title"}


def write_log(path, delimiter=",", rows=ROWS) -> str:
    path.write_text("".join(delimiter.join(row) + "\n" for row in rows))
    return str(path)


def assert_same_log(got, want):
    for name in ("user_ids", "item_ids", "user", "item", "timestamp", "rating"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert got.item_features.keys() == want.item_features.keys()
    for name, values in want.item_features.items():
        np.testing.assert_array_equal(got.item_features[name], values, err_msg=name)
    assert got.dropped == want.dropped


def load_error(path, **options) -> str:
    """The message of the DataError that loading `path` raises; it must be one line."""
    with pytest.raises(DataError) as error:
        load(str(path), columns=MAPPING, **options)
    message = str(error.value)
    assert "\n" not in message, message
    return message


def parquet_bytes() -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"user_id": ["a"], "item_id": ["x"], "timestamp": [1]}), buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("content, expected", [
    (gzip.compress(b"user_id,item_id,timestamp\na,x,1\n", mtime=0), "gzip-compressed: rename it"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10", "not UTF-8 at offset 0"),
    (np.random.default_rng(0).bytes(4096), "not a text CSV"),
    (b"user_id,item_id,timestamp\na,x,\x001\n", "a NUL byte at offset 30"),
    (parquet_bytes(), "it is a Parquet file: rename it"),
    ("user_id,item_id,timestamp\na,x,1\n".encode("utf-16"), "UTF-16 text: save it as UTF-8"),
], ids=["gzip", "png", "random-bytes", "nul-byte", "parquet", "utf-16"])  # same on every worker
def test_a_binary_file_named_csv_is_not_a_text_csv(tmp_path, content, expected):
    path = tmp_path / "data.csv"
    path.write_bytes(content)
    message = load_error(path)
    assert message.startswith(f"{path}: not a text CSV") and expected in message


def test_gzip_compressed_logs_are_read_as_they_are(tmp_path):
    plain = load(write_log(tmp_path / "log.csv"), columns=MAPPING)
    for name, delimiter in (("log.csv.gz", ","), ("log.tsv.gz", "\t")):
        text = "".join(delimiter.join(row) + "\n" for row in ROWS)
        (tmp_path / name).write_bytes(gzip.compress(text.encode()))
        assert_same_log(load(str(tmp_path / name), columns=MAPPING), plain)
    (tmp_path / "plain.csv.gz").write_text("user_id,item_id,timestamp\na,x,1\n")
    assert "if it is not gzip-compressed, drop .gz" in load_error(tmp_path / "plain.csv.gz")


@pytest.mark.parametrize("delimiter", [";", "\t", "|"])
def test_the_delimiter_is_detected_from_the_header(tmp_path, delimiter):
    commas = load(write_log(tmp_path / "commas.csv"), columns=MAPPING)
    other = load(write_log(tmp_path / "other.csv", delimiter), columns=MAPPING)
    assert_same_log(other, commas)
    assert len(commas.user_ids) == 2 and commas.rating.tolist() == [4.5, 2, 5]


@pytest.mark.parametrize("given", [";", "tab", "\\t"])
def test_an_explicit_delimiter(tmp_path, given):
    actual = ";" if given == ";" else "\t"
    commas = load(write_log(tmp_path / "commas.csv"), columns=MAPPING)
    assert_same_log(load(write_log(tmp_path / "log.txt", actual), columns=MAPPING,
                         delimiter=given), commas)


def test_a_wrong_explicit_delimiter_names_itself_and_the_header(tmp_path):
    path = write_log(tmp_path / "log.csv", ";")
    message = load_error(path, delimiter=",")
    assert message == (f"{path}: --delimiter ',' does not split the header "
                       "'user_id;item_id;timestamp;rating;title' into the needed columns; it is "
                       "';'-separated: pass --delimiter ';' or leave it out")
    colons = write_log(tmp_path / "colons.csv", ":")
    assert "--delimiter '|' does not split the header 'user_id:item_id" in load_error(
        colons, delimiter="|")
    assert "pass the character that separates its columns" in load_error(colons, delimiter="|")
    assert "expected one character" in load_error(path, delimiter=";;")
    with pytest.raises(DataError, match="synthetic:tiny is not a text log"):
        load("synthetic:tiny", delimiter=";")


@pytest.mark.parametrize("name", ["synthetic", "synthetic:tiny", "tfds:movielens"])
def test_a_release_in_a_folder_named_as_a_source_is_not_read_as_one(tmp_path, monkeypatch,
                                                                     name):
    """`load` reads `synthetic` and `tfds:NAME` as theirs, whatever folder has that name."""
    monkeypatch.chdir(tmp_path)
    os.mkdir(name)
    with open(os.path.join(name, "ratings.csv"), "w") as ratings:
        ratings.write("userId,movieId,rating,timestamp\n1,2,3.0,4\n")
    assert is_release(str(tmp_path / name)) and release_gaps(str(tmp_path / name))
    assert not is_release(name) and release_gaps(name) == []


def test_columns_are_refused_for_sources_with_fixed_columns(tmp_path):
    """--columns would be ignored by a synthetic, TFDS or GroupLens source (a release folder or
    .zip): refused, naming it; a folder that is no release keeps its own message."""
    release = tmp_path / "ml-latest-small"
    release.mkdir()
    (release / "ratings.csv").write_text("userId,movieId,rating,timestamp\n1,2,3.0,4\n")
    archive = str(tmp_path / "ml-latest-small.zip")
    with zipfile.ZipFile(archive, "w") as packed:
        packed.write(release / "ratings.csv", "ml-latest-small/ratings.csv")
    for source in ("synthetic:tiny", "tfds:movielens/100k-ratings", str(release), archive):
        assert has_fixed_columns(source)
        assert is_release(source) == (source in (str(release), archive))
        with pytest.raises(DataError) as error:
            load(source, columns={"user": "u"})
        assert str(error.value) == (f"--columns user=u: {source} has fixed columns; the option "
                                    "applies only to .csv/.tsv/.parquet logs and Parquet shards")
    logs = tmp_path / "logs"
    logs.mkdir()
    write_log(logs / "part-0.csv")
    assert not has_fixed_columns(str(logs)) and not has_fixed_columns(write_log(
        tmp_path / "log.csv")) and not has_fixed_columns(str(tmp_path / "missing"))
    assert load_error(logs).endswith(
        "unknown format: expected u.data (ml-100k), ratings.dat (ml-1m, ml-10m) or ratings.csv "
        "(ml-latest, ml-20m, ml-25m); found ['part-0.csv']; to read a text log, pass the file "
        "itself (a folder of text parts is not read as one log: write them as Parquet shards)")
    pq.write_table(pa.table({"user_id": ["a"], "item_id": ["x"], "timestamp": [1]}),
                   release / "part-0.parquet")
    assert not has_fixed_columns(str(release))             # read as Parquet shards, as load does


def test_a_folder_or_zip_of_two_releases_is_refused_naming_both(tmp_path):
    """Two releases' ratings in one folder or zip (ml-100k beside ml-latest-small, or two
    copies of one): none is read on its own choice; both are named."""
    ratings = "userId,movieId,rating,timestamp\n1,2,3.0,4\n"
    for folder, name, text in (("ml-100k", "u.data", "1\t10\t3\t100\n"),
                               ("ml-latest-small", "ratings.csv", ratings)):
        (tmp_path / "both" / folder).mkdir(parents=True)
        (tmp_path / "both" / folder / name).write_text(text)
    archive = str(tmp_path / "copies.zip")
    with zipfile.ZipFile(archive, "w") as packed:
        for copy in ("ml-latest-small", "ml-latest-small (1)"):
            packed.writestr(f"{copy}/ratings.csv", ratings)
    assert load(str(tmp_path / "both" / "ml-100k")).num_users == 1           # one alone: read
    for source, found in ((tmp_path / "both", "ml-100k/u.data, ml-latest-small/ratings.csv"),
                          (archive, "ml-latest-small (1)/ratings.csv, "
                                    "ml-latest-small/ratings.csv")):
        assert load_error(source) == (f"{source}: holds more than one release's ratings "
                                      f"({found}); pass the folder or .zip of one release")
        assert not is_release(str(source))


@pytest.mark.parametrize("name, text, columns, advice", [
    ("comma.tsv", "user_id,item_id,timestamp\na,x,1\n", {},
     "the header is one column: pass --delimiter ','"),
    ("spaced.csv", "user_id, item_id, timestamp\na, x, 1\n", {},
     "the header names [' item_id'] have spaces around them, which --columns cannot name: "
     "write the file without them"),
    ("spaced.csv", "user_id, item_id, timestamp\na, x, 1\n",
     {"item": "item_id", "time": "timestamp"},
     "the header names [' item_id'] have spaces around them, which --columns cannot name: "
     "write the file without them"),
    ("noted.csv", "person,item_id,timestamp, note \na,x,1,y\n", {},   # a name no role wants
     "map it with --columns user=NAME (the header names [' note '] have spaces around them, "
     "which --columns cannot name: write the file without them to map one)"),
    ("skus.csv", "uid, sku, ts\na, x, 1\n", {},                 # the item's is one of them
     "map it with --columns item=NAME (the header names [' sku', ' ts'] have spaces around "
     "them, which --columns cannot name: write the file without them to map one)")])
def test_a_header_no_mapping_can_read_says_what_would(tmp_path, name, text, columns, advice):
    """Advice to map a column with --columns cannot help a header read as one column (another
    delimiter) or names with spaces around them (after ", "): the message says what would."""
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError) as error:
        load(str(tmp_path / name), columns=columns)
    assert str(error.value).endswith(advice)


def test_a_tsv_stays_tab_separated(tmp_path):
    rows = [("user_id", "item_id", "timestamp", "tags,of,the,item")] + [
        (user, item, time, "a,b,c,d") for user, item, time, *_ in ROWS[1:]]
    log = load(write_log(tmp_path / "log.tsv", "\t", rows))
    assert log.item_ids.tolist() == ["x", "y"] and log.timestamp.tolist() == [3, 1, 2]


def test_quoted_fields_may_hold_the_delimiter(tmp_path):
    rows = [ROWS[0]] + [row[:4] + (f'"{row[4]}; the film"',) for row in ROWS[1:]]
    log = load(write_log(tmp_path / "log.csv", ";", rows), columns=MAPPING)
    assert log.item_features["title"].tolist() == ["Toy Story; the film", "Heat; the film"]
    assert log.rating.tolist() == [4.5, 2, 5]


def test_decimal_commas_in_a_file_not_separated_by_commas(tmp_path):
    commas = load(write_log(tmp_path / "commas.csv"), columns=MAPPING)
    rows = [row[:3] + (row[3].replace(".", ","),) + row[4:] for row in ROWS]
    assert_same_log(load(write_log(tmp_path / "semicolons.csv", ";", rows), columns=MAPPING),
                    commas)
    quoted = [row[:3] + (f'"{row[3]}"',) + row[4:] for row in rows]
    message = load_error(write_log(tmp_path / "quoted.csv", ",", quoted))
    assert message.endswith("column 'rating' is not numeric (first value that is not a number: "
                            "'4,5', at row 0; write numbers with a decimal point)")


def test_the_run_scripts_record_the_delimiter():
    parser = argparse.ArgumentParser()
    cli.add_run_arguments(parser)
    given = cli.source_of(parser.parse_args(["--data", "log.csv", "--delimiter", ";",
                                             "--out", "run"]))
    assert given == {"data": "log.csv", "columns": {}, "delimiter": ";"}
    assert cli.source_of(parser.parse_args(["--out", "run"]))["delimiter"] is None


@pytest.mark.parametrize("make, options, expected", [
    (lambda path: path.write_bytes(gzip.compress(b"user_id,item_id,timestamp\na,x,1\n")), [],
     "not a text CSV"),
    (lambda path: write_log(path, ";"), ["--delimiter", ","], "--delimiter ',' does not split"),
])
def test_describe_data_stops_with_one_line_and_exit_code_2(tmp_path, make, options, expected):
    path = tmp_path / "bad.csv"
    make(path)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "describe_data.py"),
                           "--data", str(path), *options], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"error: {path}: ") and expected in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_reading_a_log_needs_no_tensorflow():
    code = "import sys, tworec.features.sources; sys.exit('tensorflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_text_ids_stay_text(tmp_path):
    path = write_log(tmp_path / "log.csv", rows=[
        ("user_id", "item_id", "timestamp"), ("007", "0100", "1"), ("7", "100", "2"),
        ("1e3", "0100", "3"), ("1000", "100", "4")])
    log = load(path)
    assert log.user_ids.tolist() == ["007", "7", "1e3", "1000"]
    assert log.item_ids.tolist() == ["0100", "100"] and log.dropped == {}
    (tmp_path / "movies.csv").write_text("item_id,title\n0100,Zero\n100,Hundred\n")
    titles = read_titles(str(tmp_path / "movies.csv"))
    assert [titles[item] for item in log.item_ids] == ["Zero", "Hundred"]


def test_missing_markers_in_text_ids_are_missing_values(tmp_path):
    """R and pandas write a missing value as NA: an id column holding one unquoted is refused
    as missing, not read as a user called 'NA'; a quoted "NA" is an id."""
    path = write_log(tmp_path / "log.csv", rows=[
        ("user_id", "item_id", "timestamp"), ("1", "10", "100"), ("NA", "11", "101"),
        ("2", "12", "102")])
    with pytest.raises(DataError, match="column 'user_id' has 1 missing values"):
        load(path)
    quoted = tmp_path / "quoted.csv"                   # R writes the id "NA" quoted
    quoted.write_text('user_id,item_id,timestamp\n"NA","10",100\n"2","null",101\n')
    log = load(str(quoted))
    assert log.user_ids.tolist() == ["NA", "2"] and log.item_ids.tolist() == ["10", "null"]
    side = tmp_path / "side.csv"                       # a side feature's NA stays its text
    side.write_text("user_id,item_id,timestamp,occupation\n1,10,100,NA\n2,11,101,writer\n")
    log = sources.load_table(str(side), {"user": "user_id", "item": "item_id",
                                         "time": "timestamp", "user.occupation": "occupation"})
    assert log.user_features["occupation"].tolist() == ["NA", "writer"]


def test_text_times_outside_nanoseconds_range_are_read(tmp_path):
    path = write_log(tmp_path / "log.csv", rows=[
        ("user_id", "item_id", "timestamp"), ("a", "x", "1600-01-01 00:00:00"),
        ("a", "y", "2024-01-01 00:00:01")])
    assert load(path).timestamp.tolist() == [-11_676_096_000, 1_704_067_201]


def test_late_rows_cannot_break_the_types_of_the_first_block(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "BLOCK_SIZE", 1 << 10)             # ~70 rows a block
    rows = [("user_id", "item_id", "timestamp", "rating")] + [
        (str(k % 7), str(k % 5), str(1_600_000_000_000_000_000 + k), "4") for k in range(300)]
    rows[-1] = ("u-late", "i-late", rows[-1][2], "3.5")             # text ids, a half rating
    log = load(write_log(tmp_path / "log.csv", rows=rows))
    assert len(log) == 300 and log.dropped == {}
    assert log.user_ids[log.user[-1]] == "u-late" and log.item_ids[log.item[-1]] == "i-late"
    assert log.rating[-1] == 3.5 and log.rating.dtype == np.float32
    assert log.timestamp[-1] == 1_600_000_000_000_000_299                # int64, not float
    rows = [rows[0]] + [(user, item, str(k), rating) for k, (user, item, _, rating)
                        in enumerate(rows[1:])]
    rows[150] = rows[150][:2] + ("1.5",) + rows[150][3:]            # a late fractional time
    late = load(write_log(tmp_path / "late.csv", rows=rows))
    assert late.timestamp[149] == 1 and len(late) == 300
    rows[200] = rows[200][:2] + ("NA",) + rows[200][3:]             # a late missing time
    with pytest.raises(DataError, match=r"holes.csv: column 'timestamp' has 1 missing values "
                                        r"\(first at row 199\)$"):
        load(write_log(tmp_path / "holes.csv", rows=rows))


def test_an_empty_id_in_a_text_log_is_refused_naming_its_column_and_row(tmp_path):
    path = write_log(tmp_path / "log.csv", rows=[
        ("user_id", "item_id", "timestamp"), ("a", "x", "1"), ("a", "", "2"), ("b", "", "3")])
    with pytest.raises(DataError) as error:
        load(path)
    assert str(error.value) == (f"{path}: column 'item_id' has 2 empty ids (first at row 1); "
                                "every row needs a user and an item id")


def test_times_below_a_second_order_a_text_log_and_are_not_duplicates(tmp_path):
    path = write_log(tmp_path / "log.csv", rows=[
        ("user_id", "item_id", "timestamp"), ("u", "a", "10.9"), ("u", "b", "10.2"),
        ("u", "c", "5.0"), ("u", "d", "1.0"), ("u", "a", "10.95")])
    log = load(path)
    parts = split(log, "temporal")
    assert log.dropped == {} and log.timestamp.tolist() == [10, 10, 5, 1, 10]
    assert log.item_ids[log.item[parts.test]].tolist() == ["a"]            # the one at 10.95
    assert log.item_ids[log.item[parts.validation]].tolist() == ["a"]      # the one at 10.9
    assert log.item_ids[log.item[parts.train]].tolist() == ["b", "c", "d"]


@pytest.mark.parametrize("times, expected", [
    (np.array([1, 2, 3], "timedelta64[m]"), [60, 120, 180]),
    (np.array([1, 2, 3], "timedelta64[h]"), [3600, 7200, 10800]),
    (np.array([-1500, 100, 2500], "timedelta64[ms]"), [-1, 0, 2]),       # toward zero
    (np.array(["2300-01-01", "1600-01-01", "2000-01-01"], "datetime64[10ms]"),
     [10413792000, -11676096000, 946684800]),
    (np.array([1, "NaT", 3], "timedelta64[s]"), "column 'timestamp' has 1 missing values "
                                                "(first at row 1)"),
    (np.array(["1", "2020-01-01", "3"], object), "column 'timestamp' is neither all numbers "
     "nor all ISO dates and times (first odd value: '2020-01-01', at row 1)"),
    (np.array(["2020-01-01", "oops", "2020-01-03"]), "column 'timestamp' is neither all "
     "numbers nor all ISO dates and times (first odd value: 'oops', at row 1)"),
    (np.array(["2020-01-01", "2020-01-02", "5x"]), "column 'timestamp' is neither all "
     "numbers nor all ISO dates and times (first odd value: '5x', at row 2)"),
    (np.array(["2020-01-01", "2020-01-02", "5"]), "column 'timestamp' is neither all "
     "numbers nor all ISO dates and times (first odd value: '5', at row 2)"),
    (np.array(["2020-01-01", "5", "oops", "2020-01-02"]), "column 'timestamp' is neither all "
     "numbers nor all ISO dates and times (first odd value: 'oops', at row 2)"),
    (np.array(["2020-01-01", "2020-02-30", "2020-01-03"]), "column 'timestamp' holds ISO "
     "dates and times that no one timestamp type reads all of (first '2020-02-30', at row 1: "
     "an impossible date such as 2020-02-30, a time with an offset beside times without one, "
     "or other text)"),
    (np.array(["2020-01-01T10:00", "2020-01-02T10:00", "2020-01-03T10:00+01:00"]),
     "column 'timestamp' holds ISO dates and times that no one timestamp type reads all of "
     "(first '2020-01-03T10:00+01:00', at row 2: an impossible date such as 2020-02-30, a time "
     "with an offset beside times without one, or other text)"),
    (np.array(["2020-01-01T10:00+01:00", "2020-01-02T10:00", "2020-01-03T10:00"]),
     "column 'timestamp' holds ISO dates and times that no one timestamp type reads all of "
     "(first '2020-01-02T10:00', at row 1: an impossible date such as 2020-02-30, a time "
     "with an offset beside times without one, or other text)"),
    (np.array(["2300-01-01", "2300-01-02", "1600-01-01"], "datetime64[D]"),
     [10413792000, 10413878400, -11676096000]),
    (np.array([1, 2, 3], "timedelta64"), "column 'timestamp' is a timedelta64 without a unit; "
                                         "give it one (values.astype('m8[s]'))"),
    (np.array([0, 2**50, 1], "datetime64[D]"),
     "column 'timestamp' has 1 times that are infinite or beyond ±2^63 seconds (first at row 1)"),
    (np.array([0, 1, 2**62], "timedelta64[m]"),
     "column 'timestamp' has 1 times that are infinite or beyond ±2^63 seconds (first at row 2)"),
    (np.array([1_500_000_000_000, -2_500_000_000_000, 3], "timedelta64[ps]"), [1, -2, 0]),
    (np.array([0, 1, 2**62], "timedelta64[3ps]"),
     "column 'timestamp' has 1 times that are infinite or beyond ±2^63 seconds (first at row 2)"),
    (np.array([1.0, 2.0, 3.0], np.float16), [1, 2, 3]),
    (np.array([np.datetime64("2020-01-01T00:00:00.0"), np.datetime64("2020-01-01T10:00:00.5"),
               np.datetime64("1970-01-02T00:00:00.0")], object), [1577836800, 1577872800, 86400]),
    (np.array([np.datetime64("3000-01-01"), np.datetime64("2020-01-01T00:00:00.000000001"),
               np.datetime64("1970-01-02")], object), "column 'timestamp' holds NumPy times of "
     "several types, or beside other values (datetime64[D], datetime64[ns]); give them one type "
     "(np.array(values, 'datetime64[s]'))"),
    (np.array([np.datetime64("2020-01-01"), 5, 6], object), "column 'timestamp' holds NumPy "
     "times of several types, or beside other values (<class 'int'>, datetime64[D]); give them "
     "one type (np.array(values, 'datetime64[s]'))"),
    (np.array([5, np.datetime64("2020-01-01"), 6], object), "column 'timestamp' holds NumPy "
     "times of several types, or beside other values (<class 'int'>, datetime64[D]); give them "
     "one type (np.array(values, 'datetime64[s]'))"),          # not read as 18262 days
    (np.array(["1", "0x10", "3"]), "column 'timestamp' is neither all numbers nor all ISO "
     "dates and times (first value that is not a number: '0x10', at row 1)"),
    (np.array(["1", "2", "0xFFFFFFFFFFFFFFFF"]), "column 'timestamp' is neither all numbers nor "
     "all ISO dates and times (first value that is not a number: '0xFFFFFFFFFFFFFFFF', at row "
     "2)"),                          # Arrow alone reads it as -1; out of core, it is refused
    ([dt.datetime(2020, 1, 1), dt.datetime(2020, 1, 1, 10, 0, 0, 500000),
      dt.datetime(1970, 1, 2)], [1577836800, 1577872800, 86400]),
    ([dt.datetime(2020, 1, 1, 2, tzinfo=dt.timezone(dt.timedelta(hours=2))),
      dt.datetime(1970, 1, 2, tzinfo=dt.timezone.utc), dt.datetime(1970, 1, 1)],
     [1577836800, 86400, 0]),
    ([dt.date(2020, 1, 1), dt.date(1970, 1, 2), dt.date(1970, 1, 1)], [1577836800, 86400, 0]),
    ([dt.datetime(2020, 1, 1), dt.date(1970, 1, 2), dt.datetime(1970, 1, 1)],
     "column 'timestamp' holds Python dates beside date-times or other values; give it dates "
     "only or date-times only"),
    ([dt.datetime(2020, 1, 1), None, dt.datetime(1970, 1, 1)],
     "column 'timestamp' has 1 missing values (first at row 1)"),
    ([None, dt.datetime(2020, 1, 1), float("nan")],
     "column 'timestamp' has 2 missing values (first at row 0)"),
], ids=["minutes", "hours", "negative-ms", "10ms-dates", "NaT", "a-date-among-numbers",
        "a-typo-among-dates", "a-non-number-among-dates", "a-number-among-dates", "a-typo-among-both",
        "an-impossible-date", "an-offset-after-times-without", "times-without-after-an-offset",
        "days-past-2262", "no-unit", "days-beyond-2^63-seconds",
        "minutes-that-wrap-to-0", "picoseconds", "3-picosecond-ticks-that-wrap", "float16",
        "datetime64-objects", "datetime64-objects-of-two-units", "a-datetime64-among-numbers",
        "a-datetime64-after-a-number", "hexadecimal", "hexadecimal-that-wraps",
        "python-datetimes", "aware-python-datetimes", "python-dates",
        "a-python-date-among-datetimes", "a-missing-python-datetime",
        "missing-python-datetimes-first"])
@pytest.mark.filterwarnings("error::RuntimeWarning")             # float16 warned, overflowing
def test_library_callers_times_are_seconds_or_refused_in_one_line(times, expected):
    def log():
        return sources.from_columns("log", ["u", "u", "v"], ["a", "b", "a"], times)
    if isinstance(expected, str):
        with pytest.raises(DataError, match=None) as error:
            log()
        assert str(error.value) == f"log: {expected}"
    else:
        assert sorted(log().timestamp.tolist()) == sorted(expected)


class NotAvailable:
    """As pandas' NA (a nullable column's `to_numpy()`): compared, it is itself, and it has
    no truth value."""

    def __ne__(self, other):
        return self

    def __bool__(self):
        raise TypeError("boolean value of NA is ambiguous")


@pytest.mark.parametrize("users", [["u", None, "v"], ["u", float("nan"), "v"],
                                   np.array([1.0, np.nan, 2.0]),
                                   [Decimal(1), Decimal("sNaN"), Decimal(2)],
                                   np.array(["u", NotAvailable(), "v"], dtype=object)],
                         ids=["None", "NaN", "float-NaN", "signalling-Decimal-NaN", "pandas-NA"])
def test_library_callers_missing_ids_are_refused_not_read_as_text(users):
    with pytest.raises(DataError) as error:
        sources.from_columns("log", users, ["a", "b", "a"], [1, 2, 3])
    assert str(error.value) == "log: column 'user' has 1 missing values (first at row 1)"


def test_library_callers_ids_are_written_as_numpy_writes_them():
    log = sources.from_columns("log", [1, 2.5, 3], ["a", "b", "a"], [1, 2, 3])
    assert sorted(log.user_ids) == ["1.0", "2.5", "3.0"]       # as np.array([1, 2.5, 3]) would
    log = sources.from_columns("log", [0.0, -0.0, 1.0], ["a", "b", "a"], [1, 2, 3])
    assert log.user_ids.tolist() == ["0.0", "-0.0", "1.0"]     # two ids, as their texts differ
    for ids in (np.array([b"a", b"a\0", b"b"], dtype=object), ["a", "a\0", "b"]):
        with pytest.raises(DataError) as error:        # NumPy's text would drop the NUL: "a"
            sources.from_columns("log", ids, ["x", "y", "x"], [1, 2, 3])
        assert str(error.value).startswith("log: column 'user' has 1 ids holding a NUL "
                                           "character (first at row 1)")
    floats = np.array([0.1, 2e7, 0.1], np.float32)
    scalars = np.array(list(floats), dtype=object)                    # of NumPy float32s
    assert (sources.from_columns("log", scalars, ["x", "y", "x"], [1, 2, 3]).user_ids
            == sources.from_columns("log", floats, ["x", "y", "x"], [1, 2, 3]).user_ids).all()
    held = np.empty(3, dtype=object)
    held[:] = [bytearray(b"alice"), memoryview(b"bob"), b"alice"]
    for ids in ([b"alice", b"bob", b"alice"], np.array([b"alice", b"bob", b"alice"]),
                [bytearray(b"alice"), memoryview(b"bob"), b"alice"], held):
        log = sources.from_columns("log", ids, ["x", "y", "x"], [1, 2, 3])
        assert log.user_ids.tolist() == ["alice", "bob"]     # not NumPy's NUL-padded bytes
    mixed = sources.from_columns("log", [bytearray(b"alice"), 7, b"alice"], ["x", "y", "x"],
                                 [1, 2, 3])
    assert sorted(mixed.user_ids) == ["7", "alice"]
    held[1] = bytearray(b"\xff")                       # nor a bytearray's repr as its id
    with pytest.raises(DataError) as error:
        sources.from_columns("log", held, ["x", "y", "x"], [1, 2, 3])
    assert str(error.value).startswith("log: column 'user' has 1 ids that are not UTF-8 text")
    for ids, kind in (([dt.time(1), dt.time(2)], "time"), ([True, False], "bool"),
                      ([True, 2], "bool")):                  # NumPy makes it [1, 2]
        with pytest.raises(DataError) as error:
            sources.from_columns("log", ids, ["x", "y"], [1, 2])
        assert str(error.value).startswith(f"log: column 'user' holds {kind} values, which are "
                                           "not read as ids")
    with pytest.raises(DataError) as error:
        sources.from_columns("log", [["u"], ["v"]], ["a", "b"], [1, 2])
    assert str(error.value) == ("log: column 'user' is of shape (2, 1); give one id a row, a "
                                "flat list or array")


SIDE = ("user,item,time,genre,yr\nu1,i1,1,Action|Comedy,1995\nu1,i2,2,Drama,2001.0\n"
        "u2,i1,3,Action|Comedy,1995\nu2,i3,4,(no genres listed),1990\n"
        "u2,i4,5, Comedy | Drama|,1990\nu3,i5,6,,1990\n")
SIDE_COLUMNS = {"user": "user", "item": "item", "time": "time"}


def test_a_logs_item_genres_and_years_are_read_as_the_models_read_them(tmp_path):
    """item.genres: names joined by '|', as MovieLens writes them, into a multi-hot table;
    item.year: whole numbers (a float column was refused with NumPy's words, text genres
    with "could not convert string to float")."""
    (tmp_path / "log.csv").write_text(SIDE)
    log = load(str(tmp_path / "log.csv"), {**SIDE_COLUMNS, "item.genres": "genre",
                                           "item.year": "yr"})
    assert log.item_ids.tolist() == ["i1", "i2", "i3", "i4", "i5"]
    assert list(log.genre_names) == ["Action", "Comedy", "Drama"]         # spaces, "" dropped
    assert log.item_features["genres"].tolist() == [[1, 1, 0], [0, 0, 1], [0, 0, 0], [0, 1, 1],
                                                    [0, 0, 0]]
    assert log.item_features["year"].tolist() == [1995, 2001, 1990, 1990, 1990]
    assert log.item_features["year"].dtype == np.int32


@pytest.mark.parametrize("columns, expected", [
    ({"item.genres": "yr"}, "column 'yr' (item.genres) is not text; give each item's genre "
                            "names joined by '|' (Action|Comedy)"),
    ({"item.year": "genre"}, "column 'genre' is not years as item.year takes them, whole "
     "numbers such as 1995 (first value that is not a number: 'Action|Comedy', at row 0)"),
], ids=["numbers-as-genres", "genres-as-years"])
def test_item_genres_or_years_of_another_form_are_refused_naming_the_column(tmp_path, columns,
                                                                          expected):
    (tmp_path / "log.csv").write_text(SIDE)
    with pytest.raises(DataError) as error:
        load(str(tmp_path / "log.csv"), {**SIDE_COLUMNS, **columns})
    assert str(error.value) == f"{tmp_path / 'log.csv'}: {expected}"


def test_item_years_that_are_not_whole_are_refused(tmp_path):
    (tmp_path / "log.csv").write_text(SIDE.replace("2001.0", "2001.5"))
    with pytest.raises(DataError) as error:
        load(str(tmp_path / "log.csv"), {**SIDE_COLUMNS, "item.year": "yr"})
    assert str(error.value) == (f"{tmp_path / 'log.csv'}: column 'yr' has 1 years that are not "
                                "whole numbers (first at row 1)")


def test_item_genres_of_too_many_names_are_refused_before_the_dense_table(tmp_path,
                                                                          monkeypatch):
    """item.genres mapped to free-text tags made a dense [items, tags] table (10,000 tags
    of 10,000 items: 400 MB); past GENRES_TABLE_BYTES the log is refused naming the column
    and the counts."""
    monkeypatch.setattr(sources, "GENRES_TABLE_BYTES", 4 * 5 * 3 - 1)   # 5 items, 3 genres
    (tmp_path / "log.csv").write_text(SIDE)
    with pytest.raises(DataError) as error:
        load(str(tmp_path / "log.csv"), {**SIDE_COLUMNS, "item.genres": "genre"})
    assert str(error.value).startswith(
        f"{tmp_path / 'log.csv'}: column 'genre' (item.genres) has 3 distinct genre names over "
        "5 items: its dense multi-hot table would take ")
    assert str(error.value).endswith("; map item.genres to a column of a few genres joined by "
                                     "'|' (MovieLens has 20), or leave it out")
    monkeypatch.setattr(sources, "GENRES_TABLE_BYTES", 4 * 5 * 3)
    assert load(str(tmp_path / "log.csv"), {**SIDE_COLUMNS, "item.genres": "genre"}
                ).item_features["genres"].shape == (5, 3)


def test_text_numbers_are_ascii_and_an_empty_text_column_passes():
    """Non-ASCII digits are refused (out of core refuses them too); a text column without a
    value (Arrow's check of no value gives None, not True) is no error of its own."""
    from tworec.features.sources import _numeric
    assert _numeric("log", "t", np.array([], dtype=object)).size == 0
    assert _numeric("log", "t", np.array(["1", " 2.5"], dtype=object)).tolist() == [1.0, 2.5]
    with pytest.raises(DataError, match="'t'"):
        _numeric("log", "t", np.array(["1", "\u0661"], dtype=object))


def test_item_and_user_features_come_from_the_rows_kept_alike(tmp_path):
    """A row repeating another but for its side features is a duplicate, dropped: the user's
    plan came from the kept row, the item's year from the dropped one."""
    (tmp_path / "log.csv").write_text("user_id,item_id,timestamp,plan,year\n"
                                      "a,x,1,free,1990\na,x,1,paid,1991\na,y,2,free,2000\n")
    log = load(str(tmp_path / "log.csv"), {"user.plan": "plan", "item.year": "year"})
    assert log.dropped == {"duplicate_row": 1}
    assert log.user_features["plan"].tolist() == ["free"]
    assert dict(zip(log.item_ids.tolist(), log.item_features["year"].tolist())) == {
        "x": 1990, "y": 2000}


def test_columns_no_role_reads_are_named_not_dropped_silently(tmp_path):
    """A rating under a name the loader does not know (`stars`) is not read: the log says
    which columns no role reads, and a run notes them with how to map one."""
    from tworec.pipeline import config, folder
    path = tmp_path / "log.csv"
    path.write_text("userId,movieId,stars,timestamp,comment\n" + "".join(
        f"u{user},i{item},{1 + item % 5},{100 * user + item},c\n"
        for user in range(6) for item in range(5)))
    log = load(str(path))
    assert log.rating is None and log.unread_columns == ("stars", "comment")
    assert log.summary()["unread_columns"] == ["stars", "comment"]
    assert load(str(path), columns={"rating": "stars"}).unread_columns == ("comment",)
    indexed = tmp_path / "indexed.csv"                  # pandas's to_csv writes its index
    indexed.write_text(",userId,movieId,timestamp\n0,u1,i1,1\n1,u1,i2,2\n")
    assert load(str(indexed)).unread_columns == ()
    checked = folder.check_run(str(tmp_path / "run"), {"data": str(path)},
                               config.resolve("tiny"))
    assert ("the log's columns ['stars', 'comment'] are not read: map one with --columns, as "
            "rating=stars, user.stars=stars or item.stars=stars") in checked.notices


def test_one_long_id_costs_its_length_once_not_once_a_row(tmp_path):
    """Ids became fixed-width text a row each: one 5,000-character item id made every row
    20 KB (a URL id or a garbage row could take the machine's memory); only the distinct ids
    are text now."""
    import tracemalloc
    rows = 20_000
    long_id = "x" * 5_000
    items = np.array([f"i{row % 97}" for row in range(rows)], dtype=object)
    items[123] = long_id
    pq.write_table(pa.table({"user_id": [f"u{row % 500}" for row in range(rows)],
                             "item_id": items, "timestamp": np.arange(rows)}),
                   tmp_path / "log.parquet")
    tracemalloc.start()
    try:
        log = load(str(tmp_path / "log.parquet"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 60 << 20, f"{peak / 2**20:.0f} MiB"          # a row each: about 2 GiB
    assert len(log) == rows and log.item_ids[log.item[123]] == long_id
    assert log.user_ids[log.user].tolist() == [f"u{row % 500}" for row in range(rows)]


def test_ids_too_wide_as_fixed_width_text_are_refused_naming_the_longest(tmp_path, monkeypatch):
    """One 4,000-character id among 100,000 made a 1.6 GiB table (peak 6 GiB): past
    ID_TABLE_BYTES, and ID_WIDTH_WASTE times the ids' own characters, the log is refused in
    one line, before the table is built; as many ids all that long (UUIDs) are read."""
    monkeypatch.setattr(sources, "ID_TABLE_BYTES", 4 * 100 * 10)        # 10 ids of 100 chars
    monkeypatch.setattr(sources, "ID_WIDTH_WASTE", 4)
    items = [f"i{row}" for row in range(20)]
    items[7] = "x" * 60                                            # 4 * 60 * 20 = 4,800 bytes
    pq.write_table(pa.table({"user_id": ["u"] * 20, "item_id": items,
                             "timestamp": np.arange(20)}), tmp_path / "log.parquet")
    with pytest.raises(DataError) as error:
        load(str(tmp_path / "log.parquet"))
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'log.parquet'}: column 'item_id' has an id of 60 "
                              "characters (first at row 7) among 20 distinct ids, which as "
                              "fixed-width text would take "), message
    assert message.endswith("; give shorter ids (map them to integers, or check that the role "
                            "reads the id column)") and "\n" not in message
    items[7] = "x" * 40                                            # 3,200 bytes: read
    pq.write_table(pa.table({"user_id": ["u"] * 20, "item_id": items,
                             "timestamp": np.arange(20)}), tmp_path / "log.parquet")
    assert load(str(tmp_path / "log.parquet")).item_ids.dtype == np.dtype("<U40")
    items = [f"{row:060d}" for row in range(20)]               # 4,800 bytes, all of them ids
    pq.write_table(pa.table({"user_id": ["u"] * 20, "item_id": items,
                             "timestamp": np.arange(20)}), tmp_path / "log.parquet")
    assert load(str(tmp_path / "log.parquet")).item_ids.dtype == np.dtype("<U60")


def test_binary_ids_are_read_as_utf8_text(tmp_path):
    """Hive, Impala and Spark write text as BINARY: its ids are UTF-8 text (NumPy decoded them
    as ASCII and failed on 'é'); bytes that are not UTF-8 are refused in one line."""
    path = tmp_path / "log.parquet"
    pq.write_table(pa.table({"user_id": pa.array([b"\xc3\xa97", b"u2", b"\xc3\xa97"]),
                             "item_id": pa.array([b"i1", b"i2", b"i3"]),
                             "timestamp": [1, 2, 3]}), path)
    assert load(str(path)).user_ids.tolist() == ["é7", "u2"]
    pq.write_table(pa.table({"user_id": pa.array([b"u1", b"\xff", b"\xfe"]),
                             "item_id": ["i1", "i2", "i3"], "timestamp": [1, 2, 3]}), path)
    with pytest.raises(DataError) as error:
        load(str(path))
    assert str(error.value) == (f"{path}: column 'user_id' has 2 ids that are not UTF-8 text "
                                "(first at row 1); write the ids as text (bytes such as UUIDs "
                                "as hex)")


@pytest.mark.parametrize("header, columns, expected", [
    ("user_id,item_id,timestamp,rating,user_id", {},
     "the column 'user_id' (for user) is in the header 2 times; give the columns distinct names"),
    ("user_id,item_id,timestamp,rating,timestamp", {"time": "timestamp"},
     "the column 'timestamp' (for time) is in the header 2 times"),
    ("user_id,item_id,timestamp,rating", {"user": "item_id"},
     "the column 'item_id' would be read as both user and item; give each of user, item, time "
     "and rating a column of its own (--columns ROLE=COLUMN)"),
    ("u,i,t,r", {"user": "u", "item": "i", "time": "t", "rating": "t"},
     "the column 't' would be read as both time and rating; give each of user, item, time and "
     "rating a column of its own (--columns ROLE=COLUMN)"),
    ("user_id,item_id,score", {"time": "score"},
     "the column 'score' would be read as both time and rating; give each of user, item, time "
     "and rating a column of its own (--columns ROLE=COLUMN, or rating=none for a log without "
     "ratings)")])
def test_a_column_read_twice_or_for_two_roles_is_refused(tmp_path, header, columns, expected):
    """Either way one column would silently stand for another: which copy, which role."""
    fields = len(header.split(","))
    path = tmp_path / "log.csv"
    path.write_text(header + "\n" + "".join(",".join([f"u{n}", f"i{n}"] + [str(n + 1)] *
                                                     (fields - 2)) + "\n" for n in range(3)))
    with pytest.raises(DataError) as error:
        load(str(path), columns=columns)
    assert str(error.value).startswith(f"{path}: {expected}"), str(error.value)


def test_rating_none_reads_no_ratings_whatever_the_columns(tmp_path):
    """A click log whose `score` column is its time, or whose `rating` column is no rating:
    `rating=none` loads it as implicit feedback, names the column as unread, and the run's
    note offers no `rating=` mapping the user declined."""
    from tworec.pipeline import config, folder
    path = tmp_path / "log.csv"
    path.write_text("user_id,item_id,score,rating\n" + "".join(
        f"u{user},i{item},{10 * user + item},{item % 3}\n"
        for user in range(6) for item in range(5)))
    log = load(str(path), columns={"time": "score", "rating": "none"})
    assert log.rating is None and log.unread_columns == ("rating",)
    assert sorted(log.timestamp.tolist()) == sorted(10 * u + i for u in range(6) for i in range(5))
    checked = folder.check_run(str(tmp_path / "run"), {"data": str(path), "columns": {
        "time": "score", "rating": "none"}}, config.resolve("tiny"))
    assert ("the log's columns ['rating'] are not read: map one with --columns, as "
            "user.rating=rating or item.rating=rating") in checked.notices


def test_a_misspelt_role_is_named_before_the_role_it_left_unmapped(tmp_path):
    """`itm=sku` was reported as a missing item column, not as the unknown role it is."""
    (tmp_path / "log.csv").write_text("uid,sku,ts\na,x,1\n")
    with pytest.raises(DataError) as error:
        load(str(tmp_path / "log.csv"), {"user": "uid", "itm": "sku", "time": "ts"})
    assert str(error.value) == ("--columns: unknown role 'itm'; use user, item, time, rating, "
                                "user.NAME or item.NAME")


def test_a_role_given_twice_in_columns_is_refused():
    with pytest.raises(DataError, match=r"^--columns: role 'user' is given twice \('a' and 'b'\); "
                                        "give each role once$"):
        sources.parse_columns("user=a,item=c,user=b")
    assert sources.parse_columns(" user = a ,item=c") == {"user": "a", "item": "c"}
    with pytest.raises(DataError, match=r"^--columns: 'item\.=genre' names no feature; write "
                                        r"item\.NAME=genre$"):
        sources.parse_columns("item.=genre")


def test_a_file_named_parquet_that_is_not_says_when_it_is_text(tmp_path):
    """A CSV named .parquet, alone or as a shard of a folder, is said to be text; other bytes
    are not."""
    text = write_log(tmp_path / "log.parquet")
    (tmp_path / "shards").mkdir()
    write_log(tmp_path / "shards" / "part-0.parquet")
    binary = tmp_path / "noise.parquet"
    binary.write_bytes(np.random.default_rng(0).bytes(4096))
    for path in (text, str(tmp_path / "shards")):
        with pytest.raises(DataError) as error:
            load(path)
        assert str(error.value).startswith(f"{text if path == text else path + '/part-0.parquet'}"
                                           ": not a readable Parquet file: ")
        assert str(error.value).endswith("; it is text, not Parquet (a CSV named .parquet?)")
    with pytest.raises(DataError) as error:
        load(str(binary))
    assert "not a readable Parquet file" in str(error.value) and "text" not in str(error.value)
