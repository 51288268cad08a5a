"""Distributed training matches one device: MirroredStrategy on two logical CPU devices, and
MultiWorkerMirroredStrategy with two worker processes on this machine (TF_CONFIG)."""
import json
import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Both member counts in one process: the second mirrored model, of other shapes, must not meet
# the first one's collectives (each MirroredStrategy numbered them from the start again).
MIRRORED = """
import json, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from tworec.evaluation import baselines, eval_set
from tworec.features import generate, split
from tworec.features.inputs import prepare
from tworec.features.synthetic import PRESETS
from tworec.retrieval.config import preset
from tworec.retrieval.train import evaluate_model, fit
log = generate(PRESETS["tiny"], seed=0)
data = prepare(log, split(log), history_length=5)
results = {}
for members in (1, 2):
    for strategy in ("default", "mirrored"):
        model, _ = fit(data, preset("tiny", epochs=4, strategy=strategy, members=members),
                       verbose=0)
        results[f"{strategy}_{members}"] = evaluate_model(model, data, "test", ks=(10, 50))
        results[f"{strategy}_{members}_replicas"] = model.distribute_strategy.num_replicas_in_sync
results["popularity"] = baselines(log, split(log), eval_set(log, split(log), "test"))["popularity"]
print("RESULT", json.dumps(results))
"""

# The strategy must exist before any other TensorFlow op, so each worker trains only this run.
WORKER = """
import json, sys
from tworec.features import generate, split
from tworec.features.inputs import prepare
from tworec.features.synthetic import PRESETS
from tworec.retrieval.config import preset
from tworec.retrieval.train import evaluate_model, fit
log = generate(PRESETS["tiny"], seed=0)
data = prepare(log, split(log), history_length=5)
model, summary = fit(data, preset("tiny", epochs=4, strategy="multi_worker"),
                     run_dir=sys.argv[1], verbose=0)
print("RESULT", json.dumps({"metrics": evaluate_model(model, data, "test", ks=(10, 50)),
                            "replicas": model.distribute_strategy.num_replicas_in_sync,
                            "epochs": summary["epochs"]}))
"""


def result_of(stdout: str) -> dict:
    line = next(l for l in stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def one_device_and_mirrored() -> dict:
    done = subprocess.run([sys.executable, "-c", MIRRORED], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return result_of(done.stdout)


def test_mirrored_strategy_matches_one_device(one_device_and_mirrored):
    results = one_device_and_mirrored
    assert results["mirrored_1_replicas"] == 2
    for metric in ("recall@10", "recall@50"):
        assert abs(results["default_1"][metric] - results["mirrored_1"][metric]) < 0.1, results


def test_mirrored_strategy_trains_retrieval_members_as_one_device(one_device_and_mirrored):
    results = one_device_and_mirrored
    assert results["mirrored_2_replicas"] == 2
    assert results["mirrored_2"]["recall@10"] > 1.5 * results["popularity"]["recall@10"], results
    for metric in ("recall@10", "recall@50"):
        assert abs(results["default_2"][metric] - results["mirrored_2"][metric]) < 0.1, results


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_two_worker_processes_train_one_model_that_matches_one_device(one_device_and_mirrored,
                                                                      tmp_path):
    cluster = {"worker": [f"localhost:{port}" for port in free_ports(2)]}
    workers = []
    for index in range(2):
        env = dict(os.environ, TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}))
        workers.append(subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path / "run")],
                                        cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
    try:
        outputs = [worker.communicate(timeout=600) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
    for worker, (_, stderr) in zip(workers, outputs):
        assert worker.returncode == 0, stderr[-3000:]
    chief, other = (result_of(stdout) for stdout, _ in outputs)
    assert chief["replicas"] == 2 and chief["epochs"] == 4
    assert chief["metrics"] == other["metrics"]            # one model, kept in sync
    default = one_device_and_mirrored["default_1"]
    for metric in ("recall@10", "recall@50"):
        assert abs(default[metric] - chief["metrics"][metric]) < 0.1, (default, chief)
    assert (tmp_path / "run" / "retrieval_config.json").exists()
