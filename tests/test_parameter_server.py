"""ParameterServerStrategy: a chief, two ps and two worker processes on this machine
(TF_CONFIG) train the two-tower model with its embedding tables split across the ps tasks; it
matches one device, and its export is an ordinary SavedModel."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from test_retrieval_distributed import ROOT, free_ports, result_of
from tworec.features import generate, split
from tworec.features.inputs import prepare
from tworec.features.prepare import prepare_shards
from tworec.features.stream import PreparedLog
from tworec.features.synthetic import PRESETS
from tworec.features.training import make_strategy, variable_partitioner, worker_seed
from tworec.retrieval.config import preset
from tworec.retrieval.train import evaluate_model, evaluate_prepared, fit, fit_prepared

EPOCHS = 3
# 8 KiB shards: the user (202 x 16 float32) and item (152 x 16) tables split in two, the dense
# layers (at most 48 x 32) stay whole.
PARTITIONER = "min_size:8192"

CHIEF = """
import json, sys
import numpy as np
from tworec.features import generate, split
from tworec.features.inputs import prepare
from tworec.features.synthetic import PRESETS
from tworec.retrieval.config import preset
from tworec.retrieval.export import export
from tworec.retrieval.train import candidate_embeddings, evaluate_model, fit, latest_queries
log = generate(PRESETS["tiny"], seed=0)
data = prepare(log, split(log), history_length=5)
model, summary = fit(data, preset("tiny", epochs=%(epochs)d, strategy="parameter_server",
                                  partitioner="%(partitioner)s"), run_dir=sys.argv[1], verbose=0)

def placement(variable):
    parts = getattr(variable, "variables", [variable])
    return {"type": type(variable).__name__, "devices": [part.device for part in parts]}

scores = latest_queries(model, data) @ candidate_embeddings(model, data.num_items).T
scores[data.seen.toarray() > 0] = -np.inf
users = np.flatnonzero(data.known)
top = np.argsort(-scores[users], axis=1, kind="stable")[:, :10]
print("RESULT", json.dumps({
    "user_table": placement(model.user_embedding.embeddings),
    "item_table": placement(model.item_features.id_embedding.embeddings),
    "dense_kernel": placement(model.query_head.layers[0].kernel),
    "history": summary["history"],
    "metrics": evaluate_model(model, data, "test", ks=(10, 50)),
    "export": export(model, data, sys.argv[1] + "/export/retrieval", k=10),
    "users": log.user_ids[users].tolist(),
    "keras_top10": log.item_ids[top].tolist()}))
"""


# The same cluster trained from a prepared log: every worker streams the TFRecord blocks itself.
CHIEF_PREPARED = """
import json, sys
from tworec.features.stream import PreparedLog
from tworec.retrieval.config import preset
from tworec.retrieval.train import evaluate_prepared, fit_prepared
prepared = PreparedLog.load(sys.argv[2])
model, summary = fit_prepared(prepared, preset("tiny", epochs=%(epochs)d, batch_size=64,
                                               optimizer="lazy_adam",
                                               strategy="parameter_server",
                                               partitioner="%(partitioner)s"),
                              steps_per_epoch=%(steps)d, run_dir=sys.argv[1], verbose=0)
print("RESULT", json.dumps({
    "user_table_shards": len(model.user_embedding.embeddings.variables),
    "history": summary["history"],
    "metrics": evaluate_prepared(model, prepared, "test", ks=(10, 50))}))
"""
PREPARED_STEPS = 120


def start(task: str, index: int, cluster: dict, argv: list[str], log_path: str):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps(
        {"cluster": cluster, "task": {"type": task, "index": index}}))
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, text=True)


def tail(path: str, chars: int = 2000) -> str:
    with open(path) as f:
        return f.read()[-chars:]


def run_cluster(out, code: str, *argv: str) -> dict:
    """The chief's RESULT from one chief, two ps and two workers running on this machine."""
    ports = [f"localhost:{port}" for port in free_ports(5)]
    cluster = {"chief": ports[:1], "ps": ports[1:3], "worker": ports[3:]}
    tasks = [("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]
    processes, logs = [], [str(out / f"{task}{index}.log") for task, index in tasks]
    try:
        for (task, index), log in zip(tasks, logs):
            processes.append(start(task, index, cluster, ["-m", "tworec.features.training"], log))
        chief_log = str(out / "chief.log")
        chief = start("chief", 0, cluster, ["-c", code, *argv], chief_log)
        processes.append(chief)
        chief.wait(timeout=150)
        assert all(p.poll() is None for p in processes[:-1]), \
            "a ps or worker task stopped: " + "".join(tail(log) for log in logs)
        assert chief.returncode == 0, tail(chief_log, 4000)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return result_of(open(chief_log).read())


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    """The chief's RESULT and its run folder, training on the tiny log in memory."""
    out = tmp_path_factory.mktemp("ps_run")
    code = CHIEF % {"epochs": EPOCHS, "partitioner": PARTITIONER}
    return run_cluster(out, code, str(out / "run")), out / "run"


@pytest.fixture(scope="module")
def prepared_log(tmp_path_factory):
    """The tiny log written as Parquet and prepared into shards and training blocks."""
    from test_prepare import _log_table
    root = tmp_path_factory.mktemp("ps_prepared")
    pq.write_table(_log_table(), root / "log.parquet")
    prepare_shards(str(root / "log.parquet"), str(root / "prepared"), history_length=5,
                   rows_per_shard=1000, block_rows=100)
    return PreparedLog.load(str(root / "prepared"))


@pytest.fixture(scope="module")
def one_device():
    log = generate(PRESETS["tiny"], seed=0)
    data = prepare(log, split(log), history_length=5)
    model, _ = fit(data, preset("tiny", epochs=EPOCHS), verbose=0)
    return evaluate_model(model, data, "test", ks=(10, 50))


def test_embedding_tables_are_split_across_the_two_ps_tasks(cluster_run):
    result, _ = cluster_run
    for table in ("user_table", "item_table"):
        assert result[table]["type"] == "ShardedVariable", result[table]
        assert [device.split("/device")[0] for device in result[table]["devices"]] == \
            ["/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"], result[table]
    assert result["dense_kernel"]["type"] != "ShardedVariable"          # under 8 KiB: whole
    assert result["dense_kernel"]["devices"][0].startswith("/job:ps/")


def test_parameter_server_training_matches_one_device(cluster_run, one_device):
    result, run_dir = cluster_run
    assert len(result["history"]["val_recall@10"]) == EPOCHS      # the chief's callback ran
    assert_near(result["metrics"], one_device)
    assert json.loads((run_dir / "retrieval_config.json").read_text())["partitioner"] == PARTITIONER


def test_export_of_sharded_tables_loads_without_the_cluster(cluster_run):
    """The export answers as the Keras model did, through `tf.saved_model.load` and through
    the server's loader, in this process, which has no cluster."""
    from tworec.serving.model import LoadedModel
    result, _ = cluster_run
    users = np.array(result["users"])
    loaded = tf.saved_model.load(result["export"])
    answer = loaded.signatures["serving_default"](user_id=tf.constant(users))
    assert answer["item_ids"].numpy().astype(str).tolist() == result["keras_top10"]
    served = LoadedModel(result["export"])
    try:
        assert served.run({"user_id": users})["item_ids"].astype(str).tolist() == \
            result["keras_top10"]
    finally:
        served.close()


def test_workers_stream_a_prepared_log_into_sharded_tables(prepared_log, tmp_path):
    """Trained from the TFRecord blocks that each worker reads itself (each its own shuffle),
    with `lazy_adam` (the optimizer of large tables: its sparse updates reach the table
    shards), the sharded model learns, and scores within tolerance of one device trained on
    the same prepared log for the same steps."""
    code = CHIEF_PREPARED % {"epochs": 2, "partitioner": PARTITIONER, "steps": PREPARED_STEPS}
    result = run_cluster(tmp_path, code, str(tmp_path / "run"), prepared_log.folder)
    assert result["user_table_shards"] == 2
    losses = result["history"]["loss"]
    assert len(losses) == 2 and losses[1] < losses[0]
    model, _ = fit_prepared(prepared_log, preset("tiny", epochs=2, batch_size=64,
                                                 optimizer="lazy_adam"),
                            steps_per_epoch=PREPARED_STEPS, verbose=0)
    one_device = evaluate_prepared(model, prepared_log, "test", ks=(10, 50))
    # one device reaches recall@10 0.43 (one step: 0.105); with the shards' sparse updates
    # dropped, the cluster reached 0.17
    assert_near(result["metrics"], one_device)


def assert_near(cluster: dict, one_device: dict) -> None:
    """The cluster's recall@10 and @50 are at most 0.15 below one device's and at most 0.2
    above: two asynchronous workers land on either side of one device (recall@10 0.54
    against 0.43 and 0.42 against 0.52 seen in CI, on 200 test rows; eight quiet runs of each
    gave 0.445 to 0.505 against 0.52 and 0.41 to 0.48 against 0.43). Dropped sparse updates
    of the shards fall further: 0.17 against 0.43."""
    for metric in ("recall@10", "recall@50"):
        assert one_device[metric] - 0.15 < cluster[metric] < one_device[metric] + 0.2, \
            (one_device, cluster)


@pytest.mark.parametrize("spec", ["min_size:0", "fixed", "fixed:0", "round_robin", "min_size:1k"])
def test_a_partitioner_that_cannot_work_fails_before_training(spec):
    with pytest.raises(ValueError, match=f"partitioner '{spec}': use min_size"):
        preset("tiny", strategy="parameter_server", partitioner=spec).validate()
    with pytest.raises(ValueError, match=f"partitioner '{spec}': use min_size"):
        variable_partitioner(spec, num_ps=2)


def test_partitioners_split_the_first_axis_as_named():
    shape = tf.TensorShape([1000, 16])                               # 64,000 bytes of float32
    assert variable_partitioner("min_size", 2)(shape, tf.float32) == [1, 1]     # under 256 KiB
    assert variable_partitioner("min_size:8192", 4)(shape, tf.float32) == [4, 1]
    assert variable_partitioner("min_size:8192", 2)(shape, tf.float32) == [2, 1]
    assert variable_partitioner("fixed:3", 2)(shape, tf.float32) == [3, 1]


def test_the_parameter_server_strategy_runs_only_on_a_chief(monkeypatch):
    cluster = {"chief": ["localhost:1"], "ps": ["localhost:2"], "worker": ["localhost:3"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster,
                                                "task": {"type": "worker", "index": 0}}))
    with pytest.raises(ValueError, match="runs on the chief"):
        make_strategy("parameter_server")


def test_workers_running_the_same_dataset_function_draw_different_seeds():
    """Every worker runs the one traced dataset function; a seed from the global seed would
    repeat on each (so would their batches), `worker_seed` does not."""
    def first_draw(draw):
        tf.keras.utils.set_random_seed(0)
        return int(tf.function(draw)())
    seeded = lambda: tf.random.uniform([], maxval=2**62, dtype=tf.int64)   # noqa: E731
    assert first_draw(seeded) == first_draw(seeded)
    assert first_draw(worker_seed) != first_draw(worker_seed)


def test_ctrl_c_stops_a_ps_task():
    """Ctrl-C (SIGINT) ends a ps or worker task with 130; blocked in the server's join, it
    went unnoticed."""
    port = free_ports(1)[0]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps(
        {"cluster": {"chief": ["localhost:1"], "ps": [f"localhost:{port}"]},
         "task": {"type": "ps", "index": 0}}))
    as_in_a_terminal = ("import runpy, signal; "     # a background job's children ignore it
                        "signal.signal(signal.SIGINT, signal.default_int_handler); "
                        "runpy.run_module('tworec.features.training', run_name='__main__')")
    task = subprocess.Popen([sys.executable, "-c", as_in_a_terminal], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert task.stdout.readline().startswith("serving /job:ps/task:0 at ")
        task.send_signal(signal.SIGINT)                  # at once, as the line is read
        assert task.wait(timeout=30) == 130
    finally:
        task.kill()
        task.wait()
        task.stdout.close()
