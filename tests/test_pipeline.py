"""End to end: the whole pipeline on the tiny synthetic preset."""
import functools
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import answers_of, exit_before_tensorflow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = {
    "data": {"source", "users", "items", "interactions", "split", "test_users", "dropped",
             "state", "exclude_seen", "cold_start"},
    "retrieval": {"test", "train", "against_baselines"},
    "index": {"kind", "params", "tuned_on", "recall@10_vs_exact", "test_recall@10_vs_exact",
              "latency_ms_p50", "exact_latency_ms_p50", "exported"},
    "ranking": {"model", "task", "test", "train"}, "two_stage": {"test", "against_baselines"},
    "baselines": {"popularity", "ease", "item_transition", "popular_now"},
    "serving": {"users", "rows", "served", "exclude_seen", "ranking_export_max_abs_diff"},
    "exports": {"retrieval", "ranking", "recommender"},
}


def script(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args],
                          capture_output=True, text=True, timeout=timeout)


def tiny_run(name: str, out) -> subprocess.CompletedProcess:
    """scripts/`name` on the tiny synthetic log with two retrieval members, into `out`."""
    done = script(name, "--data", "synthetic:tiny", "--preset", "tiny", "--members", "2",
                  "--out", str(out), timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    done = tiny_run("pipeline.py", out)
    (out / "command_output.txt").write_text(done.stdout + done.stderr)
    return out, json.load(open(out / "report.json"))


@pytest.fixture(scope="module")
def retrieval_run(tmp_path_factory):
    """A run folder of train_retrieval.py (retrieval, baselines, index, retrieval exports,
    report); tests that change it copy it first."""
    out = tmp_path_factory.mktemp("retrieval_run")
    tiny_run("train_retrieval.py", out)
    return out


def test_the_run_is_quiet_and_says_each_step_and_where_the_report_is(run):
    """No TensorFlow, absl or ScaNN log line and no warning; each step with its duration; one
    labelled line per epoch off a terminal; the last line names the report."""
    out, _ = run
    lines = (out / "command_output.txt").read_text().strip().splitlines()
    noise = [line for line in lines if not line.startswith(("[run]", "[retrieval]", "[ranking]"))]
    assert not noise, noise[:5]
    assert len(lines) < 60
    for step in ("train retrieval", "baselines", "tune index", "train ranking", "export",
                 "serve and check", "report"):
        assert any(line.startswith(f"[run] {step}: ") and line.endswith(" s") for line in lines), step
    assert sum(line.startswith("[retrieval] epoch ") for line in lines) == 3
    assert lines[-1] == f"[run] report: {out / 'report.md'} (also report.html, report.json, plots/)"


def test_report_follows_the_schema(run):
    _, report = run
    for section, keys in SCHEMA.items():
        assert keys <= set(report[section]), (section, set(report[section]))
    assert {"recall@10", "recall@50", "recall@100", "ndcg@10"} <= set(report["retrieval"]["test"])
    assert {"seconds", "epochs", "examples_per_second"} <= set(report["retrieval"]["train"])
    assert {"rmse", "auc"} <= set(report["ranking"]["test"])
    assert {"recall@10", "ndcg@10"} <= set(report["two_stage"]["test"])
    assert report["index"]["kind"] == "scann" and report["index"]["recall@10_vs_exact"] >= 0.95
    assert report["index"]["tuned_on"] == "validation"
    exported = report["index"]["exported"]             # timed as the ScaNN export searches
    assert exported["num_reordering_candidates"] >= exported["fetch"] > 100
    assert exported["verdict"] in ("faster", "slower", "unclear")
    assert (exported["verdict"] != "faster") == any(
        notice.startswith("the retrieval_scann export fetches") for notice in report["notices"])
    against = report["retrieval"]["against_baselines"]["popularity"]["ndcg@10"]
    assert against["difference"] == pytest.approx(
        report["retrieval"]["test"]["ndcg@10"] - report["baselines"]["popularity"]["ndcg@10"])
    assert against["ci95"][0] <= against["difference"] <= against["ci95"][1]


def test_served_lists_score_what_the_report_says(run):
    """The served check asked for every test user over REST and gRPC: the served lists'
    metrics equal the offline ones, and no served list holds a seen item."""
    _, report = run
    serving = report["serving"]
    assert serving["users"] == report["data"]["test_users"] == serving["rows"]
    for name, offline in (("retrieval", report["retrieval"]["test"]),
                          ("recommender", report["two_stage"]["test"])):
        served = serving["served"][name]
        assert served["seen_items_served"] == 0
        for key in offline:                       # every K, past the served list too
            assert served[key] == pytest.approx(offline[key], abs=served["float_ties"] / serving["rows"])
    assert {"recall@100", "ndcg@100"} <= set(serving["served"]["recommender"])
    two_stage = report["two_stage"]["test"]           # the recommender serves its top 10
    assert two_stage["recall@100"] == two_stage["recall@10"] < report["retrieval"]["test"]["recall@100"]
    assert serving["ranking_export_max_abs_diff"] < 1e-4
    if "retrieval_scann" in report["exports"]:          # approximate: measured as served
        scann = serving["served"]["retrieval_scann"]
        assert scann["seen_items_served"] == 0 and scann["rows"] == serving["rows"]
        assert 0.5 < scann["share_of_exact_items"] <= 1 and 0 < scann["recall@10"] <= 1
        assert 0 < scann["share_users"] <= serving["users"]
    state = report["data"]["state"]
    assert state["rows"] == report["data"]["interactions"] - report["data"]["test_users"]


def test_models_beat_popularity_on_the_planted_structure(run):
    _, report = run
    popularity = report["baselines"]["popularity"]["recall@10"]
    assert report["retrieval"]["test"]["recall@10"] > 1.5 * popularity
    assert report["two_stage"]["test"]["recall@10"] > 1.5 * popularity


def test_every_export_loads_and_answers(run):
    out, report = run
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_log_pb2
    import tworec.serving  # noqa: F401  (registers ScaNN's ops for retrieval_scann)
    from tworec.serving.model import register_custom_ops
    register_custom_ops()
    answers = {}
    for name, path in report["exports"].items():
        assert os.path.basename(path) == "1", path
        model = tf.saved_model.load(path)
        signature = model.signatures["serving_default"]
        inputs = {"user_id": tf.constant(["u0", "nobody"])}
        if name == "ranking":
            inputs["item_ids"] = tf.constant([["i0", "i1"], ["i2", "zzz"]])
        outputs = signature(**inputs)
        assert np.isfinite(outputs["scores"].numpy()).all(), name
        answers[name] = outputs
        if name.startswith("retrieval"):       # two members of 16 dimensions (--members 2)
            embedding = model.signatures["embed_user"](user_id=tf.constant(["u0"]))["embedding"]
            assert embedding.shape == (1, 32), name
        if name == "ranking":                  # the held-out popularity signals are served
            assert "period_popularity" in op_scopes(path)
        warmup = os.path.join(path, "assets.extra", "tf_serving_warmup_requests")
        signatures = {prediction_log_pb2.PredictionLog.FromString(record).predict_log.request
                      .model_spec.signature_name
                      for record in tf.compat.v1.io.tf_record_iterator(warmup)}
        assert signatures == set(model.signatures), name    # built at load, not on a request
        assert os.stat(path).st_mode & 0o005 == 0o005, "a non-root server cannot read " + path
    # A user the exports do not know gets the popular order from every model, the composed
    # recommender included (it must not re-rank the popular list).
    popular = answers["retrieval"]["item_ids"].numpy()[1]
    assert np.array_equal(answers["recommender"]["item_ids"].numpy()[1], popular[:10])
    stock = open(out / "export" / "models.config").read()
    assert all(f'name: "{name}"' in stock for name in ("retrieval", "ranking", "recommender"))
    assert "retrieval_scann" not in stock         # stock TF Serving would not start
    assert 'name: "retrieval_scann"' in open(out / "export" / "models_scann.config").read()
    docker = open(out / "export" / "models.docker.config").read()
    assert 'base_path: "/models/retrieval"' in docker and str(out) not in docker


def test_make_serve_serves_the_run_folder(run):
    """`make serve RUN=...` as the Makefile runs it (on free ports): every model of
    models_scann.config becomes AVAILABLE and answers a user; SIGTERM stops it cleanly."""
    import requests
    out, _ = run
    command = subprocess.run(["make", "-s", "-n", "serve", f"RUN={out}"], cwd=ROOT, text=True,
                             capture_output=True, check=True).stdout.strip().splitlines()[-1]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = command.replace("--port=8500", "--port=0").replace(
        "--rest_api_port=8501", f"--rest_api_port={port}")
    server = subprocess.Popen(shlex.split(command), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        assert any("serving gRPC" in line for line in server.stdout), "the server did not start"
        for name in ("retrieval", "retrieval_scann", "ranking", "recommender"):
            for _ in range(600):
                status = requests.get(f"http://127.0.0.1:{port}/v1/models/{name}", timeout=10)
                if status.ok and status.json()["model_version_status"][0]["state"] == "AVAILABLE":
                    break
                time.sleep(0.1)
            inputs = {"user_id": ["u0"]}
            if name == "ranking":
                inputs["item_ids"] = [["i0", "i1"]]
            answer = requests.post(f"http://127.0.0.1:{port}/v1/models/{name}:predict",
                                   json={"inputs": inputs}, timeout=60)
            assert answer.ok, (name, answer.text)
        server.terminate()
        assert server.wait(timeout=60) == 0
    finally:
        server.kill()
        server.stdout.close()


def test_plots_and_human_report_exist(run):
    out, _ = run
    for plot in ("training.png", "recall_at_k.png", "index.png"):
        assert (out / "plots" / plot).stat().st_size > 5000
    text = (out / "report.md").read_text()
    assert "tensorflow_model_server" in text and "| popularity |" in text
    page = (out / "report.html").read_text()
    assert "<table>" in page and page.count('src="data:image/png;base64,') == 3
    assert "http://" not in page and "https://" not in page        # nothing fetched to read it
    assert (out / "config.json").exists() and (out / "tensorboard").is_dir()
    from tworec.pipeline.folder import RUN_ENTRIES        # what --overwrite clears: all of it
    assert set(os.listdir(out)) - {"command_output.txt"} <= set(RUN_ENTRIES)


def test_train_retrieval_script_writes_its_part_of_the_run(retrieval_run):
    report = json.load(open(retrieval_run / "report.json"))
    assert report["retrieval"]["test"]["recall@10"] > report["baselines"]["popularity"]["recall@10"]
    assert report["retrieval"]["loss"]["logq_correction"] is True
    assert set(report["exports"]) == {"retrieval", "retrieval_scann"}
    assert "ranking" not in report and "two_stage" not in report
    assert (retrieval_run / "vocab" / "items.json").exists()
    assert (retrieval_run / "retrieval" / "weights.index").exists()
    assert "| popularity |" in (retrieval_run / "report.md").read_text()
    assert json.load(open(retrieval_run / "config.json"))["retrieval"]["members"] == 2


def test_a_run_that_served_nothing_shows_retrievals_list(retrieval_run):
    """train_retrieval.py: no ranking, nothing served; the report's example users show
    retrieval's list (here, not in test_report.py: one file builds `retrieval_run` once)."""
    out, report = retrieval_run, json.load(open(retrieval_run / "report.json"))
    examples = report["examples"]
    assert examples["list"] == "retrieval" and len(examples["users"]) == 5
    users = [user["user"] for user in examples["users"]]
    served = answers_of(report["exports"]["retrieval"], users)
    assert [[item["id"] for item in user["list"]] for user in examples["users"]] == \
        [list(answer[:10]) for answer in served]
    text = (out / "report.md").read_text()
    assert "| # | retrieval's top 10 |" in text and "Two-stage against" not in text
    assert "Protocol `temporal`: per user, the last interaction is held out" in text


def test_train_ranking_reuses_a_retrieval_run_and_matches_the_pipeline(run, retrieval_run,
                                                                       tmp_path):
    """Ranking alone on a trained retrieval run: retrieval is reloaded, not retrained (its files
    are untouched), and with the same seeds the two-stage figures equal the pipeline's."""
    folder = tmp_path / "run"
    shutil.copytree(retrieval_run, folder)
    weights = (folder / "retrieval" / "weights.index").read_bytes()
    summary = (folder / "retrieval_train.json").read_text()
    done = script("train_ranking.py", "--retrieval-run", str(folder))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.load(open(folder / "report.json"))
    assert "load retrieval" in report["timings"] and "train retrieval" not in done.stdout
    assert (folder / "retrieval" / "weights.index").read_bytes() == weights
    assert (folder / "retrieval_train.json").read_text() == summary
    _, pipeline = run
    assert report["two_stage"]["test"] == pipeline["two_stage"]["test"]
    assert report["ranking"]["test"] == pipeline["ranking"]["test"]
    assert report["baselines"] == pipeline["baselines"]        # evaluated again, for intervals
    assert report["two_stage"]["against_baselines"] == pipeline["two_stage"]["against_baselines"]
    assert set(report["exports"]) == {"retrieval", "retrieval_scann", "ranking", "recommender"}
    config = open(folder / "export" / "models_scann.config").read()
    assert all(f'name: "{name}"' in config for name in report["exports"])


@pytest.mark.parametrize("name, args, message", [
    ("train_retrieval.py", ["--data", "synthetic:tiny", "--epochs", "0", "--out", "OUT/new"],
     "epochs must be positive"),
    ("train_ranking.py", ["--retrieval-run", "OUT"], "not a run folder"),
    ("pipeline.py", ["--data", "OUT/none.csv", "--out", "OUT/new"], "no such file"),
    ("pipeline.py", ["--data", "synthetic:tiny"], "the following arguments are required: --out"),
    ("pipeline.py", ["--out", "OUT/a-file"], "is a file"),
    ("pipeline.py", ["--out", "OUT/a-file/run"],
     "a-file/run: cannot make this folder (Not a directory); name one that can be made"),
    ("train_retrieval.py", ["--out", ""], "'': cannot make this folder"),
    ("pipeline.py", ["--data", "", "--out", "OUT/new"], "'': no such file or folder"),
    ("pipeline.py", ["--split", "", "--out", "OUT/new"], "split '': choose one of"),
    ("pipeline.py", ["--out", "OUT/a-run"], "already holds a run; pass --overwrite"),
    ("pipeline.py", ["--out", "OUT/a-folder"], "other files in it"),
    ("pipeline.py", ["--split", "weekly", "--out", "OUT/new"], "split 'weekly'"),
    ("pipeline.py", ["--split", "global:2", "--out", "OUT/new"], "0 < Q < 1"),
    ("train_ranking.py", ["--retrieval-run", "OUT/a-run", "--split", "random"],
     "leave out --split"),
    ("train_ranking.py", ["--retrieval-run", "OUT/a-run", "--delimiter", ";"],
     "leave out --delimiter"),
    ("train_ranking.py", ["--retrieval-run", "OUT/a-run", "--members", "2"],
     "leave out --members"),
    ("train_retrieval.py", ["--members", "0", "--out", "OUT/new"], "members must be positive"),
    ("train_retrieval.py", ["--partitioner", "fixed:2", "--out", "OUT/new"],
     "it goes with --strategy parameter_server"),
    ("train_retrieval.py", ["--strategy", "parameter_server", "--out", "OUT/new"],
     "--strategy parameter_server runs on the chief of a TF_CONFIG cluster with ps tasks "
     "(TF_CONFIG: unset)"),
    ("train_retrieval.py", ["--strategy", "parameter_server", "--mixed-precision", "--out",
                            "OUT/new"], "mixed_precision with strategy 'parameter_server'"),
    ("train_retrieval.py", ["--strategy", "parameter_server", "--jit-compile", "--out",
                            "OUT/new"], "jit_compile with strategy 'parameter_server': XLA"),
    ("pipeline.py", ["--data", "OUT/semicolons.csv", "--delimiter", ",", "--out", "OUT/new"],
     "does not split the header"),
    ("pipeline.py", ["--data", "OUT/pairs.csv", "--out", "OUT/new"],
     "split 'temporal': no user has 3 or more rows"),
    ("pipeline.py", ["--data", "OUT/singles.csv", "--split", "latest", "--out", "OUT/new"],
     "split 'latest': no user has 2 or more rows"),
    ("pipeline.py", ["--top-k", "0", "--out", "OUT/new"],
     "--top-k (candidates) must be positive, got 0"),
    ("pipeline.py", ["--top-n", "0", "--out", "OUT/new"],
     "--top-n (top_n) must be positive, got 0"),
    ("pipeline.py", ["--top-k", "5", "--top-n", "10", "--out", "OUT/new"],
     "--top-n (top_n) 10 is more than the 5 candidates"),
    ("train_ranking.py", ["--data", "synthetic:tiny", "--epochs", "0", "--out", "OUT/new"],
     "epochs must be positive"),
    ("train_ranking.py", ["--top-k", "0", "--out", "OUT/new"],
     "--top-k (candidates) must be positive, got 0"),
    ("train_ranking.py", ["--task", "regression", "--popularity-periods", "5", "--out",
                          "OUT/new"], "popularity_periods 5: the ranker's task is regression"),
    ("train_ranking.py", ["--task", "regression", "--title-neighbors", "5", "--out",
                          "OUT/new"], "title_neighbors 5: the ranker's task is regression"),
    ("train_ranking.py", ["--task", "regression", "--title-candidates", "5", "--out",
                          "OUT/new"], "title_candidates 5: the ranker's task is regression"),
])
def test_script_mistakes_fail_before_training_with_one_line(tmp_path, name, args, message):
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "a-run").mkdir()
    (tmp_path / "a-run" / "config.json").write_text("{}")
    (tmp_path / "a-run" / "report.json").write_text("{}")      # a step finished
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-folder" / "notes.txt").write_text("mine")
    (tmp_path / "semicolons.csv").write_text("user_id;item_id;timestamp\nu1;i1;1\nu1;i2;2\n")
    (tmp_path / "pairs.csv").write_text("user_id,item_id,timestamp\nu1,i1,1\nu1,i2,2\n")
    (tmp_path / "singles.csv").write_text("user_id,item_id,timestamp\nu1,i1,1\nu2,i2,2\n")
    done = script(name, *(arg.replace("OUT", str(tmp_path)) for arg in args), timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("name, args", [
    ("pipeline.py", ["--data", "OUT/semicolons.csv", "--delimiter", ",", "--out", "OUT/new"]),
    ("train_ranking.py", ["--retrieval-run", "OUT"]),
    ("pipeline.py", ["--out", "OUT/a-run"]),
    ("pipeline.py", ["--out", "OUT/a-run/config.json/run"]),
    ("pipeline.py", ["--top-k", "5", "--top-n", "10", "--out", "OUT/new"]),
    ("train_retrieval.py", ["--epochs", "0", "--out", "OUT/new"])])
def test_script_mistakes_are_found_before_tensorflow_loads(tmp_path, name, args):
    """The checks of the folder, the log and the configs need no TensorFlow (~4 s to import):
    a mistake is answered at once."""
    (tmp_path / "semicolons.csv").write_text("user_id;item_id;timestamp\nu1;i1;1\n")
    (tmp_path / "a-run").mkdir()
    (tmp_path / "a-run" / "config.json").write_text("{}")
    (tmp_path / "a-run" / "report.json").write_text("{}")      # a step finished
    argv = [os.path.join(ROOT, "scripts", name)] + [a.replace("OUT", str(tmp_path)) for a in args]
    done = exit_before_tensorflow(argv)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr[-2000:]
    assert done.stderr.startswith("error: "), done.stderr


@pytest.mark.parametrize("name", ["pipeline.py", "train_retrieval.py", "train_ranking.py",
                                  "describe_data.py", "benchmark.py", "recommend.py", "serve.py",
                                  "compare.py"])
def test_every_script_answers_an_argument_mistake_in_one_line(name):
    done = script(name, "--no-such-flag", timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and done.stderr.endswith(" (see --help)\n")
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_train_ranking_script_on_the_random_protocol(tmp_path):
    """The TFRS tutorials' protocol: random 80/20 split, rating regression, RMSE reported; with
    the co-occurrence feature, which the served check then finds in the export too."""
    done = script("train_ranking.py", "--data", "synthetic:tiny", "--preset", "tiny", "--split",
                  "random", "--task", "regression", "--top-k", "20", "--cooccurrence-neighbors",
                  "20", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.load(open(tmp_path / "report.json"))
    test = report["ranking"]["test"]
    assert report["ranking"]["task"] == "regression"
    assert "by the ranker's predicted ratings" in open(tmp_path / "report.md").read()
    assert 0 < test["rmse"] < 1.5 and 0 <= test["auc"] <= 1    # AUC by predicted ratings
    assert done.stdout.splitlines()[-2].endswith(f"; test RMSE of the ratings {test['rmse']:.3f}")
    assert "calibration" not in report["ranking"]["train"]      # regression: nothing to rebalance
    assert report["serving"]["served"]["recommender"]["rows"] == report["data"]["test_rows"]
    assert "period_popularity" not in op_scopes(report["exports"]["ranking"])
    assert report["index"]["kind"] == "scann"           # the index step ran, as the pipeline's


def op_scopes(export: str) -> set[str]:
    """Every part of every op's name (its scopes and its own) in a SavedModel's functions."""
    from tensorflow.core.protobuf import saved_model_pb2
    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(export, "saved_model.pb"), "rb") as f:
        saved.ParseFromString(f.read())
    return {part for graph in saved.meta_graphs for function in graph.graph_def.library.function
            for node in function.node_def for part in node.name.split("/")}


def release_with_series(folder) -> str:
    """A MovieLens folder of the tiny synthetic log whose titles name a series: each item's
    title shares a word with the title of the item that most often follows it (the synthetic
    sessions' successors)."""
    from tworec.features import generate
    from tworec.features.synthetic import PRESETS
    log = generate(PRESETS["tiny"], seed=0)
    order = log.time_order()
    user, item = log.user[order], log.item[order]
    same_user = user[1:] == user[:-1]
    follows = np.zeros((log.num_items, log.num_items), int)
    np.add.at(follows, (item[:-1][same_user], item[1:][same_user]), 1)
    successor = follows.argmax(1)                                 # [I] the most frequent next
    release = folder / "release"
    release.mkdir()
    (release / "ratings.csv").write_text("userId,movieId,rating,timestamp\n" + "".join(
        f"{log.user_ids[user][1:]},{log.item_ids[item][1:]},{rating},{time}\n"
        for user, item, rating, time in zip(log.user, log.item, log.rating, log.timestamp)))
    (release / "movies.csv").write_text("movieId,title,genres\n" + "".join(
        f"{i},Saga{i} and Saga{successor[i]} ({1990 + i % 20}),Drama\n"
        for i in range(log.num_items)))
    return str(release)


def test_title_candidates_are_served_as_the_report_measures_them(tmp_path):
    """The two-stage lists add each known user's title candidates (`release_with_series`),
    serve some of them, and the served check (REST, gRPC and the composed recommender: the run
    fails on any difference) finds what the report says; report.md says how many of the served
    items they are."""
    from tworec.features.inputs import EMPTY_SLOT
    from tworec.pipeline import PIPELINE, execute, prepare_run, resolve
    from tworec.pipeline.served import ServedMismatch
    run = prepare_run(str(tmp_path / "run"), {"data": release_with_series(tmp_path)},
                      resolve("tiny", run={"candidates": 20}), verbose=0)   # of 150 items
    report = execute(run, PIPELINE)
    served, offline = report["serving"]["served"]["recommender"], report["two_stage"]["test"]
    assert report["two_stage"]["title_candidates"] == 10
    assert served["float_ties"] == 0 and served["ndcg@10"] == offline["ndcg@10"]
    users = run.served_lists["users"]                    # the share, from the offline lists
    rows = [np.flatnonzero(run.log.user[run.parts.test] == user)[0] for user in users]
    added = run.test_candidates[rows, 20:]                                      # [u, 10]
    lists = run.served_lists["lists"]["recommender"]["item_ids"]                # [u, 10]
    known = run.inputs.known[users][:, None] & (lists != "")
    titled = np.array([np.isin(row, run.log.item_ids[codes[codes >= 0]])
                       for row, codes in zip(lists, added)])
    share = served["title_candidate_share"]
    assert share == pytest.approx(titled[known].mean()) and share > 0
    assert f"; {share:.1%} of the items served to the known users checked are title " \
        "candidates." in (tmp_path / "run" / "report.md").read_text()
    added = run.test_candidates[:, 20:]                  # every checked row's is asked for
    row = np.flatnonzero((added >= 0).any(1))[-1]        # the last the export adds an item to
    assert row >= 64                                     # past the rows the scores are compared
    run.test_candidates[row, 20 + np.flatnonzero(added[row] >= 0)[0]] = EMPTY_SLOT
    with pytest.raises(ServedMismatch, match="candidates signature adds other title cand"):
        run.serve_and_check()


def test_run_configs_resolve_validate_and_round_trip(tmp_path):
    from tworec.pipeline import config
    configs = config.resolve("tiny", epochs=3, ranking={"model": "bst"})
    assert configs.retrieval.epochs == configs.ranking.epochs == 3
    assert configs.data.history_length == 5 and configs.ranking.model == "bst"
    config.write(str(tmp_path / "config.json"), configs, {"data": "synthetic"})
    assert config.read(str(tmp_path / "config.json")) == ({"data": "synthetic"}, configs)
    run, notices = configs.run.for_catalogue(30)
    assert (run.candidates, run.hard_negative_pool, run.top_n) == (30, 30, 10)
    assert notices == [f"{name} lowered to the catalogue size, 30 (the items the exports know)"
                       for name in ("candidates (--top-k) 100", "hard_negative_pool 50")]
    for bad, message in (({"data": {"history_length": 0}, "ranking": {"model": "bst"}},
                          "needs history_length > 0"),
                         ({"run": {"top_n": 0}}, r"--top-n \(top_n\) must be positive"),
                         ({"data": {"cold_start_window": 0}}, "--cold-start-window"),
                         ({"data": {"cold_start_window": 1.5}}, r"must be in \(0, 1\]"),
                         ({"data": {"cold_start_window": True}}, "got True"),
                         ({"run": {"top_m": 1}}, "unexpected keyword argument 'top_m'")):
        with pytest.raises(ValueError, match=message):
            config.resolve("tiny", **bad).validate()


def test_a_config_json_of_an_earlier_tworec_reads_as_it_was_trained(tmp_path):
    """A run folder written before retrieval had members holds one two-tower model: its
    config reads as 1 member, not today's default, so its weights load; one written before
    the title similarity or its candidates reads without them, as it was trained."""
    from tworec.pipeline import config
    configs = config.resolve("default")
    assert configs.retrieval.members > 1 and configs.ranking.title_neighbors > 0
    values = {"source": {"data": "synthetic"}, **configs.to_dict()}
    del values["retrieval"]["members"], values["ranking"]["title_neighbors"]
    del values["ranking"]["title_candidates"]
    (tmp_path / "config.json").write_text(json.dumps(values))
    earlier = config.read(str(tmp_path / "config.json"))[1]
    assert (earlier.retrieval.members, earlier.ranking.title_neighbors,
            earlier.ranking.title_candidates) == (1, 0, 0)


def test_epochs_go_to_the_stages_the_steps_train_only():
    """`--epochs` is the epochs of every stage the command trains: a retrieval-only run leaves
    ranking's (which config.json keeps for a later `train_ranking --retrieval-run`) alone."""
    from tworec.pipeline import config
    preset_epochs = config.resolve("tiny").ranking.epochs
    retrieval = config.resolve("tiny", epochs=7, steps=config.RETRIEVAL_ONLY)
    assert (retrieval.retrieval.epochs, retrieval.ranking.epochs) == (7, preset_epochs)
    ranking = config.resolve(base=retrieval, epochs=3, steps=config.RANKING_ONLY)
    assert (ranking.retrieval.epochs, ranking.ranking.epochs) == (7, 3)
    both = config.resolve("tiny", epochs=4, steps=config.PIPELINE)
    assert (both.retrieval.epochs, both.ranking.epochs) == (4, 4)
    assert config.resolve("tiny", epochs=4, steps=config.RETRIEVAL_ONLY,
                          ranking={"epochs": 6}).ranking.epochs == 6     # named: kept


def test_scripts_without_top_n_serve_at_most_their_candidates():
    """train_retrieval.py and train_ranking.py have --top-k but no --top-n: a K under the
    recommender's default list length shortens the list instead of being refused."""
    from tworec.pipeline import cli, config
    assert cli.candidates_run(5) == {"candidates": 5, "top_n": 5}
    assert cli.candidates_run(100) == {"candidates": 100, "top_n": config.RunConfig.top_n}
    config.resolve("tiny", run=cli.candidates_run(5)).validate()


def resolved(script: str, *args: str, shown: str) -> str:
    """The error line of `script` run with `args` when the run is about to start: `shown`, an
    expression of `checked.configs`, the configs it resolved (and would write to
    config.json), caught before TensorFlow loads."""
    argv = [os.path.join(ROOT, "scripts", script), *args]
    done = subprocess.run([sys.executable, "-c", (
        "import runpy, sys, types\n"
        "fake = types.ModuleType('tworec.pipeline.run')\n"
        "fake.StepFailed, fake.execute = RuntimeError, None\n"
        "def start_run(checked, verbose=1):\n"
        f"    raise ValueError(f'resolved {{{shown}}}')\n"
        "fake.start_run = start_run\n"
        "sys.modules['tworec.pipeline.run'] = fake\n"
        f"sys.argv = {argv!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")],
        capture_output=True, text=True, timeout=60)
    return done.stderr


def test_train_retrieval_epochs_leave_the_rankers_epochs_in_config_json(tmp_path):
    from tworec.pipeline import config
    error = resolved("train_retrieval.py", "--data", "synthetic:tiny", "--preset", "tiny",
                     "--epochs", "7", "--out", str(tmp_path / "run"),
                     shown="(checked.configs.retrieval.epochs, checked.configs.ranking.epochs)")
    assert f"resolved (7, {config.resolve('tiny').ranking.epochs})" in error, error


@pytest.mark.parametrize("script", ["pipeline.py", "train_retrieval.py", "train_ranking.py"])
def test_members_reach_the_retrieval_config(tmp_path, script):
    error = resolved(script, "--data", "synthetic:tiny", "--members", "2", "--out",
                     str(tmp_path / "run"), shown="checked.configs.retrieval.members")
    assert "resolved 2" in error, error


@pytest.mark.parametrize("field, held_out", [("popularity_periods", "held_out_periods"),
                                             ("title_neighbors", "held_out_title_neighbors"),
                                             ("title_candidates", "added_title_candidates")])
def test_held_out_signals_given_to_a_regression_ranker_are_refused(field, held_out):
    """Popularity periods, title neighbours or title candidates given with a regression
    ranker, which reads none, are refused, also when the task comes from a run folder's
    configs; 0, or leaving them out, is fine."""
    from tworec.pipeline import config
    regression = config.resolve("tiny", ranking={"task": "regression"})
    assert getattr(regression.ranking, held_out) == 0
    for given in ({"task": "regression", field: 0}, {"epochs": 1}, {}):
        config.resolve(base=regression, ranking=given)
    assert getattr(config.resolve(base=regression, ranking={"task": "listwise", field: 5}
                                  ).ranking, held_out) == 5
    for base, given in ((None, {"task": "regression", field: 5}),
                        (regression, {field: 5})):                  # the folder's task
        with pytest.raises(ValueError, match=f"{field} 5: the ranker's task is regr"):
            config.resolve("tiny", base=base, ranking=given)
    with pytest.raises(ValueError, match="must be >= 0"):
        config.resolve(base=regression, ranking={field: -1}).validate()


def test_a_folder_without_its_cold_start_window_is_not_continued(tmp_path):
    """A run folder that does not record what users never seen were served (older runs) would
    re-choose it while the retrieval export serves the old list: refused in one line."""
    from tworec.pipeline import config, folder
    configs = config.resolve("tiny")
    config.write(str(tmp_path / "config.json"), configs, {"data": "synthetic:tiny"})
    with pytest.raises(folder.RunFolderError, match="made before runs recorded what users"):
        folder.check_run(str(tmp_path), {"data": "synthetic:tiny"}, configs, continue_run=True)


def test_the_served_check_fails_on_any_difference_but_a_float_tie():
    from tworec.pipeline import served
    lists = {"item_ids": np.array([["a", "b", "c"], ["d", "e", "f"]]),
             "scores": np.array([[3.0, 2.0, 1.0], [3.0, 2.0, 2.0]], np.float32)}
    targets = np.array(["b", "f"])
    agree = served.Offline(ranks=np.array([1, 2]), target_scores=np.array([2.0, 2.0]))
    result = served.compare("m", lists, agree, targets)
    assert result["recall@10"] == 1.0 and result["float_ties"] == 0
    absent = served.Offline(ranks=np.array([1, served.MISS]), target_scores=np.array([2.0, 0.0]))
    result = served.compare("m", lists, absent, np.array(["b", "z"]))      # z is not served
    assert result["recall@10"] == result["recall@100"] == 0.5
    tied = served.Offline(ranks=np.array([1, 1]), target_scores=np.array([2.0, 2.0]))
    assert served.compare("m", lists, tied, targets)["float_ties"] == 1   # f tied with e
    shifted = served.Offline(ranks=np.array([0, 2]), target_scores=np.array([2.0, 2.0]))
    with pytest.raises(served.ServedMismatch, match="m: 1 of 2 served lists rank"):
        served.compare("m", lists, shifted, targets)
    missed = served.Offline(ranks=np.array([1, 50]), target_scores=np.array([2.0, 0.5]))
    with pytest.raises(served.ServedMismatch):
        served.compare("m", lists, missed, targets)


@pytest.mark.parametrize("keep_seen", [False, True], ids=["seen-excluded", "seen-kept"])
def test_a_run_says_how_many_held_out_rows_repeat_an_item_their_user_had(tmp_path, keep_seen):
    """A log of repeats (three users x x x x, one y y y x): with seen items excluded every
    model misses a held-out row that repeats, and the run says how many there are, before it
    trains; with seen items kept it says nothing."""
    from tworec.pipeline import prepare_run, resolve
    rows = [f"u{user},{'x' if user or at == 3 else 'y'},{10 * user + at}"
            for user in range(4) for at in range(4)]
    (tmp_path / "log.csv").write_text("\n".join(["user_id,item_id,timestamp", *rows]) + "\n")
    run = prepare_run(str(tmp_path / "run"), {"data": str(tmp_path / "log.csv")},
                      resolve("tiny", data={"exclude_seen": not keep_seen}), verbose=0)
    repeats = [notice for notice in run.report["notices"] if "known rows" in notice]
    assert repeats == ([] if keep_seen else [
        f"{count} of 4 {part} rows ({count / 4:.1%}) hold an item already among their user's "
        "known rows: seen items are excluded, as served, so every model misses them; a run "
        "with --keep-seen serves and ranks the items users have"
        for count, part in ((4, "validation"), (3, "test"))])


def test_a_run_says_how_many_held_out_rows_hold_an_item_outside_the_catalogue(tmp_path):
    """u0 a b c | d | n, u1 a b c | n | d, u2 and u3 a b d | c | e (train | validation |
    test): n is no training row's item, so u1's validation row is outside validation's
    catalogue, but in the fit rows u0's test row's; e, in test rows alone, is outside the
    exports' catalogue. The run says so before it trains, and counts n as served untrained."""
    from tworec.pipeline import prepare_run, resolve
    rows = [f"u{user},{item},{10 * user + at}"
            for user, items in enumerate(["abcdn", "abcnd", "abdce", "abdce"])
            for at, item in enumerate(items)]
    (tmp_path / "log.csv").write_text("\n".join(["user_id,item_id,timestamp", *rows]) + "\n")
    run = prepare_run(str(tmp_path / "run"), {"data": str(tmp_path / "log.csv")},
                      resolve("tiny"), verbose=0)
    outside = [notice for notice in run.report["notices"] if "no earlier part has" in notice]
    assert outside == [
        "1 of 4 validation rows (25.0%) hold an item no earlier part has (first seen there): "
        "validation ranks the training rows' items alone (retrieval's early stopping, the "
        "cold-start choice, the lists calibration refits on), so none ranks them",
        "2 of 4 test rows (50.0%) hold an item no earlier part has (first seen there): they are "
        "outside the catalogue the exports serve, so every model and baseline misses them"]
    data = run.report["data"]
    assert (data["outside_catalogue"], data["untrained_items"], data["state"]["items"]) == (1, 1, 5)
    assert ("candidates (--top-k) 100 lowered to the catalogue size, 5 (the items the exports "
            "know)") in run.report["notices"]


def test_seen_items_served_are_counted():
    import scipy.sparse as sp
    from tworec.pipeline import served
    catalogue = np.array(["x", "y", "z", "w"])
    seen = sp.csr_matrix(np.array([[1, 0, 0, 0], [0, 0, 1, 1]], np.float32))
    assert served.seen_served(np.array([["y", "z"], ["x", ""]]), catalogue, seen) == 0
    assert served.seen_served(np.array([["x", "z"], ["w", "z"]]), catalogue, seen) == 3
    # Users who have seen every item are served empty lists: nothing of theirs is counted.
    assert served.seen_served(np.array([["", ""], ["", ""]]), catalogue, seen) == 0


def test_items_served_outside_the_catalogue_are_counted():
    """w has no fit rows (outside the catalogue); an id the catalogue lacks counts too; an
    empty slot does not."""
    from tworec.pipeline import served
    ids, catalogue = np.array(["x", "y", "z", "w"]), np.array([True, True, True, False])
    assert served.outside_served(np.array([["y", "z"], ["x", ""]]), ids, catalogue) == 0
    assert served.outside_served(np.array([["w", "z"], ["v", "w"]]), ids, catalogue) == 3


def test_an_approximate_index_is_scored_as_served_and_against_the_exact_lists():
    from tworec.pipeline import served
    exact = np.array([["a", "b", "c"], ["d", "e", ""]])
    approximate = np.array([["b", "x", "a"], ["e", "y", "d"]])
    assert served.shared_share(approximate, exact) == 4 / 5      # of the exact lists' 5 items
    figures = served.scored({"item_ids": approximate}, np.array(["a", "z"]))
    assert figures["recall@10"] == 0.5 and figures["rows"] == 2
    assert figures["ndcg@10"] == pytest.approx(0.5 / np.log2(2 + 2))        # a at rank 2


@pytest.fixture(scope="module")
def global_run(tmp_path_factory):
    """A tiny `global` run through ranking (no export), with the sizes of the ScaNN tuning
    sample and of the test queries its recall is measured on."""
    from tworec.pipeline import execute, prepare_run, resolve
    from tworec.pipeline import run as run_module
    sampled, tested = [], []
    tune, exact = run_module.tune_scann, run_module.exact_top_k
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_module, "tune_scann", lambda candidates, sample, **kwargs: (
            sampled.append(len(sample)) or tune(candidates, sample, **kwargs)))
        patch.setattr(run_module, "exact_top_k", lambda candidates, queries, k: (
            tested.append(len(queries)) or exact(candidates, queries, k)))
        run = prepare_run(str(tmp_path_factory.mktemp("global") / "run"),
                          {"data": "synthetic:tiny"}, resolve("tiny", data={"split": "global"}),
                          verbose=0)
        execute(run, ("train retrieval", "tune index", "train ranking"))
    return run, sampled, tested


def test_scann_is_tuned_and_tested_on_the_queries_the_export_searches(global_run):
    """Under `global` most held-out users have no rows before their part: the exports serve
    them the popular list without searching, and their queries (the unknown user's, alike
    when histories are) would flatter ScaNN's recall. The tuning sample and the test recall
    hold the queries of the users known before each part alone."""
    run, sampled, tested = global_run
    known = {part: run.inputs.known_in(part) for part in ("validation", "test")}
    assert all(0 < rows.sum() < min(len(rows), 200) for rows in known.values())
    assert sampled == [known["validation"].sum()] and tested == [known["test"].sum()]
    assert run.report["index"]["tuned_on"] == "validation"


def test_both_stages_rank_a_users_popular_list_alike(global_run):
    """Users the models do not know get the popular list from both stages, a strict order
    whose scores (the items' shares) tie: the two stages rank it alike (the gain pairs them),
    where counting those ties against the target would lower the two-stage figures alone."""
    from tworec.evaluation import MISS
    from tworec.ranking import train as ranking
    run, _, _ = global_run
    unknown, top_n = ~run.inputs.known_in("test"), run.configs.run.top_n
    retrieval, two_stage = (run.offline(name).ranks[unknown]
                            for name in ("retrieval", "recommender"))
    assert unknown.sum() > 100 and (two_stage < top_n).sum() > 10
    assert np.array_equal(two_stage, np.where(retrieval < top_n, retrieval, MISS))
    scores = ranking.score_lists(run.ranking_model, run.inputs, run.signals, "test",
                                 run.test_candidates)
    ties_against, _ = ranking.reranked_ranks(scores, run.test_candidates,
                                             run.inputs.examples["test"]["item"])
    assert (ties_against[unknown] > two_stage).any()          # the shares do tie there


def test_a_run_whose_users_each_train_on_one_row_serves_the_keras_ranker(tmp_path, monkeypatch):
    """Every user's training holds one row (of three: one validates, one tests), so no item
    follows another there: the ranking export's transition table has no entry, and still
    loads and serves the Keras scores (`--split latest` of two-row users builds the same empty
    tables).
    Fewer items have training rows than the hard-negative pool asks for, and some are first
    seen in test rows: outside the catalogue, never served (the served check asks about the
    catalogue, and fails on an item it is told was served)."""
    from tworec.pipeline import PIPELINE, execute, prepare_run, resolve, served
    rng = np.random.default_rng(0)
    rows = [f"u{user},i{rng.integers(30)},{100 * user + at}"
            for user in range(40) for at in range(3)]
    (tmp_path / "log.csv").write_text("\n".join(["user_id,item_id,timestamp", *rows]) + "\n")
    run = prepare_run(str(tmp_path / "run"), {"data": str(tmp_path / "log.csv")},
                      resolve("tiny", data={"split": "temporal"}), verbose=0)
    assert len(run.parts.train) == 40 and not run.signals
    report = execute(run, PIPELINE)
    assert run.signals.transitions.nnz == 0
    assert report["serving"]["ranking_export_max_abs_diff"] < 1e-4
    assert report["data"]["outside_catalogue"] > 0
    asked, outside_served = [], served.outside_served

    def two_more(item_ids, catalogue_ids, catalogue):
        asked.append(catalogue)
        return outside_served(item_ids, catalogue_ids, catalogue) + 2
    monkeypatch.setattr(served, "outside_served", two_more)
    with pytest.raises(served.ServedMismatch, match="retrieval: 2 served items are outside"):
        run.serve_and_check()
    assert np.array_equal(asked[0], run.inputs.catalogue)


@pytest.mark.parametrize("protocol", ["latest", "none"])
def test_a_run_without_test_rows_checks_the_ranking_export_on_each_users_latest_state(
        tmp_path, monkeypatch, protocol):
    """`--split latest` (each user's last row validates) and `none` (every row trains): nothing
    is tested and the exports know every row. The served check asks for the users they know
    (no metric, no seen item served) and compares the ranking export on each one's latest
    state and the list the retrieval export served them: its scores against the Keras
    ranker's, the title candidates it adds against NumPy's. After `latest` (the comparisons
    are the same for `none`, checked once): other title candidates, a Keras side that reads
    other retrieval queries, `with_history` requests of other histories than the exports know,
    or another popularity period (`latest` calibrated the ranker; without validation rows,
    `none` leaves the held-out signals at weight 0) fail the run."""
    import dataclasses
    from tworec.features.inputs import EMPTY_SLOT
    from tworec.pipeline import PIPELINE, execute, prepare_run, resolve
    from tworec.pipeline import run as run_module
    from tworec.pipeline.served import ServedMismatch
    run = prepare_run(str(tmp_path / "run"), {"data": release_with_series(tmp_path)},
                      resolve("tiny", data={"split": protocol}, run={"candidates": 20}),
                      verbose=0)
    report = execute(run, PIPELINE)
    serving = report["serving"]
    assert report["data"]["state"]["rows"] == report["data"]["interactions"]
    assert serving["rows"] == 0 and serving["users"] == report["data"]["users"]
    assert serving["ranking_export_max_abs_diff"] < 1e-4
    assert serving["served"]["recommender"]["title_candidate_share"] > 0
    for figures in serving["served"].values():
        assert figures["seen_items_served"] == 0 and "recall@10" not in figures
    text = (tmp_path / "run" / "report.md").read_text()
    assert "The ranking export's scores differ from the Keras ranker's by at most" in text
    assert "## Test Recall@10" not in text
    held_out = "nothing tested" if protocol == "latest" else "nothing held out"
    assert f"split `{protocol}`, {held_out};" in text
    calibration = report["ranking"]["train"].get("calibration")
    assert (calibration is not None) == (protocol == "latest")
    if protocol == "none":       # the served check compares alike under both: checked once
        return

    from tworec.serving.manager import ModelManager, parse_config
    from tworec.serving.server import ModelServer
    with open(run.export_dir("models_scann.config")) as f:     # one server for every mutant
        server = ModelServer(ModelManager(parse_config(f.read()), poll_seconds=0),
                             grpc_port=0, rest_port=0).start()
    try:
        check = functools.partial(run.check_served, f"http://127.0.0.1:{server.rest_port}",
                                  f"127.0.0.1:{server.grpc_port}")
        check()                                                      # as it is: it passes
        adds = run_module.ranking_features.with_title_candidates

        def one_fewer(*args):                     # the last title candidate added, dropped
            lists = adds(*args)
            row, slot = np.argwhere(lists[:, 20:] >= 0)[-1]
            lists[row, 20 + slot] = EMPTY_SLOT
            return lists
        monkeypatch.setattr(run_module.ranking_features, "with_title_candidates", one_fewer)
        with pytest.raises(ServedMismatch, match="candidates signature adds other title cand"):
            check()
        monkeypatch.undo()
        latest = run.signals.retrieval_latest        # the Keras side reads a stale query
        run.signals = dataclasses.replace(run.signals, retrieval_latest=latest[::-1].copy())
        with pytest.raises(ServedMismatch, match="scores differ from the Keras ranker's"):
            check()
        run.signals = dataclasses.replace(run.signals, retrieval_latest=latest)
        assert min(abs(calibration["weights"][name]) for name in
                   ("recent_popularity", "user_time_popularity", "title_similarity")) > 0
        periods = run.signals.popularity.user_period
        right = periods["test"]
        periods["test"] = np.where(right > 0, 0, run.configs.ranking.held_out_periods - 1)
        with pytest.raises(ServedMismatch, match="scores differ from the Keras ranker's"):
            check()
        periods["test"] = right
        fit_history = run.fit_history           # each user's own items, in the reverse order
        monkeypatch.setattr(run, "fit_history", lambda users: fit_history(users)[:, ::-1])
        with pytest.raises(ServedMismatch, match="with_history, given each user's latest ite"):
            check()
        monkeypatch.undo()
        check()                                               # each put back: it passes again
    finally:
        server.stop()
