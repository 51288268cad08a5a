"""End to end: the whole pipeline on the tiny synthetic preset."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = {
    "data": {"source", "users", "items", "interactions", "split", "test_users", "dropped"},
    "retrieval": {"test", "train"}, "index": {"kind", "params", "recall@10_vs_exact",
                                              "latency_ms_p50", "exact_latency_ms_p50"},
    "ranking": {"test", "train"}, "two_stage": {"test"},
    "baselines": {"popularity", "ease", "item_transition"},
    "serving": {"smoke_users", "matches_in_process"}, "exports": {"retrieval", "ranking", "recommender"},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "pipeline.py"),
                           "--data", "synthetic:tiny", "--preset", "tiny", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return out, json.load(open(out / "report.json"))


def test_report_follows_the_schema(run):
    _, report = run
    for section, keys in SCHEMA.items():
        assert keys <= set(report[section]), (section, set(report[section]))
    assert {"recall@10", "recall@50", "recall@100", "ndcg@10"} <= set(report["retrieval"]["test"])
    assert {"seconds", "epochs", "examples_per_second"} <= set(report["retrieval"]["train"])
    assert {"rmse", "auc"} <= set(report["ranking"]["test"])
    assert {"recall@10", "ndcg@10"} <= set(report["two_stage"]["test"])
    assert report["index"]["kind"] == "scann" and report["index"]["recall@10_vs_exact"] >= 0.95


def test_models_beat_popularity_on_the_planted_structure(run):
    _, report = run
    popularity = report["baselines"]["popularity"]["recall@10"]
    assert report["retrieval"]["test"]["recall@10"] > 1.5 * popularity
    assert report["two_stage"]["test"]["recall@10"] > 1.5 * popularity


def test_every_export_loads_and_answers(run):
    out, report = run
    assert report["serving"]["matches_in_process"] is True
    import tensorflow as tf
    import tworec.serving  # noqa: F401  (registers ScaNN's ops for retrieval_scann)
    from tworec.serving.model import register_custom_ops
    register_custom_ops()
    for name, path in report["exports"].items():
        assert os.path.basename(path) == "1", path
        model = tf.saved_model.load(path)
        signature = model.signatures["serving_default"]
        inputs = {"user_id": tf.constant(["u0", "nobody"])}
        if name == "ranking":
            inputs["item_ids"] = tf.constant([["i0", "i1"], ["i2", "zzz"]])
        outputs = signature(**inputs)
        assert np.isfinite(outputs["scores"].numpy()).all(), name
        assert os.path.exists(os.path.join(path, "assets.extra", "tf_serving_warmup_requests"))
    config = open(out / "export" / "models.config").read()
    assert all(f'name: "{name}"' in config for name in report["exports"])


def test_plots_and_human_report_exist(run):
    out, _ = run
    for plot in ("training.png", "recall_at_k.png", "index.png"):
        assert (out / "plots" / plot).stat().st_size > 5000
    text = (out / "report.md").read_text()
    assert "tensorflow_model_server" in text and "| popularity |" in text
    assert (out / "config.json").exists() and (out / "tensorboard").is_dir()


def test_train_ranking_script_on_the_random_protocol(tmp_path):
    """The TFRS tutorials' protocol: random 80/20 split, rating regression, RMSE reported."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_ranking.py"),
                           "--data", "synthetic:tiny", "--preset", "tiny", "--split", "random",
                           "--task", "regression", "--top-k", "20", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.load(open(tmp_path / "ranking_report.json"))
    assert 0 < report["ranking"]["test"]["rmse"] < 1.5 and report["ranking"]["test"]["auc"] is None
    assert os.path.isdir(report["exports"]["ranking"])
