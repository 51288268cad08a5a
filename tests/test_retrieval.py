"""The retrieval stage: config checks, training that learns, exact indexes, ties, exports."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp
import tensorflow as tf

from tworec.evaluation import baselines, eval_set
from tworec.evaluation.metrics import MISS, evaluate_ranks, target_ranks
from tworec.features import Interactions, generate, split
from tworec.features.inputs import prepare
from tworec.features.synthetic import PRESETS
from tworec.retrieval import index as index_module
from tworec.retrieval.config import preset
from tworec.retrieval.index import (SCANN_MIN_ITEMS, ScannParams, build_index, exact_scorer,
                                    exact_top_k, found_codes, tune_scann)
from tworec.retrieval.model import in_batch_softmax_loss, right_align
from tworec.retrieval.train import (candidate_embeddings, catalogue_scorer, evaluate_model, fit,
                                    query_embeddings, top_candidates)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(log, parts, config, history_length: int = 5):
    """(model, inputs, summary) of a retrieval model trained on `log` split into `parts`."""
    data = prepare(log, parts, history_length)
    model, summary = fit(data, config, verbose=0)
    return model, data, summary


@pytest.fixture(scope="module")
def trained():
    log = generate(PRESETS["tiny"], seed=0)
    parts = split(log, "temporal")
    model, data, summary = train(log, parts, preset("tiny", epochs=4))
    return log, parts, model, data, summary


@pytest.mark.parametrize("overrides, history_length, message", [
    ({"history_encoder": "lstm"}, 5, "history_encoder 'lstm'"),
    ({}, 0, "needs history_length > 0"),
    ({"strategy": "tpu"}, 5, "strategy 'tpu'"),
    ({"optimizer": "lamb"}, 5, "optimizer 'lamb'"),
    ({"num_hard_negatives": 0}, 5, "num_hard_negatives must be None or positive"),
    ({"epochs": 0}, 5, "epochs must be positive"),
    ({"temperature": 0.0}, 5, "temperature must be a positive number"),
    ({"temperature": float("nan")}, 5, "temperature must be a positive number, got nan"),
    ({"learning_rate": float("inf")}, 5, "learning_rate must be a positive number"),
    ({"early_stopping_patience": -1}, 5, "early_stopping_patience must be 0"),
    ({"use_user_id": False, "use_user_features": False, "history_encoder": "none"}, 5,
     "the query tower reads nothing"),
])
def test_settings_that_cannot_work_fail_before_training(overrides, history_length, message):
    with pytest.raises(ValueError, match=message):
        preset("tiny", **overrides).validate(history_length=history_length)
    with pytest.raises(ValueError, match="unknown retrieval preset"):
        preset("huge")


def test_a_query_tower_left_with_user_features_alone_needs_a_log_that_has_them():
    config = preset("tiny", use_user_id=False, history_encoder="none")
    config.validate(history_length=5, has_user_features=True)
    config.validate(history_length=5)                                     # the log unknown
    with pytest.raises(ValueError, match=r"reads nothing.*\(this log has no user features\)"):
        config.validate(history_length=5, has_user_features=False)


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
    # its variables made before `fit`, which traced its step once (twice if it made them)
    assert model.train_function.experimental_get_tracing_count() == 1


@pytest.fixture(scope="module")
def ensemble(trained):
    """(log, parts, model, data) of three members trained side by side on `trained`'s inputs."""
    log, parts, _, data, _ = trained
    model, _ = fit(data, preset("tiny", epochs=4, members=3), verbose=0)
    return log, parts, model, data


def test_an_ensemble_scores_the_mean_of_members_that_each_learn(ensemble):
    """The served dot product is the mean of the members' own; each member trains on its own
    loss from its own initial weights, so each alone learns the planted structure."""
    log, parts, model, data = ensemble
    queries = query_embeddings(model, data.examples["test"])                     # [m, 3 * 16]
    items = candidate_embeddings(model, data.num_items)                          # [I, 3 * 16]
    assert queries.shape[1] == items.shape[1] == 48
    members = [(query_embeddings(member, data.examples["test"]),
                candidate_embeddings(member, data.num_items)) for member in model.members]
    np.testing.assert_allclose(queries @ items.T,
                               np.mean([q @ c.T for q, c in members], axis=0), atol=1e-6)
    assert not np.allclose(members[0][1], members[1][1])
    popularity = baselines(log, parts, eval_set(log, parts, "test"))["popularity"]["recall@10"]
    for member in model.members:
        assert evaluate_model(member, data, "test")["recall@10"] > 1.5 * popularity


def test_an_ensemble_export_serves_the_keras_top_k_and_reloads(ensemble, tmp_path):
    """The exports and the run folder's weights hold every member: the brute-force and ScaNN
    SavedModels answer the ensemble's own top k, and the model rebuilt from the checkpoint
    embeds as the trained one."""
    from tworec.pipeline.store import load_retrieval, save_retrieval
    from tworec.retrieval.export import export, traced_query
    log, _, model, data = ensemble
    users = np.flatnonzero(data.known)[:5]
    seen = data.seen[users].toarray()
    expected = log.item_ids[keras_top_k(model, data, users, 10, seen)].tolist()
    exact = export(model, data, str(tmp_path / "retrieval"), k=10)
    scann = export(model, data, str(tmp_path / "retrieval_scann"), k=10,
                   scann=ScannParams(4, 4, data.num_items))
    for path in (exact, scann):
        run, _ = load_like_tf_serving(path)
        assert run("serving_default", user_id=log.user_ids[users])["item_ids"].astype(
            str).tolist() == expected
        assert_holds_the_weights_alone(path, model)
    # both exports' signatures call one query tower, traced for [b, L] and [b, None] histories
    assert traced_query(model).experimental_get_tracing_count() == 2
    save_retrieval(str(tmp_path / "run"), model)
    loaded = load_retrieval(str(tmp_path / "run"), data, model.config)
    np.testing.assert_array_equal(candidate_embeddings(loaded, data.num_items),
                                  candidate_embeddings(model, data.num_items))
    np.testing.assert_array_equal(query_embeddings(loaded, data.examples["test"]),
                                  query_embeddings(model, data.examples["test"]))


@pytest.mark.parametrize("encoder", ["none", "mean", "transformer"])
def test_every_history_encoder_trains(encoder):
    log = generate(PRESETS["tiny"], seed=1)
    model, data, summary = train(log, split(log), preset("tiny", epochs=1, history_encoder=encoder))
    assert np.isfinite(summary["history"]["loss"]).all()
    assert query_embeddings(model, data.examples["test"]).shape == (len(data.examples["test"]["user"]), 16)


@pytest.mark.parametrize("encoder, jit_compile, members", [("transformer", True, 1),
                                                           ("gru", False, 2)])
def test_mixed_precision_and_jit_compile_run_on_cpu(encoder, jit_compile, members):
    """The GPU settings, run on the CPU. XLA with the transformer history encoder: XLA
    compiles the (default) GRU's loop for ~45 s on this CPU, the transformer in ~5 s."""
    log = generate(PRESETS["tiny"], seed=2)
    model, data, summary = train(log, split(log), preset(
        "tiny", epochs=1, mixed_precision=True, jit_compile=jit_compile, history_encoder=encoder,
        members=members))
    assert np.isfinite(summary["history"]["loss"]).all()
    assert tf.keras.mixed_precision.global_policy().name == "float32"
    assert query_embeddings(model, data.examples["test"]).dtype == np.float32


def test_xla_with_a_mirrored_strategy_over_cpu_devices_is_refused_before_training(monkeypatch):
    """XLA runs a step on one device, and over several logical CPU devices the mirrored
    strategy's replicas fail on each other's variables ("Trying to access resource ...
    located in device CPU:1 from device CPU:0", keras-team/keras#19005). Over one CPU device
    it trains (measured), and GPUs are not refused."""
    from tworec.features import training

    def mirrored_over(*devices):
        strategy = type("Mirrored", (), {"extended": type("Extended", (), {
            "worker_devices": devices})})()
        monkeypatch.setattr(training, "_mirrored_strategy", lambda: strategy)
        return strategy
    cpus = ("/job:localhost/replica:0/task:0/device:CPU:0",
            "/job:localhost/replica:0/task:0/device:CPU:1")
    message = ("jit_compile with strategy 'mirrored' over 2 CPU devices: XLA cannot reach the "
               "other replicas' variables; use jit_compile on one device, or strategy "
               "'mirrored' without it")
    mirrored_over(*cpus)
    with pytest.raises(ValueError, match=re.escape(message)):
        training.make_strategy("mirrored", jit_compile=True)
    log = generate(PRESETS["tiny"], seed=0)
    with pytest.raises(ValueError, match=re.escape(message)):
        train(log, split(log), preset("tiny", epochs=1, strategy="mirrored", jit_compile=True))
    for devices, jit_compile in ((cpus, False), (cpus[:1], True),
                                 (("/device:GPU:0", "/device:GPU:1"), True)):
        strategy = mirrored_over(*devices)
        assert training.make_strategy("mirrored", jit_compile=jit_compile) is strategy


def test_jit_compile_with_multi_worker_is_refused_on_workers_without_a_gpu(monkeypatch):
    """Refused before the strategy is made (it would wait for its cluster): every worker's
    first XLA step would fail on the candidates' all-gather."""
    from tworec.features import training
    monkeypatch.setattr(tf.distribute, "MultiWorkerMirroredStrategy", lambda: "strategy")
    assert not tf.config.list_physical_devices("GPU")
    with pytest.raises(ValueError, match="jit_compile with strategy 'multi_worker' on workers "
                                         "without a GPU"):
        training.make_strategy("multi_worker", jit_compile=True)
    assert training.make_strategy("multi_worker") == "strategy"
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind: ["GPU:0"])
    assert training.make_strategy("multi_worker", jit_compile=True) == "strategy"


def test_mixed_precision_skips_the_same_few_first_steps_at_any_batch_size(monkeypatch):
    """The retrieval loss sums over the batch: loss-scaled as it is, its float16 gradients
    overflowed from Keras's initial scale (2^15), so each step was skipped and the scale
    halved, more the larger the batch (at 1024 every step of this epoch, scale 2^15 → 2^12
    after three). Scaled as a mean, both batch sizes skip the same three."""
    from tworec.features import training
    scales = []

    class LossScale(tf.keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            scales.append(float(self.model.optimizer.loss_scale.numpy()))
    monkeypatch.setattr(training, "run_callbacks", lambda *args, **kwargs: [LossScale()])
    log = generate(PRESETS["tiny"], seed=0)
    for batch_size in (256, 1024):
        train(log, split(log), preset("tiny", epochs=1, batch_size=batch_size,
                                      mixed_precision=True, history_encoder="mean"))
    assert scales == [2.0 ** 12, 2.0 ** 12]


def test_a_mixed_precision_model_is_evaluated_exported_and_reloaded_in_float32(tmp_path):
    """Mixed precision speeds training alone: float16 layers round otherwise run eagerly (the
    offline evaluation) than traced (the export), here by up to 2e-4, and a served list can
    then rank the held-out item otherwise than the report. The model `fit` returns, and the
    run folder reloads, computes in float32: the export serves exactly the embeddings and the
    top k evaluated offline, with no float16 op in it."""
    from tworec.pipeline import store
    from tworec.retrieval.export import export
    from tworec.retrieval.train import latest_queries
    log = generate(PRESETS["tiny"], seed=0)
    config = preset("tiny", epochs=1, mixed_precision=True)
    model, data, _ = train(log, split(log), config)
    run, meta = load_like_tf_serving(export(model, data, str(tmp_path / "retrieval"), k=10))
    known = np.flatnonzero(data.known)
    queries = latest_queries(model, data)
    np.testing.assert_array_equal(run("embed_user", user_id=log.user_ids[known])["embedding"],
                                  queries[known])
    items = model.candidate(tf.range(data.num_items, dtype=tf.int64)).numpy()   # one batch
    np.testing.assert_array_equal(run("embed_items", item_ids=log.item_ids)["embedding"], items)
    served = run("serving_default", user_id=log.user_ids[known])["item_ids"].astype(str)
    assert served.tolist() == log.item_ids[keras_top_k(model, data, known, 10,
                                                       data.seen[known].toarray())].tolist()
    assert "DT_HALF" not in str(meta.graph_def)
    store.save_retrieval(str(tmp_path), model)
    reloaded = store.load_retrieval(str(tmp_path), data, config)
    np.testing.assert_array_equal(latest_queries(reloaded, data), queries)
    np.testing.assert_array_equal(
        reloaded.candidate(tf.range(data.num_items, dtype=tf.int64)).numpy(), items)


def test_random_protocol_reports_recall_without_exclusion():
    log = generate(PRESETS["tiny"], seed=2)
    model, data, _ = train(log, split(log, "random"), preset("tiny", epochs=1))
    metrics = evaluate_model(model, data, "test")
    assert set(metrics) == {f"{name}@{k}" for name in ("recall", "ndcg") for k in (10, 20, 50, 100)}
    assert 0 < metrics["recall@10"] <= metrics["recall@100"]


def test_brute_force_and_exact_scann_match_argsort(trained):
    _, _, model, data, _ = trained
    candidates = candidate_embeddings(model, data.num_items)
    queries = query_embeddings(model, data.examples["test"])[:32]
    exact = exact_top_k(candidates, queries, 10)
    _, brute = build_index(candidates, 10)(tf.constant(queries))
    assert np.array_equal(brute.numpy(), exact)
    # Every leaf searched and every item reordered: ScaNN is exact.
    params = ScannParams(num_leaves=4, num_leaves_to_search=4,
                         num_reordering_candidates=data.num_items)
    _, scann = build_index(candidates, 10, params)(tf.constant(queries))
    assert np.array_equal(scann.numpy(), exact)


def test_scann_settings_are_raised_to_give_k_answers():
    params = ScannParams(num_leaves=100, num_leaves_to_search=1, num_reordering_candidates=5)
    raised = params.with_enough_answers(num_items=1000, k=20)
    assert raised.num_leaves_to_search == 4 and raised.num_reordering_candidates == 20
    assert params.with_enough_answers(num_items=100_000, k=10) == \
        ScannParams(100, 1, 10)


def test_the_exported_setting_is_timed_as_the_export_searches(monkeypatch):
    """The report's speed of the ScaNN export is measured at the export's fetch (k and the
    most items a user has seen or a history holds), with the setting raised to give that many,
    against brute force's search of the top k (no mask on either side), the two timed in
    turn: the tuned setting's speed at the tuning k is not what it serves."""
    from tworec.retrieval import index as index_module
    timed = []

    def seconds(indexes, queries, repeats):
        timed.append([(type(index).__name__, index._k) for index in indexes] +
                     [len(queries), repeats])
        return np.array([[0.003, 0.004, 0.003, 0.004], [0.002, 0.002, 0.001, 0.002]])
    monkeypatch.setattr(index_module, "one_query_seconds", seconds)
    rng = np.random.default_rng(0)
    candidates, queries = rng.normal(size=(300, 8)), rng.normal(size=(20, 8))
    params = ScannParams(num_leaves=10, num_leaves_to_search=1, num_reordering_candidates=40)
    setting = index_module.exported_setting(candidates, queries, params, fetch=120, k=30,
                                            repeats=7)
    assert setting == {"fetch": 120, "num_leaves": 10, "num_leaves_to_search": 8,
                       "num_reordering_candidates": 120, "dimensions_per_block": 2,
                       "latency_ms_p50": pytest.approx(3.5), "exact_latency_ms_p50": 2.0,
                       "verdict": "slower", "difference_ms_ci95": pytest.approx([1.5, 2.0]),
                       "verdict_margin": 0.05, "short_answers": 0}
    assert timed == [[("SeededScaNN", 120), ("BruteForce", 30), 20, 7]]     # as exported


def test_the_exported_setting_counts_queries_scann_answers_short():
    """Uneven leaves: 900 of 1,000 items in one tight cluster, 3 of 62 leaves searched. The
    over-fetch assumes each leaf holds its share, so a query whose searched leaves hold
    fewer items gets fewer than `fetch` answers: counted, as `found_codes` finds them."""
    from tworec.retrieval import index as index_module
    rng = np.random.default_rng(0)
    cluster = rng.normal(0, 0.01, (900, 8)) + np.eye(8)[0]
    directions = rng.normal(size=(50, 8))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    candidates = np.concatenate([cluster, np.repeat(directions, 2, 0) +
                                 rng.normal(0, 0.01, (100, 8))])
    queries = np.concatenate([-np.eye(8)[:1], directions[:20]]).astype(np.float32)
    params = ScannParams(num_leaves=62, num_leaves_to_search=3, num_reordering_candidates=40)
    setting = index_module.exported_setting(candidates.astype(np.float32), queries, params,
                                            fetch=10, k=10, repeats=2)
    index = build_index(candidates.astype(np.float32), 10, params)
    answers = (found_codes(index, queries) >= 0).sum(axis=1)
    assert setting["short_answers"] == (answers < 10).sum() > 0


def test_a_speed_verdict_needs_an_interval_clear_of_the_margin():
    """Paired one-query times: a difference within the noise, or below 5% of the reference's
    time, is "unclear", not a verdict a second run could reverse; a clear one is given with
    its interval (milliseconds)."""
    from tworec.retrieval.index import faster
    reference = np.random.default_rng(0).uniform(0.001, 0.002, 200)               # seconds
    assert faster(reference - 0.0005, reference) == ("faster", [pytest.approx(-0.5)] * 2)
    assert faster(reference + 0.0005, reference) == ("slower", [pytest.approx(0.5)] * 2)
    assert faster(reference + 0.00003, reference) == ("unclear", [pytest.approx(0.03)] * 2)
    noise = np.random.default_rng(1).normal(0, 0.0002, 200)
    verdict, (low, high) = faster(reference + noise, reference)
    assert verdict == "unclear" and -0.1 < low < 0 < high < 0.1
    verdict, (low, high) = faster(reference + noise + 0.0003, reference)
    assert verdict == "slower" and 0.2 < low < 0.3 < high < 0.4
    assert faster(reference + noise + 0.0003, reference)[1] == [low, high]     # seeded
    rng, drift = np.random.default_rng(5), np.zeros(100)       # correlated, median zero:
    for i in range(1, 100):                                    # rows drawn alone would call
        drift[i] = 0.95 * drift[i - 1] + rng.normal(0, 0.00005)   # it faster (-0.22 to -0.12)
    verdict, (low, high) = faster(reference + np.repeat(drift, 2), reference)
    assert verdict == "unclear" and low < -0.2 and -0.075 < high < 0        # blocks widen it


def test_calls_timed_in_turn_take_each_query_in_both_orders():
    """Being asked second (warm caches) favours neither call: the order flips every query."""
    from tworec.retrieval.index import in_turn
    asked = []
    calls = [lambda q: asked.append(("scann", q)), lambda q: asked.append(("exact", q))]
    seconds = in_turn(calls, ["q0", "q1"], repeats=3)
    assert asked == [("scann", "q0"), ("exact", "q0"), ("exact", "q1"), ("scann", "q1"),
                     ("scann", "q0"), ("exact", "q0")]
    assert seconds.shape == (2, 3) and (seconds > 0).all()


def test_one_query_seconds_times_each_index_with_each_query():
    rng = np.random.default_rng(0)
    candidates, queries = rng.normal(size=(300, 8)), rng.normal(size=(5, 8))
    from tworec.retrieval.index import one_query_seconds
    seconds = one_query_seconds([build_index(candidates, 10), build_index(candidates, 20)],
                                queries.astype(np.float32), repeats=7)
    assert seconds.shape == (2, 7) and (seconds > 0).all()


def test_scann_tuning_meets_the_target(trained):
    _, _, model, data, _ = trained
    candidates = candidate_embeddings(model, data.num_items)
    queries = query_embeddings(model, data.examples["test"])[:50]
    result = tune_scann(candidates, queries, k=10, target_recall=0.9, repeats=5)
    assert 0 < len(result["table"]) <= 27 and result["params"] is not None
    settings = [(r["num_leaves"], r["num_leaves_to_search"], r["num_reordering_candidates"])
                for r in result["table"]]
    assert len(set(settings)) == len(settings)          # each setting measured as built, once
    for row in result["table"]:
        params = ScannParams(row["num_leaves"], row["num_leaves_to_search"],
                             row["num_reordering_candidates"])
        assert params.with_enough_answers(data.num_items, 10) == params
    assert result["recall@10_vs_exact"] >= 0.9 and result["skipped"] is None
    best = [r for r in result["table"] if r["recall"] >= 0.9]
    assert ScannParams(**result["params"]).work(data.num_items) == min(r["work"] for r in best)


def setting_of(row: dict) -> ScannParams:
    """The ScaNN setting of a row of `tune_scann`'s table."""
    return ScannParams(**{field.name: row[field.name] for field in dataclasses.fields(ScannParams)})


def skewed_catalogue(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """([1000, 8] candidates, [200, 8] queries): items 0-9 far apart and often in the exact
    top 10, items 10-999 in one tight cluster, so ScaNN's leaves are uneven and a search's
    leaves can hold fewer than k items (it pads with a NaN score and code 0)."""
    rng = np.random.default_rng(seed)
    candidates = np.concatenate([rng.normal(size=(10, 8)) * 3,
                                 rng.normal(size=(990, 8)) * 0.01 + 5]).astype(np.float32)
    return candidates, rng.normal(size=(200, 8)).astype(np.float32)


def test_scann_padding_is_never_counted_as_found():
    """Code 0 is item 0, in many exact top 10s here: a padded slot must not find it."""
    candidates, queries = skewed_catalogue()
    exact = exact_top_k(candidates, queries, 10)
    assert (exact == 0).any(1).sum() > 50
    index = build_index(candidates, 10, ScannParams(63, 3, 40))
    scores, codes = index(tf.constant(queries))
    padded = ~np.isfinite(scores.numpy())
    assert padded.any(), "the case needs ScaNN to pad"
    assert np.array_equal(found_codes(index, queries), np.where(padded, -1, codes.numpy()))
    result = tune_scann(candidates, queries, k=10, target_recall=0.5, repeats=1)
    for row in result["table"]:              # the recall of what each setting really answers
        scores, codes = build_index(candidates, 10, setting_of(row))(tf.constant(queries))
        answered = np.where(np.isfinite(scores.numpy()), codes.numpy(), -1)
        hits = sum(len(np.intersect1d(a, b)) for a, b in zip(answered, exact))
        assert row["recall"] == hits / exact.size, row


def test_scann_builds_and_choices_repeat(trained, monkeypatch):
    """Two builds of a setting answer the same; the choice is the least work that meets the
    target, whatever the measured latency (here made fastest for the most work)."""
    _, _, model, data, _ = trained
    candidates = candidate_embeddings(model, data.num_items)
    queries = query_embeddings(model, data.examples["test"])[:50]
    params = ScannParams(12, 2, 20)
    first, second = (build_index(candidates, 10, params)(tf.constant(queries)) for _ in range(2))
    assert all(np.array_equal(a.numpy(), b.numpy(), equal_nan=True)     # NaN: ScaNN's pad
               for a, b in zip(first, second))
    latency = iter(np.linspace(1.0, 0.0, 100))              # each measured faster than the last
    monkeypatch.setattr(index_module, "single_query_latency_ms", lambda *args: next(latency))
    result = tune_scann(candidates, queries, k=10, target_recall=0.9, repeats=1)
    good = [row for row in result["table"] if row["recall"] >= 0.9]
    assert len(good) > 1 and result["latency_ms_p50"] > min(r["latency_ms_p50"] for r in good)
    least_work = min(good, key=lambda row: row["work"])
    assert result["params"] == dataclasses.asdict(setting_of(least_work))
    again = tune_scann(candidates, queries, k=10, target_recall=0.9, repeats=1)
    assert again["params"] == result["params"]
    assert [row["recall"] for row in again["table"]] == [row["recall"] for row in result["table"]]


def test_a_catalogue_too_small_for_scann_is_skipped_with_a_reason():
    rng = np.random.default_rng(0)
    queries = rng.normal(size=(30, 8)).astype(np.float32)
    small = rng.normal(size=(SCANN_MIN_ITEMS - 1, 8)).astype(np.float32)
    result = tune_scann(small, queries, k=10, repeats=1)
    assert result["params"] is None and result["table"] == [] and result["exact_latency_ms_p50"] > 0
    assert f"{SCANN_MIN_ITEMS - 1} items are fewer than the {SCANN_MIN_ITEMS}" in result["skipped"]
    with pytest.raises(ValueError, match=f"ScaNN cannot index {SCANN_MIN_ITEMS - 1} candidates"):
        build_index(small, 10, ScannParams(2, 1, 10))
    smallest = rng.normal(size=(SCANN_MIN_ITEMS, 8)).astype(np.float32)
    result = tune_scann(smallest, queries, k=10, target_recall=0.0, repeats=1)
    assert result["skipped"] is None and result["params"] is not None


def test_a_run_on_a_catalogue_too_small_for_scann_exports_brute_force_with_a_notice(tmp_path):
    log = generate(dataclasses.replace(PRESETS["tiny"], num_items=12, num_clusters=3), seed=0)
    rows = np.stack([log.user_ids[log.user], log.item_ids[log.item], log.timestamp.astype(str)], 1)
    np.savetxt(tmp_path / "small.csv", rows, fmt="%s", delimiter=",", header="user,item,time",
               comments="")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train_retrieval.py"),
                           "--data", str(tmp_path / "small.csv"), "--preset", "tiny",
                           "--epochs", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.load(open(out / "report.json"))
    assert report["index"]["params"] is None and report["index"]["table"] == []
    assert "12 items are fewer than the 16" in report["index"]["skipped"]
    assert any(notice.startswith(report["index"]["skipped"]) and "brute-force" in notice
               for notice in report["notices"]), report["notices"]
    assert os.listdir(out / "export" / "retrieval") == ["1"]
    assert not (out / "export" / "retrieval_scann").exists()


# ------------------------------------------------------------------ ties


def test_identical_candidates_tie_against_the_target():
    """Items 0 and 16 are the same vector v, item 5 is 2v, the others 0: for queries q with
    q.v > 0 either twin, as the target, has rank 2 (item 5 above it, its twin level with it)
    and the exact top 3 is [5, 0, 16]. NumPy's batched product scores the twins an ulp apart
    (by column position), which would rank one of them first."""
    v = np.array([0.31, -1.7, 0.05, 2.3, -0.9, 1.1, 0.77, -0.4], np.float32)
    candidates = np.zeros((17, 8), np.float32)
    candidates[[0, 16]], candidates[5] = v, 2 * v
    queries = (np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], np.float32)
               * np.arange(1, 9, dtype=np.float32)[:, None] / 3)                 # [8, 8]
    scores = exact_scorer(candidates)(queries)                                   # [8, 17]
    nothing_seen = sp.csr_matrix((8, 17), dtype=np.int8)
    for twin in (0, 16):
        ranks = target_ranks(scores, np.full(8, twin), nothing_seen)
        assert ranks.tolist() == [2] * 8, (twin, ranks)
    assert exact_top_k(candidates, queries, 3).tolist() == [[5, 0, 16]] * 8


@pytest.mark.parametrize("copy_columns", [3, 4096])
def test_equal_candidates_score_alike_however_the_copy_is_cut(monkeypatch, copy_columns):
    """600 candidates drawn from 5 rows (at this size NumPy's product scores some equal
    columns apart): every column equals its row's first column exactly, and the product
    within float32 rounding, whether the copies go 3 columns at a time or all at once."""
    monkeypatch.setattr(index_module, "COPY_COLUMNS", copy_columns)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 5, 600)
    candidates = rng.normal(size=(5, 32)).astype(np.float32)[rows]                # [600, 32]
    queries = rng.normal(size=(16, 32)).astype(np.float32)
    scores = exact_scorer(candidates)(queries)                                     # [16, 600]
    firsts = np.array([np.flatnonzero(rows == row)[0] for row in rows])
    np.testing.assert_array_equal(scores, scores[:, firsts])
    np.testing.assert_allclose(scores, queries @ candidates.T, rtol=1e-5, atol=1e-5)


def log_with_unknown_items(num_plain: int = 20, num_featured: int = 5) -> Interactions:
    """The tiny synthetic log plus new items each taken by four users after every other row:
    a global split holds them out whole, so the model knows none of them (one OOV id). The
    first `num_plain` have no genres and no year (one input of the candidate tower); of the
    other `num_featured`, alternately one has the first genre, the next a year."""
    log = generate(PRESETS["tiny"], seed=0)
    num_new = num_plain + num_featured
    rng = np.random.default_rng(5)
    users = np.concatenate([rng.choice(log.num_users, 4, replace=False) for _ in range(num_new)])
    items = log.num_items + np.repeat(np.arange(num_new), 4)
    times = log.timestamp.max() + 1 + rng.integers(0, 1000, len(users))
    genres = np.zeros((num_new, log.item_features["genres"].shape[1]), np.float32)
    year = np.zeros(num_new, np.int32)
    genres[num_plain::2, 0], year[num_plain + 1::2] = 1.0, 1995
    new = {"genres": genres, "year": year, "title": np.full(num_new, "")}
    return dataclasses.replace(
        log, item_ids=np.append(log.item_ids, [f"new{j}" for j in range(num_new)]),
        user=np.append(log.user, users).astype(log.user.dtype),
        item=np.append(log.item, items).astype(log.item.dtype),
        timestamp=np.append(log.timestamp, times),
        rating=np.append(log.rating, np.ones(len(users), log.rating.dtype)),
        item_features={name: np.concatenate([values, new[name].astype(values.dtype)])
                       for name, values in log.item_features.items()})


def test_items_the_model_does_not_know_tie_in_the_evaluation(tmp_path):
    """What the report ranks: every served item without training rows (a new item some user
    took in a validation row, before another's test row) scores exactly alike, so a held-out
    one's rank counts every other such item its user is ranked over, and the candidates list
    them by code, as the export does; its popular list holds the catalogue alone."""
    from tworec.retrieval.export import export
    log = log_with_unknown_items()
    parts = split(log, "temporal")
    data = prepare(log, parts, 5)
    plain = np.isin(log.item_ids, [f"new{j}" for j in range(20)])         # one input, no genre
    unknown = plain & data.catalogue & (data.item_index == 1)             # the OOV id, served
    assert unknown.sum() >= 5 and data.untrained_items > unknown.sum()     # featured ones too
    model, _ = fit(data, preset("tiny", epochs=1), verbose=0, validate=False)
    candidates = candidate_embeddings(model, data.num_items)
    assert (candidates[unknown] == candidates[unknown][0]).all()
    every_item = model.candidate(tf.range(data.num_items, dtype=tf.int64)).numpy()
    np.testing.assert_allclose(candidates, every_item, atol=1e-6)   # no other input merged
    evalset = eval_set(log, parts, "test", exclude_seen=True)
    score = catalogue_scorer(model, data, "test", evalset)
    rows = np.flatnonzero(unknown[evalset.targets] & evalset.known)
    assert len(rows) > 20
    scores = score(rows)                                                         # [r, I]
    assert (scores[:, unknown] == scores[:, unknown][:, :1]).all()
    ranks = evaluate_ranks(score, evalset, "retrieval")[rows]
    ranked = (evalset.excluded[rows].toarray() == 0) & data.catalogue            # [r, I]
    target_scores = scores[np.arange(len(rows)), evalset.targets[rows]][:, None]
    others_at_or_above = ((scores >= target_scores) & ranked & ~unknown).sum(1)
    twins = (ranked & unknown).sum(1) - 1                    # the other plain unknown items
    assert np.array_equal(ranks, others_at_or_above + twins)
    best = top_candidates(model, data, "test", 100, evalset=evalset)[rows]
    listed = np.where(np.isin(best, np.flatnonzero(unknown)), best, -1)
    assert (listed >= 0).sum() > 0
    for row in listed:                                       # ties to the lower code, as served
        row = row[row >= 0]
        assert (np.diff(row) > 0).all()
    size = int(data.catalogue.sum())                    # an unknown user given such an item:
    run, _ = load_like_tf_serving(export(model, data, str(tmp_path / "retrieval"), k=size))
    given = log.item_ids[np.flatnonzero(unknown)[:1]]   # the popular catalogue but that item
    served = run("with_history", user_id=np.array(["nobody"]), history=given[None, :].astype(
        object))["item_ids"][0].astype(str)
    order = data.popular["test"].order[:size]
    others = order[order != np.flatnonzero(unknown)[0]]
    assert served.tolist() == log.item_ids[others].tolist() + [""]


@pytest.mark.parametrize("scann", [False, True], ids=["brute-force", "scann"])
def test_items_of_no_fit_row_are_never_ranked_nor_served(tmp_path, scann):
    """Under `global` the new items are held out whole: the catalogue an export of the fit
    rows serves lacks them. The evaluation never ranks them (a held-out row of one is a miss
    at every K), the candidates (and training lists) never list them, and the export never serves them: asked for
    the whole catalogue, a user gets exactly the catalogue's items they have not seen."""
    from tworec.retrieval.export import export
    log = log_with_unknown_items()
    parts = split(log, "global")
    data = prepare(log, parts, 5)
    new = np.isin(log.item_ids, [f"new{j}" for j in range(25)])
    assert np.array_equal(data.catalogue, ~new) and data.untrained_items == 0
    model, _ = fit(data, preset("tiny", epochs=1), verbose=0, validate=False)
    evalset = eval_set(log, parts, "test")
    score = catalogue_scorer(model, data, "test", evalset)
    ranks = evaluate_ranks(score, evalset, "retrieval")
    on_new = new[evalset.targets]
    assert on_new.sum() == 100 and (ranks[on_new] == MISS).all()
    scores = score(np.flatnonzero(~on_new))
    scores[evalset.excluded[~on_new].nonzero()] = -np.inf
    target_scores = scores[np.arange(len(scores)), evalset.targets[~on_new]][:, None]
    assert np.array_equal(ranks[~on_new], ((scores >= target_scores) & ~new).sum(1) - 1)
    size = int(data.catalogue.sum())
    for best in (top_candidates(model, data, "test", size, evalset=evalset),
                 top_candidates(model, data, "train", size)):     # the lists a ranker trains on
        assert not np.isin(best, np.flatnonzero(new)).any()
    params = ScannParams(4, 4, size) if scann else None
    run, _ = load_like_tf_serving(export(model, data, str(tmp_path / "retrieval"), k=size,
                                         scann=params))
    users = np.flatnonzero(data.known)[:6]
    served = run("serving_default", user_id=log.user_ids[users])["item_ids"].astype(str)
    for user, items in zip(users, served):
        unseen = ~new & (data.seen[user].toarray()[0] == 0)
        assert sorted(items[items != ""]) == sorted(log.item_ids[unseen]), user
    with pytest.raises(ValueError, match=rf"the export answers 1 to {size} items a user \(the "
                                         "catalogue: the items of the fit rows\)"):
        export(model, data, str(tmp_path / "more"), k=size + 1)
    if scann:          # a history of items outside the index takes none of its fetched places
        run, _ = load_like_tf_serving(export(model, data, str(tmp_path / "ten"), k=10,
                                             scann=ScannParams(4, 4, size)))
        history = log.item_ids[new][None, :].astype(object)                # [1, 25]
        most = np.diff(data.seen.indptr).argmax()            # as many seen as the fetch skips
        given = run("with_history", user_id=log.user_ids[[most]], history=history)
        assert not np.isin(given["item_ids"].astype(str), log.item_ids[new]).any()


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


def assert_holds_the_weights_alone(path: str, model) -> None:
    """The SavedModel at `path` saved the model's variables as the module's list, and not the
    Keras model (its layers, optimizer and metrics, saved under `model/`)."""
    saved = [name for name, _ in tf.train.list_variables(os.path.join(path, "variables",
                                                                       "variables"))]
    held = [name for name in saved if name.startswith("model_variables/")]
    assert len(held) == len(model.variables), saved
    assert not [name for name in saved if name.startswith("model/")], saved


@pytest.mark.parametrize("genres, use_features", [(0, True), (3, True), (3, False)])
def test_item_features_create_only_the_layers_they_call(genres, use_features):
    """An export tracks a model with a never-called layer whole (`hold_model`: bigger and
    slower), so one call builds every layer of `ItemFeatures`, with or without genres."""
    from tworec.features.layers import ItemFeatures
    layer = ItemFeatures(np.arange(4), 6, np.ones((4, genres), np.float32), np.full(4, 1990),
                         dim=5, use_features=use_features)
    width = 5 + (8 + (16 if genres else 0) if use_features else 0)
    assert layer(tf.constant([0, 3], tf.int64)).shape == (2, width)
    assert all(sublayer.built for sublayer in layer.submodules)


def test_item_features_read_a_code_outside_the_catalogue_as_an_item_without_rows_or_features():
    """Code -1 (an id `id_lookup` does not know) is the out-of-vocabulary id row with no year
    bucket and no genres, not catalogue item 0."""
    from tworec.features.layers import ItemFeatures
    from tworec.features.vocab import OOV
    layer = ItemFeatures(np.array([2, 3]), 4, np.array([[1, 0], [0, 1]], np.float32),
                         np.array([1990, 2001]), dim=3)
    out = layer(tf.constant([-1, 0], tf.int64)).numpy()                           # [2, 3+8+16]
    expected = np.concatenate([layer.id_embedding(tf.constant([OOV])).numpy()[0],
                               layer.year_embedding(tf.constant([0])).numpy()[0],
                               layer.genre_projection(tf.zeros([1, 2])).numpy()[0]])
    np.testing.assert_allclose(out[0], expected, atol=1e-6)
    assert not np.allclose(out[0], out[1])


def keras_top_k(model, data, users: np.ndarray, k: int, excluded,
                history: np.ndarray | None = None) -> np.ndarray:
    """[u, k] codes of the Keras towers' top k for user codes `users` with their latest
    histories (or `history`, [u, L] item indices), `excluded` ([u, I] 0/1) skipped: the
    exports' answers, by NumPy."""
    features = {"user": data.users.remap(data.interactions.user_ids)[users],
                "history": data.latest[users] if history is None else history}
    for name, index in data.user_feature_index.items():
        features[f"user_{name}"] = index[users]
    queries = model.query({key: tf.constant(v) for key, v in features.items()}).numpy()
    scores = queries @ candidate_embeddings(model, data.num_items).T
    scores[np.asarray(excluded) > 0] = -np.inf
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def test_brute_force_export_serves_the_keras_top_k_of_unseen_items(trained, tmp_path):
    from tworec.retrieval.export import export
    from tensorflow.python.framework import op_def_registry
    log, _, model, data, _ = trained
    path = export(model, data, str(tmp_path / "retrieval"), k=10)
    assert os.path.basename(path) == "1"
    run, meta = load_like_tf_serving(path)
    assert set(meta.signature_def) >= {"serving_default", "with_history", "embed_user",
                                       "embed_items", "known_users"}
    for signature in ("serving_default", "with_history"):     # what REST clients decode by
        outputs = meta.signature_def[signature].outputs
        assert [[dim.size for dim in outputs[name].tensor_shape.dim]
                for name in ("item_ids", "scores")] == [[-1, 10], [-1, 10]]
    users = np.flatnonzero(data.known)[:5]
    unknown = log.user_ids[np.flatnonzero(~data.known)[:1]].tolist() + ["nobody"]
    assert run("known_users", user_id=np.array(log.user_ids[users].tolist() + unknown))[
        "known"].tolist() == [True] * 5 + [False] * len(unknown)
    served = run("serving_default", user_id=log.user_ids[users])
    seen = data.seen[users].toarray()
    expected = keras_top_k(model, data, users, 10, seen)
    assert served["item_ids"].astype(str).tolist() == log.item_ids[expected].tolist()
    assert served["scores"].shape == (5, 10) and served["scores"].dtype == np.float32
    assert seen.sum() > 0 and not np.take_along_axis(seen, expected, 1).any()
    ops = graph_op_types(meta)
    assert not [op for op in ops if op.startswith("Scann")]
    assert all(op_def_registry.get(op) is not None for op in ops)
    assert_holds_the_weights_alone(path, model)
    history = _history_strings(data, users)[:, 1:]              # not all the items they have
    given = run("with_history", user_id=log.user_ids[users], history=history)
    passed = np.zeros_like(seen)
    for row, ids in enumerate(history):
        passed[row, np.isin(log.item_ids, ids[ids != ""])] = 1
    latest = np.pad(data.latest[users][:, 1:], [(0, 0), (1, 0)])          # left-padded to L
    assert given["item_ids"].astype(str).tolist() == \
        log.item_ids[keras_top_k(model, data, users, 10, seen, history=latest)].tolist()
    no_history = keras_top_k(model, data, users, 10, seen,         # a known user's: skipped
                             history=np.zeros_like(data.latest[users]))
    for width in (0, 1):                     # no items, or padding alone: a history of none
        none = run("with_history", user_id=log.user_ids[users],
                   history=np.full((len(users), width), "", object))
        assert none["item_ids"].astype(str).tolist() == log.item_ids[no_history].tolist(), width
    embedded = run("embed_items", item_ids=log.item_ids[:3])["embedding"]
    np.testing.assert_allclose(embedded, candidate_embeddings(model, data.num_items)[:3], atol=1e-5)
    outside = run("embed_items", item_ids=np.array(["no-such-item", ""]))["embedding"]
    np.testing.assert_allclose(outside, model.candidate(tf.constant([-1, -1], tf.int64)).numpy(),
                               atol=1e-5)                         # not catalogue item 0's
    assert not np.allclose(outside[0], embedded[0], atol=1e-3)


@pytest.mark.parametrize("encoder", ["gru", "transformer", "none"])
def test_with_history_reads_the_latest_items_wherever_the_padding_is(trained, tmp_path,
                                                                     encoder):
    """The towers read what they were trained and evaluated on: the latest L items, oldest
    first, left-padded. Right or middle padding, a shorter or longer request, give the answer
    of the user's own latest items (the GRU read a right-padded history rotated; the
    transformer refused a longer one and answered a shorter one otherwise); every given item
    is skipped, and a known user's seen items too. A user the export does not know gets the
    popular items, the given ones skipped, unless its latest items hold one the towers
    learned (never, when they read no history)."""
    from tworec.features.vocab import OOV
    from tworec.retrieval.export import export
    log, parts, model, data, _ = trained
    if encoder != "gru":
        model, data, _ = train(log, parts, preset("tiny", epochs=1, history_encoder=encoder))
    run, _ = load_like_tf_serving(export(model, data, str(tmp_path / "retrieval"), k=10))
    users = np.flatnonzero(data.known & (np.diff(data.seen.indptr) > data.history_length))[:3]
    latest = _history_strings(data, users)                               # [3, L], all items
    assert (latest != "").all()
    older = np.array([[log.item_ids[data.seen[user].indices[0]]] for user in users], object)
    expected = log.item_ids[keras_top_k(model, data, users, 10, data.seen[users].toarray())]
    pads = np.full((len(users), 2), "", object)
    middle = np.concatenate([latest[:, :1], pads, latest[:, 1:]], axis=1)
    for history in (np.concatenate([latest, pads], axis=1), middle,
                    np.concatenate([pads, older, latest], axis=1)):          # L + 3: truncated
        answer = run("with_history", user_id=log.user_ids[users], history=history)
        assert answer["item_ids"].astype(str).tolist() == expected.tolist(), history
    two = latest[:, -2:]                                       # [3, 2] alone, and left-padded
    alone = run("with_history", user_id=log.user_ids[users], history=two)["item_ids"]
    padded = np.concatenate([np.full((len(users), data.history_length - 2), "", object), two], 1)
    assert alone.tolist() == run("with_history", user_id=log.user_ids[users],
                                 history=padded)["item_ids"].tolist()
    popular = run("serving_default", user_id=np.array(["nobody"]))["item_ids"]
    for nothing in (np.zeros((1, 0), object), np.array([["", "no-such-item"]], object)):
        assert run("with_history", user_id=np.array(["nobody"]), history=nothing)[
            "item_ids"].tolist() == popular.tolist()
    unknown = np.array([[f"new-{n}" for n in range(data.history_length)]], object)
    older = np.concatenate([popular[:, [0, 3]].astype(object), unknown], axis=1)
    skipped = run("with_history", user_id=np.array(["nobody"]), history=older)   # latest: new
    order = data.popular["test"].order
    assert skipped["item_ids"].astype(str).tolist() == [log.item_ids[np.delete(
        order, [0, 3])[:10]].tolist()]                              # the popular, given skipped
    np.testing.assert_allclose(skipped["scores"][0],
                               data.popular["test"].share[np.delete(order, [0, 3])[:10]])
    item = data.seen[users[0]].indices[0]                      # an item the towers learned
    features = {"user": np.array([OOV]), "history": np.pad([[data.item_index[item]]],
                                                           [(0, 0), (data.history_length - 1, 0)])}
    features.update({f"user_{name}": np.array([OOV]) for name in data.user_feature_index})
    query = model.query({key: tf.constant(value) for key, value in features.items()}).numpy()
    scores = (query @ candidate_embeddings(model, data.num_items).T)[0]
    scores[item] = -np.inf
    towers = run("with_history", user_id=np.array(["nobody"]),
                 history=np.array([[log.item_ids[item]]], object))["item_ids"]
    if encoder == "none":                       # the history tells such towers nothing
        assert towers.astype(str).tolist() == [log.item_ids[order[order != item][:10]].tolist()]
        return
    assert towers.astype(str).tolist() == [
        log.item_ids[np.argsort(-scores, kind="stable")[:10]].tolist()]
    assert towers.tolist() != popular.tolist()


@pytest.mark.parametrize("k", [0, "catalogue + 1"])
def test_an_export_of_more_items_than_the_catalogue_is_refused_before_it_traces(trained, tmp_path,
                                                                                 k):
    from tworec.retrieval.export import export
    _, _, model, data, _ = trained
    k = data.num_items + 1 if k == "catalogue + 1" else k
    with pytest.raises(ValueError, match=f"^k={k}: the export answers 1 to {data.num_items} "):
        export(model, data, str(tmp_path / "retrieval"), k=k)
    assert not os.path.exists(tmp_path / "retrieval")


def test_an_export_traces_its_gru_for_inference_alone(trained, tmp_path, monkeypatch):
    """Every retrieval export traces the query tower inside `inference_tracing` (the trace is
    kept on the model for its later exports): nothing for `save_servable` to drop (a trace made
    outside it would carry the GRU's 20 gradient functions into every export of the model),
    and the cuDNN variant kept for a GPU."""
    from tensorflow.core.protobuf import saved_model_pb2
    from tworec.retrieval.export import export
    from tworec.serving import layout
    _, _, model, data, _ = trained
    drop, dropped = layout.drop_unservable_functions, []
    monkeypatch.setattr(layout, "drop_unservable_functions",
                        lambda path: dropped.append(drop(path)) or dropped[-1])
    path = export(model, data, str(tmp_path / "retrieval"), k=10)
    assert dropped == [0]
    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        saved.ParseFromString(f.read())
    assert any(function.signature.name.startswith("__inference_gpu_gru_with_fallback")
               for function in saved.meta_graphs[0].graph_def.library.function)


def test_users_the_export_does_not_know_get_the_popular_items(trained, tmp_path):
    """Unknown ids, and users whose only rows are held out, are served `ModelInputs.popular`
    of the fit rows (here the latest tenth: not the training popularity); nothing of theirs is
    excluded."""
    from tworec.retrieval.export import export
    log, parts, model, data, _ = trained
    data = prepare(log, parts, data.history_length, cold_start_window=0.1)
    fit = parts.fit[np.argsort(log.timestamp[parts.fit], kind="stable")]
    recent = np.bincount(log.item[fit[-round(0.1 * len(fit)):]], minlength=log.num_items)
    overall = np.bincount(log.item[fit], minlength=log.num_items)
    popular = sorted(range(log.num_items), key=lambda item: (-recent[item], -overall[item]))[:10]
    assert popular != np.argsort(-data.item_probability, kind="stable")[:10].tolist()
    run, _ = load_like_tf_serving(export(model, data, str(tmp_path / "retrieval"), k=10))
    answer = run("serving_default", user_id=np.array(["nobody", "also-nobody"]))
    assert answer["item_ids"].astype(str).tolist() == [log.item_ids[popular].tolist()] * 2
    np.testing.assert_allclose(answer["scores"][0], recent[popular] / round(0.1 * len(fit)))


def test_the_seen_items_of_an_unknown_user_are_not_gathered(trained):
    """An unknown id reads user code 0 (`UserInputs.codes`), whose seen items must not come
    with it: a request of many unknown users would hold that user's seen items once each."""
    from tworec.features.layers import UserInputs
    _, _, _, data, _ = trained
    users = UserInputs(data)
    assert data.known[0] and data.seen[0].nnz > 0
    first = data.interactions.user_ids[0]
    rows, items = users.seen(*users.codes(tf.constant(["nobody", first, "also-nobody", first])))
    seen = np.sort(data.seen[0].indices)
    assert rows.numpy().tolist() == [1] * len(seen) + [3] * len(seen)
    np.testing.assert_array_equal(np.sort(items.numpy()[:len(seen)]), seen)
    np.testing.assert_array_equal(np.sort(items.numpy()[len(seen):]), seen)


def test_an_export_knows_the_fit_rows_and_never_the_test_rows(trained, tmp_path):
    """The baked state: each test user's latest items are their training and validation rows
    (the test item is not among them unless seen before), seen items likewise."""
    import json
    from tworec.retrieval.export import export
    log, parts, model, data, _ = trained
    path = export(model, data, str(tmp_path / "retrieval"), k=10)
    state = json.load(open(os.path.join(path, "assets.extra", "state.json")))
    assert state == {**data.state(), "exclude_seen": True}
    assert state["rows"] == len(parts.train) + len(parts.validation) == len(log) - len(parts.test)
    test_users, test_items = log.user[parts.test], log.item[parts.test]
    fit = log.take(parts.fit)
    last_fit = {}
    for row in fit.time_order():
        last_fit[fit.user[row]] = fit.item[row]
    assert [data.items.decode(data.latest[u, -1]) for u in test_users[:20]] == \
        [log.item_ids[last_fit[u]] for u in test_users[:20]]
    assert np.asarray(data.seen[test_users, test_items]).ravel().sum() == 0
    assert data.seen.sum() == len(set(zip(fit.user, fit.item)))


def test_seen_exclusion_over_fetches_k_distinct_unseen_items(tmp_path):
    """A user who has seen most of a small catalogue still gets k distinct unseen items from
    the ScaNN export (it over-fetches), and from both exports what remains when fewer than k
    are left. (The brute-force export with k below the unseen items:
    `test_brute_force_export_serves_the_keras_top_k_of_unseen_items`.)"""
    from tworec.retrieval.export import export
    log = generate(PRESETS["tiny"], seed=3)
    parts = split(log, "temporal")
    model, data, _ = train(log, parts, preset("tiny", epochs=1))
    heavy = int(np.argmax(np.asarray(data.seen.sum(1)).ravel()))
    unseen = data.num_items - int(data.seen[heavy].sum())
    scann = ScannParams(4, 1, 10)
    for k, params in ((10, scann), (unseen + 3, scann), (unseen + 3, None)):
        name = f"k{k}_{'scann' if params else 'brute'}"
        run, _ = load_like_tf_serving(export(model, data, str(tmp_path / name), k=k,
                                             scann=params))
        ids = run("serving_default", user_id=log.user_ids[[heavy]])["item_ids"][0].astype(str)
        real = ids[ids != ""]
        assert len(real) == min(k, unseen) == len(set(real)), name
        code = {item: c for c, item in enumerate(log.item_ids)}
        assert not data.seen[heavy, [code[item] for item in real]].nnz, name


def test_candidates_past_the_unseen_items_are_empty_slots(trained):
    """With fewer unseen items than k, the export's candidates end in empty slots, and so do
    the offline ones: never a seen item."""
    from tworec.evaluation import eval_set
    from tworec.features.inputs import EMPTY_SLOT
    from tworec.retrieval.train import top_candidates
    log, parts, model, data, _ = trained
    test = eval_set(log, parts, "test")
    candidates = top_candidates(model, data, "test", data.num_items, evalset=test)
    seen = np.asarray(test.history.sum(1)).ravel().astype(int)
    assert ((candidates == EMPTY_SLOT).sum(1) == seen).all() and seen.min() > 0
    real = np.where(candidates == EMPTY_SLOT, 0, candidates)
    picked_seen = test.history[np.arange(len(test))[:, None], real].toarray() > 0   # [m, I]
    assert not picked_seen[candidates != EMPTY_SLOT].any()


def _history_strings(data, users: np.ndarray) -> np.ndarray:
    """[u, L] item id strings of the users' latest histories, '' for padding."""
    return data.items.decode(data.latest[users]).astype(object)


def test_scann_export_loads_and_answers(trained, tmp_path):
    from tworec.retrieval.export import export
    log, _, model, data, _ = trained
    params = ScannParams(4, 4, data.num_items)
    path = export(model, data, str(tmp_path / "retrieval_scann"), k=10, scann=params)
    run, meta = load_like_tf_serving(path)
    assert any(op.startswith("Scann") for op in graph_op_types(meta))
    assert_holds_the_weights_alone(path, model)
    brute = export(model, data, str(tmp_path / "retrieval"), k=10)
    brute_run, _ = load_like_tf_serving(brute)
    users = log.user_ids[:4]
    assert np.array_equal(run("serving_default", user_id=users)["item_ids"],
                          brute_run("serving_default", user_id=users)["item_ids"])
    everything = np.array([log.item_ids.astype(object)])           # more than it can skip
    assert len(brute_run("with_history", user_id=users[:1], history=everything)["item_ids"][0]
               ) == 10
    unknown = np.array([[f"new-{n}" for n in range(data.history_length)]], object)
    exhausted = brute_run("with_history", user_id=np.array(["nobody"]),   # popular: all given
                          history=np.concatenate([everything, unknown], axis=1))
    assert exhausted["item_ids"].tolist() == [[b""] * 10]
    assert exhausted["scores"].tolist() == [[np.finfo(np.float32).min] * 10]
    order = data.popular["test"].order                    # a mixed batch, row by row as alone
    given = np.full((3, 3 + data.history_length), "", object)
    given[0, :2] = log.item_ids[order[[1, 4]]]            # unknown: two popular items given
    given[1, :3] = log.item_ids[order[[0, 2, 5]]]         # known: the towers, seen skipped
    given[2, :1] = log.item_ids[order[[0]]]               # unknown: another one given
    given[:, 3:] = unknown                                # the latest: ids it does not know
    mixed = brute_run("with_history", user_id=np.array(["nobody", users[0], "also-nobody"]),
                      history=given)
    for row in range(3):
        alone = brute_run("with_history", user_id=np.array(["nobody", users[0],
                                                            "also-nobody"])[row:row + 1],
                          history=given[row:row + 1])
        assert mixed["item_ids"][row].tolist() == alone["item_ids"][0].tolist(), row
    assert mixed["item_ids"][0].astype(str).tolist() == log.item_ids[
        np.delete(order, [1, 4])[:10]].tolist()
    assert mixed["item_ids"][2].astype(str).tolist() == log.item_ids[order[1:11]].tolist()
    with pytest.raises(tf.errors.InvalidArgumentError, match="use the retrieval export"):
        run("with_history", user_id=users[:1], history=everything)
    seen = np.diff(data.seen.indptr)                 # a known user's seen and given items
    room = max(seen.max(), data.history_length)            # the fetch's room: k still come
    user = int(np.flatnonzero(seen == room - 2)[0])      # (the tiny log has such a user)
    unseen = np.setdiff1d(np.arange(data.num_items), data.seen[user].indices)
    history = log.item_ids[unseen[:2]][None, :].astype(object)
    given = run("with_history", user_id=log.user_ids[[user]], history=history)
    assert given["item_ids"].tolist() == brute_run(
        "with_history", user_id=log.user_ids[[user]], history=history)["item_ids"].tolist()
    with pytest.raises(tf.errors.InvalidArgumentError, match="use the retrieval export"):
        run("with_history", user_id=log.user_ids[[user]],           # one more: refused
            history=log.item_ids[unseen[:3]][None, :].astype(object))


@pytest.mark.parametrize("scann", [False, True], ids=["brute-force", "scann"])
def test_an_export_searching_a_few_rows_at_a_time_answers_as_one_search(trained, tmp_path,
                                                                        monkeypatch, scann):
    """Blocks of 2 rows (the last one short, each with its own users' seen and given items
    skipped) answer the items one block of every row answers, their scores to float32's last
    bits (a one-row block's product sums in another order), and an empty request [0, k]."""
    from tworec.retrieval import export as retrieval_export
    log, _, model, data, _ = trained
    params = ScannParams(4, 4, data.num_items) if scann else None
    one, _ = load_like_tf_serving(retrieval_export.export(model, data, str(tmp_path / "one"),
                                                          k=10, scann=params))
    monkeypatch.setattr(retrieval_export, "SCORES_PER_BLOCK", 2 * data.num_items + 1)
    blocks, _ = load_like_tf_serving(retrieval_export.export(
        model, data, str(tmp_path / "blocks"), k=10, scann=params))
    users = np.flatnonzero(data.known)[:4]
    ids = np.array(log.user_ids[users].tolist() + ["nobody"])       # 5 rows: blocks 2, 2, 1
    history = np.concatenate([_history_strings(data, users), [[""] * data.history_length]])
    assert data.seen[users].sum() > 0
    for signature, inputs in (("serving_default", {"user_id": ids}),
                              ("with_history", {"user_id": ids, "history": history})):
        expected, got = one(signature, **inputs), blocks(signature, **inputs)
        assert got["item_ids"].tolist() == expected["item_ids"].tolist(), signature
        np.testing.assert_allclose(got["scores"], expected["scores"], rtol=1e-6)
    empty = blocks("serving_default", user_id=np.array([], object))
    assert empty["item_ids"].shape == empty["scores"].shape == (0, 10)


def test_scann_padding_and_excluded_items_are_never_served():
    """ScaNN pads with a NaN score and code 0 when its searched leaves hold too few items, and
    may answer fewer columns than asked."""
    from tworec.retrieval.export import usable_top_k
    scores = tf.constant([[np.nan, 0.5, 0.9, np.nan]], tf.float32)
    codes = tf.constant([[0, 3, 1, 0]], tf.int32)
    excluded = tf.constant([[False, True, False, False]])           # item 1 seen
    best, found = usable_top_k(scores, codes, excluded, 3)
    assert best.numpy().tolist() == [[0.5, -np.inf, -np.inf]] and found.numpy()[0, 0] == 3
    best, found = usable_top_k(scores[:, 1:2], codes[:, 1:2], tf.zeros([1, 5], tf.bool), 3)
    assert best.numpy().tolist() == [[0.5, -np.inf, -np.inf]]    # one column answered


@pytest.mark.parametrize("temperature, logq, remove_hits, hard_negatives", [
    (1.0, False, False, None), (0.05, True, True, None), (0.1, True, True, 3),
    (0.1, False, True, 50), (0.1, False, True, None), (0.05, True, False, None),
    (0.1, True, False, 3)])
def test_in_batch_softmax_loss_is_the_tfrs_retrieval_loss(temperature, logq, remove_hits,
                                                          hard_negatives):
    """Same loss and gradients as TFRS's task, with accidental hits (ids repeat), a
    probability below TFRS's clip, and more hard negatives than the batch holds."""
    import tensorflow_recommenders as tfrs   # after tworec, which selects Keras 2
    rng = np.random.default_rng(0)
    query, candidate = (tf.Variable(rng.normal(size=(9, 4)).astype(np.float32)) for _ in "qc")
    ids = tf.constant([3, 1, 3, 0, 2, 1, 3, 5, 4])
    probability = tf.constant([0.3, 0.2, 0.3, 1e-8, 0.1, 0.2, 0.3, 0.05, 0.5]) if logq else None
    task = tfrs.tasks.Retrieval(temperature=temperature, remove_accidental_hits=remove_hits,
                                num_hard_negatives=hard_negatives)
    results = []
    for loss in (lambda: task(query, candidate, candidate_sampling_probability=probability,
                              candidate_ids=ids if remove_hits else None,
                              compute_metrics=False, compute_batch_metrics=False),
                 lambda: in_batch_softmax_loss(query, candidate, temperature, probability,
                                               ids if remove_hits else None, hard_negatives)):
        with tf.GradientTape() as tape:
            value = loss()
        results.append([value.numpy(), *(g.numpy() for g in tape.gradient(value,
                                                                            [query, candidate]))])
    for expected, got in zip(*results):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("logq, remove_hits, hard_negatives", [
    (False, False, None), (True, True, None), (True, True, 3), (False, True, 50)])
def test_in_batch_softmax_loss_of_a_batchs_slices_sums_to_the_batchs(logq, remove_hits,
                                                                     hard_negatives):
    """Slices of the queries (a replica's rows, `offset` their first positive) scored against
    the whole batch's candidates: their losses and gradients sum to the whole batch's."""
    rng = np.random.default_rng(1)
    query, candidate = (tf.Variable(rng.normal(size=(9, 4)).astype(np.float32)) for _ in "qc")
    ids = tf.constant([3, 1, 3, 0, 2, 1, 3, 5, 4]) if remove_hits else None
    probability = tf.constant([0.3, 0.2, 0.3, 1e-8, 0.1, 0.2, 0.3, 0.05, 0.5]) if logq else None
    results = []
    for slices in ([(0, 9)], [(0, 5), (5, 9)]):
        with tf.GradientTape() as tape:
            value = tf.add_n([in_batch_softmax_loss(query[start:end], candidate, 0.1,
                                                    probability, ids, hard_negatives, start)
                              for start, end in slices])
        results.append([value.numpy(), *(g.numpy() for g in tape.gradient(value,
                                                                            [query, candidate]))])
    for whole, sliced in zip(*results):
        np.testing.assert_allclose(sliced, whole, rtol=1e-5, atol=1e-6)


def test_warmup_requests_give_each_signature_its_inputs_and_need_an_item():
    """A row per user: its id, an empty history, an item id each (the ids given, in turn)."""
    from tworec.retrieval.export import warmup_requests
    requests = warmup_requests(np.array(["u1", "u2", "u3"]), np.array(["i1", "i2"]))
    assert {name: {key: value.tolist() for key, value in inputs.items()}
            for name, inputs in requests.items()} == {
        "serving_default": {"user_id": ["u1", "u2", "u3"]},
        "with_history": {"user_id": ["u1", "u2", "u3"], "history": [[""], [""], [""]]},
        "embed_user": {"user_id": ["u1", "u2", "u3"]},
        "embed_items": {"item_ids": ["i1", "i2", "i1"]},
        "known_users": {"user_id": ["u1", "u2", "u3"]}}
    with pytest.raises(ValueError, match="need an item id for embed_items; got none"):
        warmup_requests(np.array(["u1"]), np.array([], dtype=str))
