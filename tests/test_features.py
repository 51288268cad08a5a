"""The data layer: sources, validation, splits, vocabularies, history and batches."""
import collections
import csv
import dataclasses
import os
import subprocess
import sys
import zipfile

import numpy as np
import pyarrow.csv as pacsv
import pytest

from tworec.features import DataError, Vocabulary, build_history, load, split
from tworec.features.history import latest_history
from tworec.features import sources
from tworec.features.sources import tie_order_notes
from tworec.features.batches import batches, batches_in_order, steps_per_epoch
from tworec.features.synthetic import PRESETS, SyntheticConfig, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ML_LATEST_SMALL = os.path.join(ROOT, "..", "shared", "data", "ml-latest-small")

# ------------------------------------------------------------------ small release files

ML100K = {
    "u.data": "1\t10\t5\t100\n1\t20\t3\t200\n2\t10\t4\t150\n2\t30\t2\t160\n1\t10\t5\t100\n",
    "u.item": "10|Toy Story (1995)|01-Jan-1995||http://x|0|0|0|1|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0\n"
              "20|GoldenEye (1995)|01-Jan-1995||http://x|0|1|1|0|0|0|0|0|0|0|0|0|0|0|0|0|1|0|0\n"
              "30|Caf\xe9 (1996)|01-Jan-1996||http://x|0|0|0|0|0|0|0|0|1|0|0|0|0|0|0|0|0|0|0\n",
    "u.user": "1|24|M|technician|85711\n2|53|F|other|94043\n",
}
ML1M = {
    "ratings.dat": "1::10::5::100\n1::20::3::200\n2::10::4::150\n2::99::1::170\n",
    "movies.dat": "10::Toy Story (1995)::Animation|Children's|Comedy\n20::Heat: Two (1995)::Action\n",
    "users.dat": "1::F::1::10::48067\n2::M::56::16::70072\n",
}
ML_LATEST = {
    "ratings.csv": "userId,movieId,rating,timestamp\n1,10,4.0,100\n1,20,3.5,200\n2,10,5.0,150\n",
    "movies.csv": 'movieId,title,genres\n10,"Toy Story (1995)",Adventure|Animation\n'
                  '20,"American President, The (1995)",Comedy|Romance\n30,Untitled,(no genres listed)\n',
}


def write_release(tmp_path, files, as_zip, folder="ml-x", encoding="latin-1"):
    root = tmp_path / folder
    root.mkdir()
    for name, text in files.items():
        (root / name).write_bytes(text.encode(encoding))
    if not as_zip:
        return str(root)
    archive = tmp_path / f"{folder}.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for name in files:
            z.write(root / name, f"{folder}/{name}")
    return str(archive)


@pytest.mark.parametrize("as_zip", [False, True], ids=["dir", "zip"])
def test_ml100k(tmp_path, as_zip):
    log = load(write_release(tmp_path, ML100K, as_zip))
    assert len(log) == 4 and log.dropped == {"duplicate_row": 1}
    assert log.item_ids.tolist() == ["10", "20", "30"]
    assert log.item_features["title"][2] == "Caf\xe9 (1996)"
    assert log.item_features["year"].tolist() == [1995, 1995, 1996]
    names = np.array(log.genre_names)
    assert names[log.item_features["genres"][0] == 1].tolist() == ["Animation", "Children's", "Comedy"]
    assert log.user_features["occupation"].tolist() == ["technician", "other"]
    assert log.rating.tolist() == [5, 3, 4, 2]


def test_arrow_parses_bytes_from_its_own_memory(tmp_path, monkeypatch):
    """Arrow's CSV reader is handed a release's files and a text log's first lines as copies
    in Arrow's memory, never as a Python object: its threads would need the interpreter to
    read one, and one still reading when a script exits after a parse error aborts the
    process (exit -6; `sources._in_arrow_memory`)."""
    read_csv, in_arrow_memory, sources_read, copies = (
        pacsv.read_csv, sources._in_arrow_memory, [], [])

    def recording(source, *args, **kwargs):
        sources_read.append(source)
        return read_csv(source, *args, **kwargs)

    def copying(data):
        copies.append(in_arrow_memory(data))
        return copies[-1]

    monkeypatch.setattr(pacsv, "read_csv", recording)
    monkeypatch.setattr(sources, "_in_arrow_memory", copying)
    load(write_release(tmp_path, ML100K, as_zip=False))
    released = len(sources_read)                                  # u.data, u.item, u.user
    (tmp_path / "log.csv").write_text("user_id;item_id;timestamp\nu1;i1;1\nu1;i2;2\n")
    load(str(tmp_path / "log.csv"))                    # its delimiter found from its head
    assert released == 3 and len(sources_read) > released
    assert all(any(source is copy for copy in copies) for source in sources_read), sources_read
    data = bytearray(b"a\n1\n")
    copy = in_arrow_memory(data)
    data[2:3] = b"2"                                    # Arrow's copy does not see the change
    assert copy.read() == b"a\n1\n"


@pytest.mark.parametrize("as_zip", [False, True], ids=["dir", "zip"])
def test_ml1m(tmp_path, as_zip):
    log = load(write_release(tmp_path, ML1M, as_zip))
    assert log.dropped == {"item_not_in_catalogue": 1}
    assert len(log) == 3
    assert log.item_features["title"].tolist() == ["Toy Story (1995)", "Heat: Two (1995)"]
    assert set(log.genre_names) == {"Animation", "Children's", "Comedy", "Action"}
    assert log.user_features["gender"].tolist() == ["F", "M"]


@pytest.mark.parametrize("as_zip", [False, True], ids=["dir", "zip"])
def test_ml_latest(tmp_path, as_zip):
    log = load(write_release(tmp_path, ML_LATEST, as_zip, encoding="utf8"))
    assert log.item_ids.tolist() == ["10", "20", "30"]            # the catalogue, unrated included
    assert log.item_features["year"].tolist() == [1995, 1995, 0]
    assert log.item_features["genres"][2].sum() == 0
    assert log.item_features["title"][1] == "American President, The (1995)"
    assert log.user_ids[log.user].tolist() == ["1", "1", "2"]
    assert log.item_ids[log.item].tolist() == ["10", "20", "10"]


@pytest.mark.parametrize("name, header, separator", [
    ("ratings.csv", "userId,movieId,rating,timestamp\n", ","), ("ratings.dat", "", "::"),
    ("u.data", "", "\t")], ids=["ml-latest", "ml-1m", "ml-100k"])
def test_a_release_shuffles_its_ties(tmp_path, name, header, separator):
    """GroupLens lists a user's ratings by movie id: the ratings of one second must not reach
    the models in that order (the held-out last one would be the highest id)."""
    rated = [("10", 9), ("20", 9), ("30", 9), ("40", 1)]            # (movie, second) in id order

    def release(folder, wrong_rating=""):
        rows = [(str(user), movie, wrong_rating if (user, movie) == (0, "40") and wrong_rating
                 else movie[0], str(second)) for user in range(300) for movie, second in rated]
        lines = "".join(separator.join(row) + "\n" for row in rows)
        return write_release(tmp_path, {name: header + lines}, as_zip=False, folder=folder)

    log = load(release("ml"))
    assert sorted(zip(log.user_ids[log.user], log.item_ids[log.item], log.rating,
                      log.timestamp)) == sorted(
        (str(user), movie, float(movie[0]), second)
        for user in range(300) for movie, second in rated)                 # nothing lost
    movies = log.item_ids[log.item].reshape(300, 4)                          # users in file order
    assert (movies[:, 0] == "40").all()                                      # rows in time order
    last = collections.Counter(movies[:, -1])                                # held out
    assert set(last) == {"10", "20", "30"} and min(last.values()) > 70, last
    assert (log.item == load(release("again")).item).all()                  # on every load
    assert tie_order_notes(log) == []                                        # shuffled
    with pytest.raises(DataError, match=r"'rating' has 1 ratings that are infinite .*\(first at "
                                        r"row 3\)"):                      # the file's row
        load(release("wrong", wrong_rating="1e40"))


@pytest.mark.parametrize("first, ids", [("1", ("5", "40", "300")), ("z", ("a", "b", "c"))],
                         ids=["numbers", "text"])
def test_a_log_with_its_ties_in_id_order_is_noted(tmp_path, first, ids):
    """A generic log keeps its ties' order (it is taken as the order things happened), and a
    run says when that order is the ids' (nine tied pairs in ten or more): number ids compare
    as numbers ('5' < '40' < '300'). Users of two rows are not held out."""
    def log(users, order, name, short_users=0):
        path = tmp_path / name
        path.write_text("user_id,item_id,timestamp\n" + "".join(
            f"u{user},{first},1\n" + "".join(f"u{user},{ids[i]},9\n" for i in order(user))
            for user in range(users)) + "".join(
            f"s{user},{ids[0]},9\ns{user},{ids[1]},9\n" for user in range(short_users)))
        return load(str(path))

    mostly = log(330, lambda user: (0, 1, 2) if user < 300 else (0, 2, 1), "sorted.csv",
                 short_users=100)                  # 30 users' last ties down, 100 not held out
    assert tie_order_notes(mostly) == [
        f"{tmp_path / 'sorted.csv'}: 50% of its rows share their user's timestamp with the row "
        "before, and it lists 96% of those by increasing item id; ties keep the log's order, "
        "which models learn as the order things happened, and for 300 users the last row, "
        "which the temporal protocol holds out, comes after a lower id of its timestamp: write "
        "ties in the order they happened, or in a random one (README: Splits)"]
    assert tie_order_notes(log(0, None, "short.csv", short_users=25)) == [     # none held out
        f"{tmp_path / 'short.csv'}: 50% of its rows share their user's timestamp with the row "
        "before, and it lists 100% of those by increasing item id; ties keep the log's order, "
        "which models learn as the order things happened: write ties in the order they "
        "happened, or in a random one (README: Splits)"]
    rotated = log(300, lambda user: np.roll((0, 1, 2), user), "rotated.csv")    # 2 in 3 up
    assert tie_order_notes(rotated) == []
    falling = log(330, lambda user: (2, 1, 0) if user < 300 else (2, 0, 1), "falling.csv")
    assert tie_order_notes(falling) == [
        f"{tmp_path / 'falling.csv'}: 50% of its rows share their user's timestamp with the row "
        "before, and it lists 95% of those by decreasing item id; ties keep the log's order, "
        "which models learn as the order things happened, and for 300 users the last row, "
        "which the temporal protocol holds out, comes after a higher id of its timestamp: write "
        "ties in the order they happened, or in a random one (README: Splits)"]


def tied_pairs_log(path, up: int, down: int = 0, untied: int = 0):
    """A log of `up` users with one tied pair in increasing id order, `down` with one in
    decreasing order, each after an earlier row, and `untied` users of one row."""
    rows = [(f"u{user}", "1", 1) for user in range(up + down)]
    rows += [(f"u{user}", item, 9) for user in range(up) for item in ("2", "3")]
    rows += [(f"u{user}", item, 9) for user in range(up, up + down) for item in ("3", "2")]
    rows += [(f"v{user}", "1", 5) for user in range(untied)]
    path.write_text("user_id,item_id,timestamp\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows))
    return load(str(path))


@pytest.mark.parametrize("up, down, untied, noted", [
    (20, 0, 0, True), (19, 0, 0, False),                  # at least 20 tied rows
    (90, 10, 0, True), (89, 11, 0, False),                # nine in ten of them in id order
    (10, 90, 0, True), (11, 89, 0, False),                # or in decreasing id order
    (21, 0, 2037, True), (21, 0, 2038, False)])           # and one row in a hundred or more
def test_the_tie_order_note_has_its_thresholds(tmp_path, up, down, untied, noted):
    log = tied_pairs_log(tmp_path / "log.csv", up, down, untied)
    assert bool(tie_order_notes(log)) == noted


@pytest.mark.skipif(not os.path.isdir(ML_LATEST_SMALL), reason="shared MovieLens copy absent")
def test_real_ml_latest_small():
    log = load(ML_LATEST_SMALL)
    assert len(log) == 100_011 and log.num_items == 9_125
    assert log.item_features["genres"].shape[1] == 19


def test_generic_csv_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    csv = tmp_path / "log.csv"
    csv.write_text("uid,sku,ts,stars,color\na,x,3,1,red\na,y,1,2,blue\nb,x,2,5,red\n")
    mapping = {"user": "uid", "item": "sku", "time": "ts", "rating": "stars", "item.color": "color"}
    log = load(str(csv), columns=mapping)
    assert log.item_ids.tolist() == ["x", "y"] and log.rating.tolist() == [1, 2, 5]
    assert log.item_features["color"].tolist() == ["red", "blue"]
    table = pa.table({"user_id": ["a", "b"], "item_id": [1, 2], "timestamp": [5, 6]})
    pq.write_table(table, tmp_path / "log.parquet")
    log = load(str(tmp_path / "log.parquet"))
    assert log.rating is None and log.item_ids.tolist() == ["1", "2"]


@pytest.mark.parametrize("text, message", [
    ("user_id,item_id\na,x\n", "missing required column for 'time'"),
    ("user_id,item_id,timestamp\n", "the log is empty"),
    ("user_id,item_id,timestamp\na,x,yesterday\n",
     r"column 'timestamp' is neither all numbers nor all ISO dates and times \(first value "
     r"that is not a number: 'yesterday', at row 0\)"),
    ("user_id,item_id,timestamp,rating\na,x,1,good\n", "column 'rating' is not numeric"),
    ("user_id,item_id,timestamp,rating\na,x,1,\n", "'rating' has 1 missing"),
    ("user_id,item_id,timestamp,rating\na,x,1,nan\n", "'rating' has 1 missing"),
])
def test_bad_logs_name_the_problem(tmp_path, text, message):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=message) as error:
        load(str(path))
    assert "bad.csv" in str(error.value)


def test_unknown_formats(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match="unknown format"):
        load(str(tmp_path))
    (tmp_path / "log.json").write_text("{}")
    with pytest.raises(DataError, match="unknown format"):
        load(str(tmp_path / "log.json"))
    with pytest.raises(DataError, match="unknown synthetic preset"):
        load("synthetic:huge")
    (tmp_path / "log.csv").write_text("user_id,item_id,timestamp\na,x,1\n")
    with pytest.raises(DataError, match="unknown role 'usr'"):
        load(str(tmp_path / "log.csv"), columns={"usr": "user_id"})


@pytest.fixture
def download_host_reachable(monkeypatch):
    """TFDS cannot download here; a test that mocks it passes the check that its download host
    can be reached."""
    from tworec.features import sources
    monkeypatch.setattr(sources, "_check_download_host", lambda *args: None)


def test_tfds_with_mock_data(offline):
    """Under `tfds.testing.mock_data` nothing is downloaded, so no host is asked for, even
    offline."""
    import tensorflow_datasets as tfds
    with tfds.testing.mock_data(num_examples=40):
        log = load("tfds:movielens/100k-ratings")
    assert offline == []
    assert len(log) + sum(log.dropped.values()) == 40
    assert log.rating is not None and "genres" in log.item_features
    assert set(log.user_features) == {"gender", "age", "occupation"}


def tfds_movielens(movies: dict, ratings: dict):
    """`tfds.testing.mock_data` answering the -movies config with `movies` and the -ratings
    one with `ratings` (columns as TFDS's MovieLens features; genres by name)."""
    import tensorflow as tf
    import tensorflow_datasets as tfds

    def as_dataset(builder, *args, **kwargs):
        labels = builder.info.features["movie_genres"].feature.names
        genres = [[labels.index(genre) for genre in listed] for listed in movies["genres"]]
        columns = {"movie_id": movies["movie_id"], "movie_title": movies["movie_title"],
                   "movie_genres": tf.ragged.constant(genres, tf.int64, ragged_rank=1)}
        if builder.builder_config.table_option != "movies":
            columns = {**ratings, "timestamp": tf.constant(ratings["timestamp"], tf.int64)}
        return tf.data.Dataset.from_tensor_slices(columns)
    return tfds.testing.mock_data(as_dataset_fn=as_dataset)


def test_tfds_reads_what_the_grouplens_files_of_the_release_hold(tmp_path, offline):
    """TFDS's MovieLens and the same release's GroupLens files give the same log: titles with
    letters outside ASCII (TFDS stores them as UTF-8 bytes), genres by name, and a film of
    "(no genres listed)" without any."""
    movies = {"movie_id": ["1", "2", "3"],
              "movie_title": ["Amélie (2001)", "Toy Story (1995)", "Untitled (2015)"],
              "genres": [["Comedy", "Romance"], ["Animation", "Comedy"], ["(no genres listed)"]]}
    ratings = {"user_id": ["7", "7", "8", "8"], "movie_id": ["1", "2", "2", "3"],
               "user_rating": [4.0, 3.5, 5.0, 2.0], "timestamp": [10, 20, 30, 40]}
    with tfds_movielens(movies, ratings):
        from_tfds = load("tfds:movielens/latest-small-ratings")
    release = tmp_path / "ml-latest-small"
    release.mkdir()
    for name, columns in (("movies.csv", {"movieId": movies["movie_id"],
                                          "title": movies["movie_title"],
                                          "genres": ["|".join(g) for g in movies["genres"]]}),
                          ("ratings.csv", {"userId": ratings["user_id"],
                                           "movieId": ratings["movie_id"],
                                           "rating": ratings["user_rating"],
                                           "timestamp": ratings["timestamp"]})):
        with open(release / name, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows([list(columns), *zip(*columns.values())])
    from_files = load(str(release))
    assert from_tfds.genre_names == from_files.genre_names == ("Animation", "Comedy", "Romance")
    for name in ("genres", "title", "year"):
        np.testing.assert_array_equal(from_tfds.item_features[name],
                                      from_files.item_features[name])
    assert list(from_tfds.item_features["title"]) == movies["movie_title"]
    np.testing.assert_array_equal(from_tfds.item_features["genres"],
                                  [[0, 1, 1], [1, 1, 0], [0, 0, 0]])
    assert offline == []


def test_tfds_names_a_missing_package_not_the_network(monkeypatch, download_host_reachable):
    import tensorflow_datasets as tfds

    def load_without(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'importlib_resources'", name="importlib_resources")
    monkeypatch.setattr(tfds, "load", load_without)
    with pytest.raises(DataError, match=r"needs the package 'importlib_resources'.*pip install "
                                        r"importlib_resources"):
        load("tfds:movielens/100k-ratings")


@pytest.mark.parametrize("prepared", [False, True], ids=["to_download", "prepared"])
def test_tfds_offline_is_refused_at_once_unless_prepared(tmp_path, monkeypatch, offline,
                                                        prepared):
    """Offline, TFDS retries its download for minutes; a data set not prepared in --data-dir
    whose download host cannot be reached is refused at once. A prepared one is read."""
    import tensorflow_datasets as tfds
    hosts, loaded = offline, []
    monkeypatch.setattr(tfds.core.DatasetBuilder, "is_prepared", lambda self: prepared)
    monkeypatch.setattr(tfds, "load", lambda name, **kwargs: loaded.append(name) or 1 / 0)
    with pytest.raises(DataError) as error:
        load("tfds:movielens/100k-ratings", data_dir=str(tmp_path / "tfds"))
    if prepared:
        assert hosts == [] and loaded == ["movielens/100k-ratings"]
        return
    assert hosts == [("files.grouplens.org", 443)] and loaded == []
    where = tfds.builder("movielens/100k-ratings", data_dir=str(tmp_path / "tfds")).data_dir
    assert where.startswith(str(tmp_path / "tfds"))
    assert str(error.value) == (
        f"tfds:movielens/100k-ratings: not prepared in {where}, and files.grouplens.org, where "
        "TFDS would download it from, cannot be reached ([Errno -2] Name or service not "
        "known); prepare it elsewhere and pass its data directory with --data-dir, or pass the "
        "GroupLens release instead: --data path/to/ml-100k.zip (or its unpacked folder)")


def test_tfds_can_download_in_the_installed_environment():
    """What TFDS imports to download (its packaging gap) is installed with the project."""
    import importlib.util
    assert importlib.util.find_spec("importlib_resources") is not None


def test_tfds_unsupported_name():
    with pytest.raises(DataError, match="unsupported"):
        load("tfds:mnist")


# ------------------------------------------------------------------ splits


@pytest.fixture(scope="module")
def log():
    return generate(PRESETS["tiny"], seed=3)


def test_synthetic_is_deterministic_and_structured(log):
    again = generate(PRESETS["tiny"], seed=3)
    assert np.array_equal(log.item, again.item) and np.array_equal(log.timestamp, again.timestamp)
    assert not np.array_equal(log.item, generate(PRESETS["tiny"], seed=4).item)
    # sequential dependence: a user's next item follows the previous one far above chance
    order = log.time_order()
    users, items = log.user[order], log.item[order]
    same_user = users[1:] == users[:-1]
    pairs = set(zip(items[:-1][same_user].tolist(), items[1:][same_user].tolist()))
    assert len(pairs) < 0.6 * same_user.sum()
    counts = np.bincount(log.item, minlength=log.num_items)
    assert np.sort(counts)[-log.num_items // 10:].sum() > 0.18 * len(log)   # uniform: 0.10


def test_temporal_split(log):
    parts = split(log, "temporal")
    rows = np.concatenate([parts.train, parts.validation, parts.test])
    assert np.array_equal(np.sort(rows), np.arange(len(log)))    # a partition
    assert len(np.unique(log.user[parts.test])) == len(parts.test)
    for u in np.unique(log.user[parts.test]):
        train = parts.train[log.user[parts.train] == u]
        (val,) = parts.validation[log.user[parts.validation] == u]
        (test,) = parts.test[log.user[parts.test] == u]
        assert log.timestamp[train].max() <= log.timestamp[val] <= log.timestamp[test]


def test_temporal_split_ties_and_short_users():
    from tworec.features.interactions import Interactions
    log = Interactions(user_ids=np.array(["a", "b"]), item_ids=np.array(["x", "y", "z"]),
                       user=np.array([0, 0, 0, 1, 1]), item=np.array([0, 1, 2, 0, 1]),
                       timestamp=np.array([5, 5, 5, 1, 2]))
    parts = split(log, "temporal")
    assert parts.test.tolist() == [2] and parts.validation.tolist() == [1]   # file order on ties
    assert parts.train.tolist() == [0, 3, 4] and parts.short_users == 1


def test_latest_split_validates_on_each_users_last_row_and_tests_nothing():
    """`latest`: the last row (ties in file order) validates, the rest train; a user with a
    single row stays in train and is counted; nothing is tested."""
    from tworec.features.interactions import Interactions
    log = Interactions(user_ids=np.array(["a", "b", "c"]), item_ids=np.array(["x", "y", "z"]),
                       user=np.array([0, 0, 0, 1, 1, 2]), item=np.array([0, 1, 2, 0, 1, 2]),
                       timestamp=np.array([5, 5, 5, 2, 1, 3]))
    parts = split(log, "latest")
    assert parts.validation.tolist() == [2, 3] and parts.train.tolist() == [0, 1, 4, 5]
    assert not len(parts.test) and parts.short_users == 1 and parts.kind == "latest"
    assert parts.fit.tolist() == list(range(6))                 # the exports know every row


@pytest.mark.parametrize("kind, rows_per_user, message", [
    ("temporal", 2, "split 'temporal': no user has 3 or more rows, which leaves nothing to "
                    "test; use split 'latest' (validates on each user's last row) or 'none'"),
    ("latest", 1, "split 'latest': no user has 2 or more rows, which leaves nothing to "
                  "validate, stop early or calibrate on; use split 'none'")])
def test_a_split_that_holds_nothing_out_is_refused_for_a_run_in_one_line(kind, rows_per_user,
                                                                          message):
    """No user with enough rows: `temporal` tests nothing and `latest` validates nothing, so a
    run refuses them, naming the split that works (as any split that tests nothing but
    `none`); one user with a row more holds that row out, and the run goes on."""
    from tworec.features.interactions import Interactions
    from tworec.features.splits import require_held_out
    user = np.repeat(np.arange(3), rows_per_user)
    log = Interactions(user_ids=np.array(["a", "b", "c"]), item_ids=np.array(["x", "y"]),
                       user=user, item=np.arange(len(user)) % 2, timestamp=np.arange(len(user)))
    parts = split(log, kind)
    held_out = parts.test if kind == "temporal" else parts.validation
    assert not len(held_out) and len(parts.train) == len(user)
    with pytest.raises(DataError) as refused:
        require_held_out(parts)
    assert str(refused.value) == message
    if kind == "temporal":            # a random split of 2 rows keeps both in train
        with pytest.raises(DataError, match="^split 'random': it holds out none of the log's 2 "
                                            "rows, which leaves nothing to test; use split"):
            require_held_out(split(log.take(np.arange(2)), "random"))
    longer = dataclasses.replace(log, user=np.append(user, 2), item=np.append(log.item, 0),
                                 timestamp=np.append(log.timestamp, 100))
    held = split(longer, kind)
    require_held_out(held)
    assert (held.test if kind == "temporal" else held.validation).tolist() == [len(user)]


@pytest.mark.parametrize("kind, quantile", [
    ("global", 0.9), ("global:0.8", 0.8), ("global:", None), ("global:x", None),
    ("global:1", None), ("global:nan", None), ("globally", None)])
def test_global_quantiles_are_read_or_refused(kind, quantile):
    from tworec.features.splits import global_quantile
    if quantile is None:
        with pytest.raises(DataError, match=f"^split '{kind}': write global or global:Q with "
                                            "0 < Q < 1"):
            global_quantile(kind)
    else:
        assert global_quantile(kind) == quantile


def test_random_split(log):
    parts = split(log, "random", seed=42)
    assert len(parts.train) == round(0.8 * len(log)) and len(parts.validation) == 0
    assert not set(parts.train.tolist()) & set(parts.test.tolist())
    assert np.array_equal(parts.test, split(log, "random", seed=42).test)
    with pytest.raises(DataError, match="unknown split"):
        split(log, "weekly")


def test_cutoff_split(log):
    cutoff = int(np.median(log.timestamp))
    parts = split(log, "cutoff", cutoff=cutoff)
    assert log.timestamp[parts.train].max() < cutoff <= log.timestamp[parts.test].min()


# ------------------------------------------------------------------ vocabularies and history


def test_vocabulary_round_trip(tmp_path):
    vocab = Vocabulary.from_codes(np.array(["x", "y", "z", "w"]), np.array([2, 1, 2, 0, 1, 2]))
    assert vocab.ids.tolist() == ["z", "y", "x"] and vocab.size == 5
    assert vocab.lookup(["z", "x", "nope", ""]).tolist() == [2, 4, 1, 0]
    vocab.save(str(tmp_path / "v.json"))
    again = Vocabulary.load(str(tmp_path / "v.json"))
    assert np.array_equal(again.ids, vocab.ids)
    assert again.decode([2, 3, 1, 0]).tolist() == ["z", "y", "", ""]
    for outside in (-1, 5):                           # -1 read the last id, 5 an IndexError
        with pytest.raises(ValueError, match=f"index {outside} is not in the vocabulary's 0 to 4"):
            again.decode([[2, outside]])


def test_vocabulary_matches_keras_string_lookup():
    import tensorflow as tf
    vocab = Vocabulary(["b", "a", "c"])
    layer = tf.keras.layers.StringLookup(vocabulary=vocab.ids, mask_token="", num_oov_indices=1)
    words = ["a", "", "zz", "c", "b"]
    assert layer(tf.constant(words)).numpy().tolist() == vocab.lookup(words).tolist()


def test_history_matches_a_plain_loop(log):
    length = 4
    history = build_history(log, length)
    order = log.time_order()
    seen = {}
    for row in order:
        past = seen.setdefault(int(log.user[row]), [])
        expected = ([-1] * length + past)[-length:]
        assert history[row].tolist() == expected
        past.append(int(log.item[row]))
    latest = latest_history(log, length)
    for user, past in seen.items():
        assert latest[user].tolist() == ([-1] * length + past)[-length:]



def test_history_length_zero_holds_no_item_anywhere(log):
    """0 asks for no history: every row's history and every user's served state is one PAD
    slot (the models read at least one slot), never the previous item."""
    from tworec.features.inputs import prepare
    from tworec.features.vocab import PAD
    inputs = prepare(log, split(log, "temporal"), history_length=0)
    assert inputs.history_length == 0
    assert inputs.latest.shape == (log.num_users, 1) and (inputs.latest == PAD).all()
    for part in ("train", "validation", "test"):
        history = inputs.examples[part]["history"]
        assert history.shape == (len(inputs.examples[part]["item"]), 1), part
        assert (history == PAD).all(), part

# ------------------------------------------------------------------ batches


def test_batches_cover_the_arrays_once_per_epoch():
    data = {"a": np.arange(10), "b": np.arange(10) * 10.0, "c": np.zeros((10, 3))}
    epochs = list(batches(data, 4, shuffle=True, seed=1, epochs=2, select=["a", "b"]))
    assert [len(b["a"]) for b in epochs] == [4, 4, 2] * 2 and set(epochs[0]) == {"a", "b"}
    first = np.concatenate([b["a"].numpy() for b in epochs[:3]])
    second = np.concatenate([b["a"].numpy() for b in epochs[3:]])
    assert sorted(first) == sorted(second) == list(range(10))
    assert not np.array_equal(first, second)                        # reshuffled per epoch
    for batch in epochs:
        assert np.array_equal(batch["b"].numpy(), batch["a"].numpy() * 10.0)
    plain = list(batches(data, 4, drop_remainder=True))
    assert [b["a"].numpy().tolist() for b in plain] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert steps_per_epoch(10, 4) == 3 and steps_per_epoch(10, 4, drop_remainder=True) == 2


def test_batches_in_order_are_the_unshuffled_batches_without_a_pipeline():
    data = {"a": np.arange(10), "b": np.arange(30, dtype=np.float32).reshape(10, 3)}
    ours, theirs = list(batches_in_order(data, 4)), list(batches(data, 4))
    assert [len(b["a"]) for b in ours] == [4, 4, 2]
    for mine, reference in zip(ours, theirs, strict=True):
        for name in data:
            assert mine[name].dtype == reference[name].dtype
            np.testing.assert_array_equal(mine[name].numpy(), reference[name].numpy())
    assert list(batches_in_order({"a": np.arange(0)}, 4)) == []
    with pytest.raises(DataError, match="different numbers of rows"):
        list(batches_in_order({"a": np.arange(3), "b": np.arange(4)}, 2))
    with pytest.raises(DataError, match="batch_size must be positive"):
        list(batches_in_order(data, 0))


def test_batches_reject_bad_input():
    with pytest.raises(DataError, match="different numbers of rows"):
        batches({"a": np.arange(3), "b": np.arange(4)}, 2)
    with pytest.raises(DataError, match=r"no feature\(s\) \['z'\]"):
        batches({"a": np.arange(3)}, 2, select=["z"])


# ------------------------------------------------------------------ set-up


@pytest.mark.parametrize("package", ["features", "retrieval", "ranking", "serving"])
def test_keras_2_whichever_package_comes_first(package):
    code = (f"import tworec.{package}, tensorflow as tf, tensorflow_recommenders as tfrs, tf_keras;"
            "assert tf.keras.__name__.startswith('tf_keras'), tf.keras.__name__;"
            "print(tf.keras.layers.Dense.__module__)")
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tf_keras" in done.stdout


def test_describe_data_prints_one_json_object(tmp_path):
    import json
    script = os.path.join(ROOT, "scripts", "describe_data.py")
    done = subprocess.run([sys.executable, script, "--data", "synthetic:tiny"], capture_output=True,
                          text=True, timeout=120)
    summary = json.loads(done.stdout)
    assert summary["split_sizes"]["test"] == summary["test_users"] > 0
    done = subprocess.run([sys.executable, script, "--data", "synthetic:tiny", "--split",
                           "global:0.8"], capture_output=True, text=True, timeout=120)
    summary = json.loads(done.stdout)                   # every split the pipeline takes
    assert summary["split"] == "global:0.8" and summary["split_sizes"]["test"] > 0
    done = subprocess.run([sys.executable, script, "--data", str(tmp_path / "none.csv"),
                           "--split", "global:2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "global:Q with 0 < Q < 1" in done.stderr   # before loading
    done = subprocess.run([sys.executable, script, "--data", str(tmp_path / "none.csv")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no such file" in done.stderr
    assert summary["notes"] == []
    notes = tie_order_notes(tied_pairs_log(tmp_path / "tied.csv", up=20))
    done = subprocess.run([sys.executable, script, "--data", str(tmp_path / "tied.csv")],
                          capture_output=True, text=True, timeout=120)
    assert json.loads(done.stdout)["notes"] == notes and len(notes) == 1
    done = subprocess.run([sys.executable, script, "--data", str(tmp_path / "tied.csv"),
                           "--summary-only"], capture_output=True, text=True, timeout=120)
    assert "notes" not in json.loads(done.stdout)              # no split, no sort for notes


PINNED = (80105, 499732, 1624789569)      # rows, sum of the first 1000 items, last timestamp


def top_items_early_and_late(log, top: int = 50) -> int:
    """How many of the `top` most frequent items of the first quarter of time are also among
    the `top` of the last quarter."""
    early, late = np.quantile(log.timestamp, [0.25, 0.75])
    count = lambda rows: np.bincount(log.item[rows], minlength=log.num_items)   # noqa: E731
    first = np.argsort(-count(log.timestamp < early))[:top]
    last = np.argsort(-count(log.timestamp > late))[:top]
    return len(np.intersect1d(first, last))


def test_the_drift_preset_changes_what_is_popular_and_leaves_the_default_alone():
    small = dict(num_users=600, num_items=400, num_interactions=20_000)
    steady = generate(SyntheticConfig(**small), seed=0)
    drifting = generate(SyntheticConfig(**small, popularity_drift=1.0), seed=0)
    assert top_items_early_and_late(steady) >= 20 and top_items_early_and_late(drifting) <= 5
    assert np.array_equal(steady.user, generate(SyntheticConfig(**small), seed=0).user)
    assert {"drift", "default", "tiny"} <= set(PRESETS)
    assert PRESETS["drift"].popularity_drift > 0 and PRESETS["default"].popularity_drift == 0
    # the default log is the one every README figure was measured on: pinned
    default = generate(PRESETS["default"], seed=0)
    assert (len(default), int(default.item[:1000].sum()), int(default.timestamp[-1])) == PINNED


def test_synthetic_config_sizes():
    small = generate(SyntheticConfig(num_users=50, num_items=400, num_interactions=1000), seed=0)
    assert 0.8 * 1000 < len(small) <= 1000 + 50 * 3
    assert small.item_features["genres"].shape == (400, 12)


def test_read_titles_reads_a_grouplens_movies_file_or_any_delimiter(tmp_path):
    from tworec.features.sources import read_titles
    (tmp_path / "movies.csv").write_text('movieId,title,genres\n1,Toy Story (1995),Animation\n'
                                         '2,"Heat, (1995)",Action\n')
    assert read_titles(str(tmp_path / "movies.csv")) == \
        {"1": "Toy Story (1995)", "2": "Heat, (1995)"}
    (tmp_path / "semicolons.csv").write_text("item_id;title\n007;Dr. No; or not\n")
    with pytest.raises(DataError, match="semicolons.csv: needs .* it has item_id;title$"):
        read_titles(str(tmp_path / "semicolons.csv"))     # a stray ; in a title: not detected
    (tmp_path / "semicolons.csv").write_text('item_id;title\n007;"Dr. No; or not"\n')
    assert read_titles(str(tmp_path / "semicolons.csv")) == {"007": "Dr. No; or not"}
    (tmp_path / "bad.csv").write_text("id,name\n1,x\n")
    with pytest.raises(DataError, match="bad.csv: needs an item id column .*movieId.* it has "
                                        "id, name$"):
        read_titles(str(tmp_path / "bad.csv"))
    with pytest.raises(DataError, match="missing.csv"):
        read_titles(str(tmp_path / "missing.csv"))


@pytest.mark.parametrize("preset", ["tiny", "drift"])
def test_planted_scores_are_the_generators_next_item_distribution(preset):
    """Each row's scores are a probability distribution over the items the user has not had
    (the chain leaves the seen set with probability 1), they rank the held-out items far
    better than popularity, and the drift is part of them: ignoring it makes the held-out
    items less likely."""
    from tworec.features.synthetic import planted_scores
    config = SyntheticConfig(**{**PRESETS[preset].__dict__, "num_users": 300,
                                "num_interactions": 9_000})
    log = generate(config, seed=1)
    parts = split(log, "temporal")
    rows = np.concatenate([parts.train[::7], parts.test])
    scores = planted_scores(config, 1, log, rows)
    np.testing.assert_allclose(scores.sum(1), 1.0, rtol=1e-4)
    test = parts.test
    targets = log.item[test]
    planted = scores[-len(test):]
    popular = np.bincount(log.item[parts.train], minlength=log.num_items)
    def hits(rows_scores):
        return np.mean([s[t] >= np.sort(s)[-10] for s, t in zip(rows_scores, targets)])
    assert hits(planted) > 2 * hits(np.tile(popular, (len(test), 1)))
    if config.popularity_drift:
        steady = planted_scores(dataclasses.replace(config, popularity_drift=0.0), 1, log, test)
        likelihood = lambda s: np.log(s[np.arange(len(test)), targets]).sum()   # noqa: E731
        assert likelihood(planted) > likelihood(steady) + 100


def test_popular_items_count_the_latest_share_of_the_known_rows():
    """By hand: ties in time keep log order, ties in count go to the count among all the known
    rows, then to the lower code; at least one row is counted."""
    from tworec.features import Interactions
    from tworec.features.inputs import popular_items
    items = np.array([3, 3, 3, 2, 1, 1, 0, 2])
    times = np.array([0, 1, 2, 9, 7, 8, 3, 8])                       # rows 5 and 7 tie at 8
    log = Interactions(user_ids=np.array(["a"]), item_ids=np.array(["w", "x", "y", "z"]),
                       user=np.zeros(8, np.int64), item=items, timestamp=times)
    every = np.arange(8)
    for window, order, share in [(1.0, [3, 1, 2, 0], [1 / 8, 2 / 8, 2 / 8, 3 / 8]),
                                 (0.5, [1, 2, 3, 0], [0, 0.5, 0.5, 0]),   # rows 4, 5, 7, 3
                                 (0.25, [2, 3, 1, 0], [0, 0, 1, 0]),      # rows 7, 3
                                 (0.01, [2, 3, 1, 0], [0, 0, 1, 0])]:     # row 3 alone
        popular = popular_items(log, every, window)
        assert popular.window == window and popular.order.tolist() == order, window
        np.testing.assert_allclose(popular.share, share)
    known = popular_items(log, np.array([4, 0, 2, 6]), 0.5)            # rows 6 (t 3), 4 (t 7)
    assert known.order.tolist() == [0, 1, 3, 2] and known.share.tolist() == [0.5, 0.5, 0, 0]


def test_prepare_serves_users_never_seen_from_the_rows_known_before_each_part(log):
    from tworec.features.inputs import popular_items, prepare
    parts = split(log, "global")
    inputs = prepare(log, parts, history_length=3, cold_start_window=0.2)
    for part, known in (("validation", parts.train), ("test", parts.fit)):
        expected = popular_items(log, known, 0.2)
        assert np.array_equal(inputs.popular[part].order, expected.order)
        assert np.array_equal(inputs.popular[part].share, expected.share)
    assert not np.array_equal(inputs.popular["validation"].order, inputs.popular["test"].order)


def test_a_user_feature_that_changes_is_read_as_known_before_the_rows_scored(tmp_path):
    from tworec.features.inputs import prepare
    csv = tmp_path / "log.csv"
    # u's plan changes (its rows are not in time order); v's does not; the last row repeats
    # u's first in all but plan, and a dropped row's value must not count.
    csv.write_text("user_id,item_id,timestamp,plan,team\n"
                   "u,a,4,gold,x\nu,b,1,free,x\nu,c,2,basic,x\nu,d,3,free,x\n"
                   "v,a,1,free,y\nv,b,2,free,y\nv,c,3,free,y\nu,b,1,premium,x\n")
    log = load(str(csv), columns={"user.plan": "plan", "user.team": "team"})
    assert log.user_ids.tolist() == ["u", "v"] and log.dropped == {"duplicate_row": 1}
    assert log.user_features["plan"].tolist() == ["free", "free"]       # last in file order
    assert sorted(log.user_feature_rows) == ["plan"]                    # team never changes
    everything = np.arange(len(log))
    assert log.user_feature_at("plan", everything).tolist() == ["gold", "free"]
    assert log.user_feature_at("team", everything[:1]).tolist() == ["x", "y"]   # the table's
    parts = split(log, "temporal")               # u: free, basic | free (validation) | gold
    assert log.user_feature_at("plan", parts.train).tolist() == ["basic", "free"]
    assert log.user_feature_at("plan", parts.validation[:1]).tolist() == ["free", ""]
    inputs = prepare(log, parts, history_length=2, cold_start_window=0.2)
    vocab = inputs.user_feature_vocabs["plan"]
    assert sorted(vocab.ids.tolist()) == ["basic", "free"]             # no held-out value
    name_of = np.append(["<pad>", "<oov>"], vocab.ids)
    named = {part: name_of[inputs.examples[part]["user_plan"]].tolist()
             for part in ("train", "validation", "test")}
    assert named == {"train": ["basic", "basic", "free"], "validation": ["basic", "free"],
                     "test": ["free", "free"]}
    assert name_of[inputs.user_feature_index["plan"]].tolist() == ["free", "free"]   # served
    latest = inputs.latest_examples(log.user[parts.test])   # a test row's inputs but "item"
    assert set(latest) == set(inputs.examples["test"]) - {"item"} == {"user", "history",
                                                                      "user_plan", "user_team"}
    for key, values in latest.items():
        np.testing.assert_array_equal(values, inputs.examples["test"][key])


@pytest.mark.parametrize("as_zip", [False, True], ids=["dir", "zip"])
def test_a_release_says_what_its_missing_optional_files_leave_out(tmp_path, as_zip):
    from tworec.features.sources import release_gaps
    assert release_gaps(write_release(tmp_path, ML1M, as_zip, folder="ml-full")) == []
    ratings_only = write_release(tmp_path, {"ratings.dat": ML1M["ratings.dat"]}, as_zip)
    assert release_gaps(ratings_only) == [
        f"{ratings_only} has no movies.dat beside its ratings: its items have no genres, year "
        "or title"]                                     # users.dat: ml-10m never has one
    assert load(ratings_only).item_features == {}
    ml10m = {name: ML1M[name] for name in ("ratings.dat", "movies.dat")}
    assert release_gaps(write_release(tmp_path, ml10m, as_zip, folder="ml-10m")) == []
    data_only = write_release(tmp_path, {"u.data": ML100K["u.data"]}, as_zip, folder="ml-100k")
    assert release_gaps(data_only) == [
        f"{data_only} has no u.item beside its ratings: its items have no genres, year or title",
        f"{data_only} has no u.user beside its ratings: its users have no age, gender or "
        "occupation"]
    for source in ("synthetic:tiny", "tfds:movielens/100k-ratings", str(tmp_path / "x.csv")):
        assert release_gaps(source) == []


def test_inference_tracing_adds_a_grus_gpu_variant_without_its_gradient_functions():
    """Inside `inference_tracing` a GRU's trace adds its cuDNN variant (for Grappler to swap
    in on a GPU) without the gradient functions Keras adds for it elsewhere: in another
    thread meanwhile, after it, and after it ended in an error (nested, the outer one still
    holds)."""
    import re
    import threading
    import tensorflow as tf
    from tworec.features.layers import inference_tracing
    gru = tf.keras.layers.GRU(4)
    inputs = tf.random.stateless_normal([3, 5, 2], seed=[0, 1])                   # [b, t, d]

    def traced() -> set[str]:
        """The functions in the graph of a new trace of the GRU, their numbers dropped."""
        graph = tf.function(lambda x: gru(x)).get_concrete_function(inputs).graph
        return {re.sub(r"_\d+", "", function.signature.name)
                for function in graph.as_graph_def().library.function}
    gradients = {"__forward_gpu_gru_with_fallback", "__inference___backward_gpu_gru_with_fallback"}
    plain, elsewhere = traced(), []
    with inference_tracing():
        inference = traced()
        thread = threading.Thread(target=lambda: elsewhere.append(traced()))
        thread.start()
        thread.join()
        with pytest.raises(ZeroDivisionError), inference_tracing():
            1 / 0
        nested = traced()
    after = traced()
    assert gradients <= plain and gradients <= elsewhere[0] and gradients <= after
    assert inference == nested == plain - gradients
    assert "__inference_gpu_gru_with_fallback" in inference
    with pytest.raises(ZeroDivisionError), inference_tracing():
        1 / 0
    assert gradients <= traced()
