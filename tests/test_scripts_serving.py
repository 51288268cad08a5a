"""A new user's first hour with the serving scripts: `--help` answers without loading
TensorFlow, serve.py warns once about a model with no versions and prints each log line once,
and recommend.py writes every user's recommendations from an export (or stops a mistake with
one line)."""
from __future__ import annotations

import contextlib
import io
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tworec.serving  # noqa: F401  (sets TF_USE_LEGACY_KERAS before TensorFlow loads)
import tensorflow as tf

from tworec.console import NATIVE_NOISE
from tworec.serving.batch import Progress, score_all
from tworec.serving.client import Client
from tworec.serving.errors import ServingError
from tworec.serving.layout import write_version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs a script as `python scripts/NAME.py ARGS` would, then says whether TensorFlow loaded.
PROBE = """
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
    code = 0
except SystemExit as exit:
    code = exit.code
print("tensorflow loaded:", "tensorflow" in sys.modules)
sys.exit(code)
"""


def probe(name: str, *args: str) -> tuple[subprocess.CompletedProcess, bool]:
    """(the finished script, whether it loaded TensorFlow)."""
    done = subprocess.run([sys.executable, "-c", PROBE, os.path.join(ROOT, "scripts", name),
                           *args], capture_output=True, text=True, timeout=120)
    *output, last = done.stdout.splitlines() or [""]
    assert last.startswith("tensorflow loaded:"), done.stdout + done.stderr
    done.stdout = "\n".join(output)
    return done, last.endswith("True")


# ------------------------------------------------------------------ --help


@pytest.mark.parametrize("name", ["benchmark.py", "recommend.py", "serve.py"])
def test_help_answers_without_loading_tensorflow(name):
    done, tensorflow_loaded = probe(name, "--help")
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr
    assert not tensorflow_loaded


# ------------------------------------------------------------------ serve.py


@pytest.mark.parametrize("flag", ["--max_rows_per_request", "--max_elements_per_request"])
def test_serve_refuses_a_negative_request_limit(flag):
    """--max_rows_per_request=-5 was taken, and the server then refused every request."""
    done, _ = probe("serve.py", "--model_name=x", "--model_base_path=/nowhere", f"{flag}=-5")
    assert done.returncode == 2
    assert f"error: {flag} must be at least 0, got -5" in done.stderr


@pytest.mark.parametrize("flag", ["--http_body_stall_seconds", "--http_write_stall_seconds",
                                  "--http_write_timeout_seconds"])
def test_serve_refuses_a_timeout_that_is_not_positive(flag):
    """A stall timeout of 0 would cut every REST connection off as soon as it waits."""
    done, _ = probe("serve.py", "--model_name=x", "--model_base_path=/nowhere", f"{flag}=0")
    assert done.returncode == 2
    assert f"error: {flag} must be more than 0, got 0" in done.stderr


class Scale(tf.Module):
    """x [b] float32 -> y [b] float32 = x * factor (a variable: loading restores it)."""

    def __init__(self, factor: float = 2.0):
        super().__init__()
        self.factor = tf.Variable(factor)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def serve(self, x):
        return {"y": x * self.factor}


def save_scale(base_path: str) -> str:
    module = Scale()
    return write_version(base_path, lambda path: tf.saved_model.save(
        module, path, signatures={"serving_default": module.serve}))


@contextlib.contextmanager
def serving(tmp_path, *flags: str, env: dict | None = None):
    """scripts/serve.py on a free gRPC port (REST off) until the block ends, which stops it
    with SIGTERM; yields its gRPC target once it says it is ready. Its stderr goes to a file
    (`log_of`)."""
    stderr_path = tmp_path / "serve.stderr"
    with open(stderr_path, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), "--port=0",
             "--rest_api_port=0", *flags], stdout=subprocess.PIPE, stderr=stderr, text=True,
            env={**os.environ, **(env or {})})
    watchdog = threading.Timer(300, process.kill)
    watchdog.start()
    try:
        ready = next((line for line in process.stdout if line.startswith("serving gRPC on ")),
                     None)
        assert ready, f"serve.py did not start: {stderr_path.read_text()[-3000:]}"
        yield ready.split()[3].rstrip(";")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        watchdog.cancel()
        process.kill()
        process.stdout.close()


def log_of(tmp_path) -> str:
    """What serve.py wrote to stderr."""
    return (tmp_path / "serve.stderr").read_text()


def wait_until_available(target: str, name: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    with Client(grpc_target=target, retries=0) as client:
        while True:
            with contextlib.suppress(ServingError):
                states = client.status(name).model_version_status
                if any(status.state == status.AVAILABLE for status in states):
                    return
            assert time.monotonic() < deadline, f"{name} never became available"
            time.sleep(0.05)


def test_serve_warns_once_about_a_missing_base_path_and_serves_the_version_written_later(
        tmp_path):
    """As TF Serving: the server starts, polls, and loads the version once it appears; the
    warning names the path once, however many polls found nothing."""
    base = str(tmp_path / "models" / "scale")
    with serving(tmp_path, "--model_name=scale", f"--model_base_path={base}",
                 "--file_system_poll_wait_seconds=0.05") as target:
        save_scale(base)                            # meanwhile, polls that found nothing
        wait_until_available(target, "scale")
    warnings = [line for line in log_of(tmp_path).splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: no versions of model scale found under {base} (the folder "
                        "does not exist); the server starts without it, polling every 0.05 s "
                        "for one"], log_of(tmp_path)
    assert not any(NATIVE_NOISE.match(line.encode())               # the first Session run's
                   for line in log_of(tmp_path).splitlines()), log_of(tmp_path)


def test_serve_warns_about_a_folder_without_integer_versions(tmp_path):
    base = tmp_path / "scale"
    (base / "v1").mkdir(parents=True)
    with serving(tmp_path, "--model_name=scale", f"--model_base_path={base}",
                 "--file_system_poll_wait_seconds=0"):
        pass
    assert f"a version is a folder named by an integer, e.g. {base / '1'}" in log_of(tmp_path)
    assert "not polling (--file_system_poll_wait_seconds=0)" in log_of(tmp_path)


@pytest.mark.parametrize("busy", ["--port", "--rest_api_port"])
def test_serve_says_in_one_line_that_a_port_is_taken(tmp_path, busy):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = {"--port": 0, "--rest_api_port": 0, busy: taken.getsockname()[1]}
        done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "serve.py"),
                               *(f"{flag}={port}" for flag, port in ports.items()),
                               "--model_name=x", f"--model_base_path={tmp_path}"],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: cannot open --port={ports['--port']}")
    assert f"{busy}={ports[busy]} on 127.0.0.1 (" in done.stderr
    assert done.stderr.endswith("is another server using it? pass free ports (0 picks one)\n")
    assert len(done.stderr.splitlines()) == 1, done.stderr


# serve.py with a start that Ctrl-C interrupts (as it would while the first models load).
INTERRUPTED_START = """
import runpy, sys
from tworec.serving.server import ModelServer
def interrupted(self):
    raise KeyboardInterrupt
ModelServer.start = interrupted
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_serve_says_in_one_line_that_ctrl_c_stopped_it_while_loading(tmp_path):
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_START,
                           os.path.join(ROOT, "scripts", "serve.py"), "--port=0",
                           "--model_name=x", f"--model_base_path={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 130, done.stderr
    assert done.stderr == "error: stopped (Ctrl-C) while the models loaded, before serving\n"


def test_serve_prints_each_tensorflow_log_line_once(tmp_path):
    """TensorFlow's own logger printed every line a second time beside the root logger's."""
    base = str(tmp_path / "scale")
    save_scale(base)
    with serving(tmp_path, "--model_name=scale", f"--model_base_path={base}",
                 env={"TWOREC_VERBOSE": "1"}) as target:
        wait_until_available(target, "scale")
    log = log_of(tmp_path)
    restored = [line for line in log.splitlines() if "Restoring parameters from" in line]
    assert len(restored) == 1, log[-3000:]


# ------------------------------------------------------------------ recommend.py --all


class ToyRanking(tf.Module):
    """user_id [b] string, item_ids [b, k] string -> scores [b, k] float32: a hash of each
    item id, -1 for an empty slot. With `users` ([u] str) it holds a table of known users
    where the real exports keep theirs (`users.user_positions`)."""

    def __init__(self, users: np.ndarray | None = None):
        super().__init__()
        if users is not None:
            self.users = tf.Module()
            self.users.user_positions = tf.lookup.StaticHashTable(
                tf.lookup.KeyValueTensorInitializer(tf.constant(users),
                                                    tf.range(len(users), dtype=tf.int64)), -1)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="user_id"),
                                  tf.TensorSpec([None, None], tf.string, name="item_ids")])
    def serve(self, user_id, item_ids):
        hashed = tf.cast(tf.strings.to_hash_bucket_fast(item_ids, 1000), tf.float32)  # [b, k]
        return {"scores": tf.where(item_ids == "", -1.0, hashed)}


def save_module(module: tf.Module, base_path: str) -> str:
    return write_version(base_path, lambda path: tf.saved_model.save(
        module, path, signatures={"serving_default": module.serve}))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Base paths of a retrieval export of an untrained two-tower model on a small synthetic
    log (its k is the whole catalogue, so every user's list ends in empty slots), of the
    recommender composed of it and a toy ranking, and of a ranking-like export; and the ids
    of the users the exports know, in code order."""
    from tworec.features import generate, split
    from tworec.features.inputs import prepare
    from tworec.features.synthetic import SyntheticConfig
    from tworec.retrieval.config import preset
    from tworec.retrieval.export import export
    from tworec.retrieval.train import build_model
    from tworec.serving.compose import compose_recommender
    root = tmp_path_factory.mktemp("exports")
    log = generate(SyntheticConfig(num_users=40, num_items=30, num_interactions=500,
                                   num_clusters=3), seed=0)
    data = prepare(log, split(log, "temporal"), history_length=5)
    users = log.user_ids[np.flatnonzero(data.known)]
    retrieval = export(build_model(preset("tiny"), data), data, str(root / "retrieval"),
                       k=log.num_items)
    ranking = save_module(ToyRanking(), str(root / "ranking"))
    write_version(str(root / "recommender"),
                  lambda path: compose_recommender(retrieval, ranking, path, top_n=8))
    save_module(ToyRanking(users), str(root / "ranking_with_users"))
    return {"retrieval": str(root / "retrieval"), "recommender": str(root / "recommender"),
            "ranking": str(root / "ranking"),
            "ranking_with_users": str(root / "ranking_with_users"), "users": users}


def signature_answers(base_path: str, users: np.ndarray, batch_size: int | None = None
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(item_ids [U, k] bytes, scores [U, k] float32): version 1's serving_default called on
    `users` [U] directly, `batch_size` at a time (all at once when None)."""
    signature = tf.saved_model.load(os.path.join(base_path, "1")).signatures["serving_default"]
    size = batch_size or len(users)
    answers = [signature(user_id=tf.constant(users[start:start + size].astype(bytes)))
               for start in range(0, len(users), size)]
    return tuple(np.concatenate([answer[name].numpy() for answer in answers])
                 for name in ("item_ids", "scores"))


def expected_rows(users: np.ndarray, item_ids: np.ndarray, scores: np.ndarray, n: int,
                  titles: dict) -> dict:
    """The Parquet columns, by a plain loop over the answers' filled slots among the first n."""
    rows = {"user_id": [], "rank": [], "item_id": [], "score": [], "title": []}
    for user, items, values in zip(users, item_ids, scores):
        for rank, (item, score) in enumerate(zip(items[:n], values[:n]), 1):
            if item != b"":
                row = (str(user), rank, item.decode(), float(score), titles.get(item.decode()))
                for column, value in zip(rows, row):
                    rows[column].append(value)
    return rows


@pytest.mark.parametrize("name, n", [("retrieval", 30), ("retrieval", 3), ("recommender", 8)])
def test_score_all_writes_what_the_signature_answers_a_batch_per_row_group(exports, tmp_path,
                                                                           name, n):
    """Exactly the signature's answers on the same batches; the same ids as one call on
    every user, and scores within float32 rounding of it (a matmul rounds differently with
    the number of rows)."""
    users = exports["users"]
    titles = {f"i{i}": f"Film {i}" for i in range(0, 30, 2)}          # odd ids: no title
    out = str(tmp_path / "recs.parquet")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        rows = score_all(exports[name], out, n=n, batch_size=16, titles=titles)
    table = pq.read_table(out)
    assert table.schema == pa.schema([("user_id", pa.string()), ("rank", pa.int32()),
                                      ("item_id", pa.string()), ("score", pa.float32()),
                                      ("title", pa.string())])
    batched = signature_answers(exports[name], users, batch_size=16)
    assert table.to_pydict() == expected_rows(users, *batched, n, titles)
    whole = signature_answers(exports[name], users)
    assert (whole[0] == batched[0]).all()
    np.testing.assert_allclose(whole[1], batched[1], rtol=1e-6, atol=1e-6)
    assert rows == table.num_rows and pq.ParquetFile(out).metadata.num_row_groups == \
        math.ceil(len(users) / 16)
    filled = (batched[0][:, :n] != b"").sum(axis=1)
    fewer = int(((filled > 0) & (filled < min(n, batched[0].shape[1]))).sum())
    assert [str(warning.message) for warning in said if "known users" in str(warning.message)
            ] == ([f"{fewer} known users got fewer than {n} items back (their seen items are "
                   "excluded; a ScaNN export may also find fewer)"] if fewer else [])
    if n == 30:                                     # empty slots were there, and dropped
        assert fewer and 0 < rows < len(users) * n and "" not in table["item_id"].to_pylist()
    assert os.listdir(tmp_path) == ["recs.parquet"]


class ListsOfTwo:
    """A stand-in export answering two slots a user: u1 one item, u2 none (it has them all)."""

    def run(self, inputs):
        assert inputs["user_id"].tolist() == [b"u1", b"u2"]
        return {"item_ids": np.array([[b"i1", b""], [b"", b""]], object),
                "scores": np.array([[0.5, -np.inf], [-np.inf, -np.inf]], np.float32)}


def test_users_with_fewer_items_or_none_left_are_said_and_a_users_partial_file_kept(tmp_path):
    """A known user whose every item is theirs has no row: said, not dropped in silence. The
    file is written aside under a name of its own, never over one of the user's."""
    from tworec.serving.batch import _write_batches, partial_file
    mine = tmp_path / "recs.parquet.partial"
    mine.write_text("the user's own file")
    out = str(tmp_path / "recs.parquet")
    aside = partial_file(out)
    with pytest.warns(UserWarning) as said:
        rows = _write_batches(ListsOfTwo(), np.array([b"u1", b"u2"], object), aside, 2, 8,
                              None, None)
    assert [str(warning.message) for warning in said] == [
        "1 known users got no item back (their seen items are excluded; a ScaNN export may "
        "also find fewer), so the file has no row of them, e.g. 'u2'",
        "1 known users got fewer than 2 items back (their seen items are excluded; a ScaNN "
        "export may also find fewer)"]
    assert rows == 1 and pq.read_table(aside)["user_id"].to_pylist() == ["u1"]
    assert os.path.basename(aside).startswith(".recs.parquet.") and aside.endswith(".partial")
    assert mine.read_text() == "the user's own file"


def test_score_all_keeps_a_users_partial_file_and_writes_a_file_others_can_read(exports,
                                                                               tmp_path):
    mine = tmp_path / "recs.parquet.partial"
    mine.write_text("the user's own file")
    previous = os.umask(0o022)
    try:
        score_all(exports["recommender"], str(tmp_path / "recs.parquet"), n=2)
    finally:
        os.umask(previous)
    assert mine.read_text() == "the user's own file"
    assert sorted(os.listdir(tmp_path)) == ["recs.parquet", "recs.parquet.partial"]
    assert os.stat(tmp_path / "recs.parquet").st_mode & 0o777 == 0o644


def test_score_all_refuses_exports_it_cannot_score(exports, tmp_path):
    out = str(tmp_path / "recs.parquet")
    with pytest.raises(ValueError, match="has no table of known users"):
        score_all(exports["ranking"], out)
    with pytest.raises(ValueError, match="serving_default takes item_ids, user_id"):
        score_all(exports["ranking_with_users"], out)
    assert not os.listdir(tmp_path)


def test_recommend_all_script_writes_the_file_and_says_where(exports, tmp_path):
    movies = tmp_path / "movies.csv"
    movies.write_text("movieId,title\n" + "".join(f"i{i},Film {i}\n" for i in range(30)))
    out = tmp_path / "recs.parquet"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "recommend.py"),
                           "--all", "--export", exports["recommender"], "--out", str(out),
                           "--n", "5", "--movies", str(movies), "--batch-size", "8"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    table = pq.read_table(out)
    assert max(table["rank"].to_pylist()) == 5 and None not in table["title"].to_pylist()
    lines = done.stdout.splitlines()
    assert lines[-1] == f"wrote {table.num_rows:,} rows to {out}"
    assert all(line.startswith("scored ") for line in lines[:-1]) and len(lines) <= 10


def test_recommend_all_says_when_the_export_returns_fewer_items_than_asked(exports, tmp_path):
    out = tmp_path / "recs.parquet"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "recommend.py"),
                           "--all", "--export", exports["recommender"], "--out", str(out),
                           "--n", "1000"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    width = max(pq.read_table(out)["rank"].to_pylist())
    assert width < 1000
    assert f"note: the export returns {width} items per user, fewer than the 1000 asked for; " \
        "the file holds those" in done.stdout.splitlines()


def test_score_all_says_when_no_item_has_one_of_the_titles_given(exports, tmp_path):
    with pytest.warns(UserWarning, match="no item written has one of the titles given"):
        score_all(exports["retrieval"], str(tmp_path / "recs.parquet"), n=3,
                  titles={"x1": "Another catalogue's film"})


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_line_a_tenth_off_a_terminal_one_line_on_it_and_none_for_one_batch():
    streams = {"file": io.StringIO(), "terminal": Terminal()}
    for stream in streams.values():
        progress = Progress(stream)
        for done in [*range(20, 300, 20), 300]:              # 15 batches
            progress(done, 300)
    assert streams["file"].getvalue().splitlines() == [      # the first past each tenth
        f"scored {d} of 300 users ({d // 3}%)" for d in (40, 60, 100, 120, 160, 180, 220, 240,
                                                         280)]
    on_terminal = streams["terminal"].getvalue()
    assert "\n" not in on_terminal and on_terminal.endswith("(93%)\r\033[K")   # erased
    single = io.StringIO()
    Progress(single)(300, 300)
    assert single.getvalue() == ""


@pytest.mark.parametrize("args, message", [
    (["--all", "--export", "EXPORT"], "--all needs --out, the Parquet file to write"),
    (["--all", "--out", "OUT/recs.parquet"], "--all needs --export"),
    (["--all", "--export", "EXPORT", "--out", "OUT"], f"--out OUT is a folder; give a file "
                                                      f"in it, e.g. OUT{os.sep}recs.parquet"),
    (["--all", "--export", "EXPORT", "--out", "OUT/none/recs.parquet"],
     "the folder OUT/none does not exist"),
    (["--all", "--export", "OUT", "--out", "OUT/recs.parquet"],
     "--export OUT holds no SavedModel (no VERSION/saved_model.pb in it); give an export "
     "folder such as RUN/export/recommender"),
    (["--all", "--export", "EXPORT", "--version", "7", "--out", "OUT/recs.parquet"],
     "--export EXPORT has no version 7; its versions are 1"),
    (["--all", "--export", "EXPORT", "--out", "OUT/recs.parquet", "--n", "0"],
     "--n must be at least 1, got 0"),
    (["--all", "--export", "EXPORT", "--out", "OUT/recs.parquet", "--batch-size", "0"],
     "--batch-size must be at least 1, got 0"),
    (["--all", "--export", "EXPORT", "--out", "OUT/recs.parquet", "--movies", "OUT/bad.csv"],
     "needs an item id column"),
    (["--all", "--user", "u1", "--export", "EXPORT", "--out", "OUT/recs.parquet"],
     "--user and --all exclude each other"),
    (["--all", "--export", "EXPORT", "--out", "OUT/recs.parquet", "--grpc", "host:8500"],
     "--grpc goes with --user, not --all"),
    (["--user", "u1", "--out", "OUT/recs.parquet"], "--out goes with --all, not --user"),
    (["--user", "u1", "--n", "0"], "--n must be at least 1, got 0"),
    (["--user", "u1", "--url", "127.0.0.1:8501"],
     "--url 127.0.0.1:8501: give the scheme too, e.g. http://127.0.0.1:8501"),
    (["--user", "u1", "--url", "http://127.0.0.1:8501", "--grpc", "127.0.0.1:8500"],
     "--url and --grpc exclude each other"),
    (["--user", "u1", "--grpc", "localhost"],
     "--grpc localhost: give HOST:PORT, with no scheme and the port, e.g. localhost:8500"),
    (["--user", "u1", "--grpc", "http://localhost:8500"], "e.g. localhost:8500"),
    (["--all", "--export", "EXPORT", "--out", "/proc/recs.parquet"],   # a folder, not writable
     "--out /proc/recs.parquet: cannot write it here"),
    (["--all", "--export", "EXPORT", "--out", "OUT/recs.csv"],
     "--out OUT/recs.csv: the file is written as Parquet; name it .parquet, e.g. "
     "OUT/recs.parquet"),
    (["--user", "u1", "--n", "ten"], "argument --n: invalid int value: 'ten'"),
    ([], "give --user ID (one user, from a server) or --all --export DIR --out FILE"),
])
def test_recommend_mistakes_stop_with_one_line_before_tensorflow_loads(tmp_path, args,
                                                                        message):
    export = tmp_path / "export"
    (export / "1").mkdir(parents=True)
    (export / "1" / "saved_model.pb").write_bytes(b"")
    (tmp_path / "bad.csv").write_text("id,name\n1,x\n")
    paths = {"EXPORT": str(export), "OUT": str(tmp_path)}

    def filled(text: str) -> str:
        for placeholder, path in paths.items():
            text = text.replace(placeholder, path)
        return text
    done, tensorflow_loaded = probe("recommend.py", *map(filled, args))
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and filled(message) in done.stderr, done.stderr
    assert len(done.stderr.splitlines()) == 1 and not tensorflow_loaded
    assert sorted(os.listdir(tmp_path)) == ["bad.csv", "export"]           # nothing written
