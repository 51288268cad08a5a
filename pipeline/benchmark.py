"""Side-by-side performance figures (`scripts/benchmark.py`, `make bench`): each part compares
ours with a fair reference in one process; a part that compares two things carries `ratio`
(ours over the reference). TensorFlow is imported by the parts, not with the module, so that
`scripts/benchmark.py --help` answers at once."""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from tworec.features.synthetic import PRESETS, generate


def examples_per_second(dataset: tf.data.Dataset, min_seconds: float = 3.0) -> float:
    """Iterates a dataset (one warm-up batch excluded) and returns its examples per second."""
    import tensorflow as tf
    iterator = iter(dataset)
    next(iterator)
    examples, start = 0, time.perf_counter()
    for batch in iterator:
        examples += int(tf.shape(next(iter(batch.values())))[0])
        if time.perf_counter() - start > min_seconds:
            break
    return examples / (time.perf_counter() - start)


def bench_input(smoke: bool = False, batch_size: int = 4096) -> dict:
    """Tutorial pipeline (per-example dicts, map, shuffle buffer, batch) against ours (a fresh
    permutation of all rows each epoch, whole-batch gathers) on a 1M-row log."""
    import tensorflow as tf
    from tworec.features.batches import batches
    log = generate(PRESETS["tiny" if smoke else "1m"], seed=0)
    columns = {"user_id": log.user_ids[log.user], "item_id": log.item_ids[log.item],
               "timestamp": log.timestamp, "rating": log.rating}
    tutorial = (tf.data.Dataset.from_tensor_slices(columns)
                .map(lambda x: {"user_id": x["user_id"], "item_id": x["item_id"],
                                "timestamp": x["timestamp"], "rating": x["rating"]})
                .shuffle(100_000, seed=42)
                .batch(batch_size))
    ours = batches({"user": log.user, "item": log.item, "timestamp": log.timestamp,
                    "rating": log.rating}, batch_size, shuffle=True, epochs=None)
    seconds = 0.2 if smoke else 3.0
    reference_rate = examples_per_second(tutorial.repeat(), seconds)
    our_rate = examples_per_second(ours, seconds)
    return {"interactions": len(log), "batch_size": batch_size,
            "tutorial_examples_per_second": round(reference_rate),
            "ours_examples_per_second": round(our_rate), "ratio": round(our_rate / reference_rate, 1)}


def bench_train_retrieval(smoke: bool = False) -> dict:
    """Our two-tower training against the TFRS-tutorial way of training the same towers, a
    per-example pipeline (`from_tensor_slices`, `map`, `shuffle`, `batch`) into `model.fit`:
    the fair reference computes no metric while training, as TFRS's docs advise; the
    tutorials' own setting, `FactorizedTopK` over the catalogue at every step, is kept beside
    it, labelled. Three epochs, so that one-off tracing weighs little."""
    import tensorflow as tf
    import tensorflow_recommenders as tfrs
    from tworec.features import split
    from tworec.features.inputs import prepare
    from tworec.retrieval.config import preset
    from tworec.retrieval.train import build_model, fit
    log = generate(PRESETS["tiny" if smoke else "default"], seed=0)
    data = prepare(log, split(log, "temporal"), history_length=20)
    epochs = 1 if smoke else 3
    config = preset("tiny" if smoke else "default", epochs=epochs, early_stopping_patience=0,
                    batch_size=256 if smoke else 1024)
    _, ours = fit(data, config, verbose=0)
    train = data.examples["train"]
    steps = len(train["user"]) // config.batch_size

    def tutorial_rate(metrics_every_step: bool) -> float:
        reference = build_model(config, data)
        candidates = tf.data.Dataset.range(data.num_items).batch(1024).map(reference.candidate)
        reference.task = tfrs.tasks.Retrieval(
            metrics=tfrs.metrics.FactorizedTopK(candidates=candidates) if metrics_every_step
            else None, temperature=config.temperature)
        reference.compute_loss = lambda features, training=False: reference.task(
            reference.query(features), reference.candidate(features["item"]),
            compute_metrics=metrics_every_step)
        reference.compile(optimizer=tf.keras.optimizers.Adam(config.learning_rate))
        tutorial = (tf.data.Dataset.from_tensor_slices(train).map(lambda x: dict(x))
                    .shuffle(100_000, seed=42).batch(config.batch_size, drop_remainder=True))
        start = time.perf_counter()
        reference.fit(tutorial, epochs=epochs, verbose=0)
        return epochs * steps * config.batch_size / (time.perf_counter() - start)

    reference_rate, with_metrics_rate = tutorial_rate(False), tutorial_rate(True)
    return {"examples": len(train["user"]), "batch_size": config.batch_size,
            "tutorial_examples_per_second": round(reference_rate),
            "tutorial_with_metrics_every_step_examples_per_second": round(with_metrics_rate),
            "ours_examples_per_second": round(ours["examples_per_second"]),
            "ratio": round(ours["examples_per_second"] / reference_rate, 2),
            "ratio_vs_metrics_every_step": round(ours["examples_per_second"] / with_metrics_rate, 2)}


def bench_train_ranking(smoke: bool = False, epochs: int = 2) -> dict:
    """Our ranking training (batch-first lists) against the same model fed by a per-example
    pipeline (`from_tensor_slices`, `map`, `shuffle`, `batch`), on the same lists; two epochs,
    so that one-off tracing weighs less than the per-epoch work."""
    import tensorflow as tf
    from tworec.features import split
    from tworec.features.inputs import prepare
    from tworec.ranking.config import preset
    from tworec.ranking.features import list_examples, signals
    from tworec.ranking.train import build_model, candidate_lists, fit
    log = generate(PRESETS["tiny" if smoke else "default"], seed=0)
    config = preset("tiny" if smoke else "default", epochs=epochs, early_stopping_patience=0)
    inputs = prepare(log, split(log, "temporal"), history_length=20)
    given = signals(inputs, config.use_transitions)
    _, ours = fit(inputs, config, given, verbose=0)
    lists = candidate_lists(inputs, "train", config.num_negatives, 0.0, seed=config.seed)
    reference = build_model(config, inputs, given)
    train = list_examples(inputs, given, "train", lists)
    tutorial = (tf.data.Dataset.from_tensor_slices(train).map(lambda x: dict(x))
                .shuffle(100_000, seed=42).batch(config.batch_size))
    validation_lists = candidate_lists(inputs, "validation", config.num_negatives, 0.0,
                                       seed=config.seed + 1)
    validation = tf.data.Dataset.from_tensor_slices(
        list_examples(inputs, given, "validation", validation_lists)).batch(4096)
    start = time.perf_counter()   # both sides validate after every epoch, as `fit` does
    reference.fit(tutorial, epochs=epochs, validation_data=validation, verbose=0)
    reference_rate = epochs * len(lists) / (time.perf_counter() - start)
    return {"examples": len(lists), "list_size": lists.shape[1], "batch_size": config.batch_size,
            "tutorial_examples_per_second": round(reference_rate),
            "ours_examples_per_second": round(ours["examples_per_second"]),
            "ratio": round(ours["examples_per_second"] / reference_rate, 2)}


def bench_index(smoke: bool = False, dim: int = 64, num_queries: int = 200) -> dict:
    """ScaNN against brute force on a clustered 1M x 64 catalogue: single-query latency
    through the TF path and recall@10 against exact search."""
    import tensorflow as tf
    from tworec.retrieval.index import (ScannParams, build_index, exact_top_k, recall_against,
                                        single_query_latency_ms)
    num_items = 20_000 if smoke else 1_000_000
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(1000, dim)).astype(np.float32)
    candidates = centres[rng.integers(0, 1000, num_items)] + \
        0.5 * rng.normal(size=(num_items, dim)).astype(np.float32)
    queries = centres[rng.integers(0, 1000, num_queries)] + \
        0.5 * rng.normal(size=(num_queries, dim)).astype(np.float32)
    exact = exact_top_k(candidates, queries, 10)
    params = (ScannParams(num_leaves=100, num_leaves_to_search=20, num_reordering_candidates=200)
              if smoke else ScannParams(num_leaves=2000, num_leaves_to_search=200,
                                        num_reordering_candidates=1000))
    start = time.perf_counter()
    scann = build_index(candidates, 10, params)
    build_seconds = time.perf_counter() - start
    brute = build_index(candidates, 10)
    scann_ms = single_query_latency_ms(scann, queries, repeats=num_queries)
    brute_ms = single_query_latency_ms(brute, queries, repeats=50)
    _, found = scann(tf.constant(queries))
    return {"items": num_items, "dim": dim, "params": params.__dict__,
            "scann_build_seconds": round(build_seconds, 1),
            "recall@10_vs_exact": round(recall_against(found.numpy(), exact), 4),
            "scann_latency_ms_p50": round(scann_ms, 3), "brute_force_latency_ms_p50": round(brute_ms, 3),
            "ratio": round(brute_ms / scann_ms, 1)}


def bench_serving(smoke: bool = False) -> dict:
    """p50/p99 latency and requests/s of retrieval (1M items, brute force and ScaNN) and the
    composed recommender, over REST and gRPC with 1, 8 and 16 clients, without and with
    batching, and in-process (the same SavedModel in a TF-Serving-style session) as the floor
    (`serving.loadtest`)."""
    import tempfile
    from tworec.features import split
    from tworec.features.inputs import prepare
    from tworec.features.synthetic import SyntheticConfig
    from tworec.ranking.config import preset as ranking_preset
    from tworec.ranking.export import export as export_ranking
    from tworec.ranking.features import signals
    from tworec.ranking.train import fit as fit_ranking
    from tworec.retrieval.config import preset as retrieval_preset
    from tworec.retrieval.export import export as export_retrieval
    from tworec.retrieval.index import ScannParams
    from tworec.retrieval.train import embeddings_for_ranking, fit as fit_retrieval
    from tworec.serving.compose import compose_recommender
    from tworec.serving.layout import write_version
    from tworec.serving.loadtest import serving_figures

    num_items, seconds = (5_000, 0.2) if smoke else (1_000_000, 3.0)
    log = generate(SyntheticConfig(num_users=2_000, num_items=num_items, num_interactions=60_000),
                   seed=0)
    inputs = prepare(log, split(log, "temporal"), history_length=5)
    retrieval_model, _ = fit_retrieval(inputs, retrieval_preset("tiny", epochs=1), verbose=0)
    ranking_signals = signals(inputs, use_transitions=True,
                              retrieval=embeddings_for_ranking(retrieval_model, inputs))
    ranking_model, _ = fit_ranking(inputs, ranking_preset("tiny", epochs=1), ranking_signals,
                                   verbose=0)
    root = tempfile.mkdtemp(prefix="bench-serving-")
    paths = {"retrieval": export_retrieval(retrieval_model, inputs, f"{root}/retrieval", k=100),
             "retrieval_scann": export_retrieval(
                 retrieval_model, inputs, f"{root}/retrieval_scann", k=100,
                 scann=ScannParams(num_leaves=100 if smoke else 2000,
                                   num_leaves_to_search=20 if smoke else 200,
                                   num_reordering_candidates=1000)),
             "ranking": export_ranking(ranking_model, inputs, ranking_signals, f"{root}/ranking")}
    paths["recommender"] = write_version(f"{root}/recommender", lambda path: compose_recommender(
        paths["retrieval"], paths["ranking"], path, 10))
    users = {"user_id": inputs.interactions.user_ids[:1]}
    served = {name: (paths[name], users)
              for name in ("retrieval", "retrieval_scann", "recommender")}
    return {"items": num_items, **serving_figures(served, seconds=seconds)}


PARTS = {"input": bench_input, "train_retrieval": bench_train_retrieval,
         "train_ranking": bench_train_ranking, "index": bench_index, "serving": bench_serving}


def run(names: list[str], smoke: bool = False) -> dict:
    """Runs the named parts in order, logging each to stderr; returns {part: figures}. With
    `smoke`, every part runs on small data for seconds: a check that it works, not figures."""
    unknown = [name for name in names if name not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; known: {list(PARTS)}")
    results = {}
    for name in names:
        print(f"[benchmark] {name} ...", file=sys.stderr, flush=True)
        results[name] = PARTS[name](smoke=smoke)
        print(f"[benchmark] {name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    return results
