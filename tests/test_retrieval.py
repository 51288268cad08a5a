"""The retrieval stage: config checks, training that learns, exact indexes, exports."""
import os

import numpy as np
import pytest
import scipy.sparse as sp
import tensorflow as tf

from tworec.features import generate, split
from tworec.features.evaluation import baselines, eval_set
from tworec.features.synthetic import PRESETS
from tworec.retrieval.config import preset
from tworec.retrieval.index import ScannParams, build_index, exact_top_k, search, tune_scann
from tworec.retrieval.model import right_align
from tworec.retrieval.train import candidate_embeddings, evaluate_model, fit, query_embeddings


@pytest.fixture(scope="module")
def trained():
    log = generate(PRESETS["tiny"], seed=0)
    parts = split(log, "temporal")
    model, data, summary = fit(log, parts, preset("tiny", epochs=4), verbose=0)
    return log, parts, model, data, summary


@pytest.mark.parametrize("overrides, message", [
    ({"history_encoder": "lstm"}, "history_encoder 'lstm'"),
    ({"history_length": 0}, "needs history_length > 0"),
    ({"strategy": "tpu"}, "strategy 'tpu'"),
    ({"k": 10_000}, "larger than the catalogue"),
])
def test_settings_that_cannot_work_fail_before_training(overrides, message):
    log = generate(PRESETS["tiny"], seed=0)
    with pytest.raises(ValueError, match=message):
        fit(log, split(log), preset("tiny", **overrides), verbose=0)
    with pytest.raises(ValueError, match="unknown retrieval preset"):
        preset("huge")


def test_right_align_moves_padding_to_the_end():
    history = tf.constant([[0, 0, 5, 6], [1, 2, 3, 4], [0, 0, 0, 0]], tf.int64)
    assert right_align(history).numpy().tolist() == [[5, 6, 0, 0], [1, 2, 3, 4], [0, 0, 0, 0]]


def test_training_learns_the_planted_structure(trained):
    log, parts, model, data, summary = trained
    metrics = evaluate_model(model, data, "test")
    popularity = baselines(log, parts, eval_set(log, parts, "test"))["popularity"]
    assert summary["epochs"] == 4 and summary["examples_per_second"] > 0
    assert metrics["recall@10"] > 1.5 * popularity["recall@10"], (metrics, popularity)
    assert summary["history"]["loss"][-1] < summary["history"]["loss"][0]


@pytest.mark.parametrize("encoder", ["none", "mean", "transformer"])
def test_every_history_encoder_trains(encoder):
    log = generate(PRESETS["tiny"], seed=1)
    model, data, summary = fit(log, split(log), preset("tiny", epochs=1, history_encoder=encoder),
                               verbose=0)
    assert np.isfinite(summary["history"]["loss"]).all()
    assert query_embeddings(model, data.examples["test"]).shape == (len(data.examples["test"]["user"]), 16)


def test_mixed_precision_and_jit_compile_run_on_cpu():
    log = generate(PRESETS["tiny"], seed=2)
    model, data, summary = fit(log, split(log), preset("tiny", epochs=1, mixed_precision=True,
                                                       jit_compile=True), verbose=0)
    assert np.isfinite(summary["history"]["loss"]).all()
    assert tf.keras.mixed_precision.global_policy().name == "float32"
    assert query_embeddings(model, data.examples["test"]).dtype == np.float32


def test_random_protocol_reports_factorized_top_k():
    log = generate(PRESETS["tiny"], seed=2)
    model, data, _ = fit(log, split(log, "random"), preset("tiny", epochs=1), verbose=0)
    metrics = evaluate_model(model, data, "test")
    assert metrics["factorized_top_100_accuracy"] == metrics["recall@100"]
    assert 0 < metrics["factorized_top_10_accuracy"] <= metrics["factorized_top_100_accuracy"]


def test_brute_force_and_exact_scann_match_argsort(trained):
    _, _, model, data, _ = trained
    candidates = candidate_embeddings(model, data.num_items)
    queries = query_embeddings(model, data.examples["test"])[:32]
    exact = exact_top_k(candidates, queries, 10)
    _, brute = search(build_index(candidates, 10), queries, 10)
    assert np.array_equal(brute, exact)
    params = ScannParams(num_leaves=4, num_leaves_to_search=4,
                         num_reordering_candidates=data.num_items)
    assert params.exact_for(data.num_items)
    _, scann = search(build_index(candidates, 10, params), queries, 10)
    assert np.array_equal(scann, exact)


def test_search_excludes_seen_items(trained):
    _, _, model, data, _ = trained
    candidates = candidate_embeddings(model, data.num_items)
    queries = query_embeddings(model, data.examples["test"])[:8]
    exact = exact_top_k(candidates, queries, 15)
    exclude = sp.csr_matrix((np.ones(16), (np.repeat(np.arange(8), 2), exact[:, :2].ravel())),
                            shape=(8, data.num_items))
    _, codes = search(build_index(candidates, 15), queries, 10, exclude=exclude)
    assert np.array_equal(codes, exact[:, 2:12])


def test_scann_tuning_meets_the_target(trained):
    _, _, model, data, _ = trained
    candidates = candidate_embeddings(model, data.num_items)
    queries = query_embeddings(model, data.examples["test"])[:50]
    result = tune_scann(candidates, queries, k=10, target_recall=0.9, repeats=5)
    assert len(result["table"]) == 27 and result["params"] is not None
    assert result["recall@10_vs_exact"] >= 0.9
    best = [r for r in result["table"] if r["recall"] >= 0.9]
    assert result["latency_ms_p50"] == min(r["latency_ms_p50"] for r in best)


# ------------------------------------------------------------------ exports


def load_like_tf_serving(path: str):
    """Loads a SavedModel the way TF Serving does: tag `serve` into a v1 session; returns a
    function running a signature by its tensor names."""
    graph = tf.Graph()
    session = tf.compat.v1.Session(graph=graph)
    with graph.as_default():
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], path)

    def run(signature: str, **inputs):
        sig = meta.signature_def[signature]
        feeds = {sig.inputs[name].name: value for name, value in inputs.items()}
        names = sorted(sig.outputs)
        values = session.run([sig.outputs[n].name for n in names], feed_dict=feeds)
        return dict(zip(names, values))
    return run, meta


def graph_op_types(meta) -> set:
    ops = {node.op for node in meta.graph_def.node}
    for function in meta.graph_def.library.function:
        ops |= {node.op for node in function.node_def}
    return ops


def test_brute_force_export_serves_the_keras_top_k(trained, tmp_path):
    from tworec.retrieval.export import export
    from tensorflow.python.framework import op_def_registry
    log, _, model, data, _ = trained
    path = export(model, data, str(tmp_path / "retrieval"), k=10)
    assert os.path.basename(path) == "1"
    run, meta = load_like_tf_serving(path)
    assert set(meta.signature_def) >= {"serving_default", "with_history", "embed_user", "embed_items"}
    users = log.user_ids[:5]
    served = run("serving_default", user_id=users)
    features = {"user": data.users.remap(log.user_ids)[:5], "history": data.latest[:5]}
    for name, index in data.user_feature_index.items():
        features[f"user_{name}"] = index[:5]
    queries = model.query({k: tf.constant(v) for k, v in features.items()}).numpy()
    exact = exact_top_k(candidate_embeddings(model, data.num_items), queries, 10)
    assert served["item_ids"].astype(str).tolist() == log.item_ids[exact].tolist()
    assert served["scores"].shape == (5, 10) and served["scores"].dtype == np.float32
    unknown = run("serving_default", user_id=np.array(["nobody"]))
    popular = np.argsort(-data.item_probability, kind="stable")[:10]
    assert unknown["item_ids"].astype(str).tolist() == [log.item_ids[popular].tolist()]
    ops = graph_op_types(meta)
    assert not [op for op in ops if op.startswith("Scann")]
    assert all(op_def_registry.get(op) is not None for op in ops)
    given = run("with_history", user_id=users, history=_history_strings(data, 5))
    assert np.array_equal(given["item_ids"], served["item_ids"])
    embedded = run("embed_items", item_ids=log.item_ids[:3])["embedding"]
    np.testing.assert_allclose(embedded, candidate_embeddings(model, data.num_items)[:3], atol=1e-5)


def _history_strings(data, users: int) -> np.ndarray:
    """[users, L] item id strings of the first users' latest histories, '' for padding."""
    return data.items.decode(data.latest[:users]).astype(object)


def test_scann_export_loads_and_answers(trained, tmp_path):
    from tworec.retrieval.export import export
    log, _, model, data, _ = trained
    params = ScannParams(4, 4, data.num_items)
    path = export(model, data, str(tmp_path / "retrieval_scann"), k=10, scann=params)
    run, meta = load_like_tf_serving(path)
    assert any(op.startswith("Scann") for op in graph_op_types(meta))
    brute = export(model, data, str(tmp_path / "retrieval"), k=10)
    brute_run, _ = load_like_tf_serving(brute)
    users = log.user_ids[:4]
    assert np.array_equal(run("serving_default", user_id=users)["item_ids"],
                          brute_run("serving_default", user_id=users)["item_ids"])


def test_train_retrieval_script_writes_report_and_exports(tmp_path):
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, os.path.join(root, "scripts", "train_retrieval.py"),
                           "--data", "synthetic:tiny", "--preset", "tiny", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.load(open(tmp_path / "retrieval_report.json"))
    assert report["test"]["recall@10"] > report["baselines"]["popularity"]["recall@10"]
    assert report["train"]["loss"]["logq_correction"] is True
    assert os.path.isdir(report["exports"]["retrieval"])
    assert (tmp_path / "retrieval_config.json").exists() and (tmp_path / "tensorboard").is_dir()
    bad = subprocess.run([sys.executable, os.path.join(root, "scripts", "train_retrieval.py"),
                          "--data", "synthetic:tiny", "--preset", "tiny", "--out", str(tmp_path),
                          "--history-encoder", "gru", "--epochs", "0"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "epochs must be positive" in bad.stderr
