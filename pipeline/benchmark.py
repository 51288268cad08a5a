"""Side-by-side performance figures (`scripts/benchmark.py`, `make bench`): each part compares
ours with a fair reference in one process; a part that compares two things carries `ratio`
(ours over the reference). TensorFlow is imported by the parts, not with the module, so that
`scripts/benchmark.py --help` answers at once."""
from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable

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


def input_pipelines(columns: dict[str, np.ndarray], batch_size: int) -> dict:
    """name -> an endless dataset of {name: [batch]} batches of `columns` ([n] arrays), the
    rows shuffled afresh every epoch: ours (`features.batches.batches`), and the ways a user
    writes it with tf.data: by hand (one `tf.random.shuffle` of the row indexes an epoch, cut
    into batches, one gather per batch, prefetched),
    the tf.data guide's (row indexes through `Dataset.shuffle` over all rows, `batch`, one
    gather per batch, prefetched) and the TFRS tutorials' (per-example dicts, `map`, a shuffle
    buffer, `batch`)."""
    import tensorflow as tf
    from tworec.features.batches import batches
    rows = len(next(iter(columns.values())))
    tensors = {name: tf.constant(values) for name, values in columns.items()}

    def gathered(indexes):
        return {name: tf.gather(values, indexes) for name, values in tensors.items()}

    def one_epoch(_):
        order = tf.random.shuffle(tf.range(rows, dtype=tf.int64), seed=42)          # [rows]
        whole = rows // batch_size * batch_size
        return tf.data.Dataset.from_tensor_slices(tf.reshape(                  # [steps, batch]
            order[:whole], [-1, batch_size])).concatenate(                      # and the rest
            tf.data.Dataset.from_tensors(order[whole:]).filter(lambda rest: tf.size(rest) > 0))
    by_hand = (tf.data.Dataset.counter().flat_map(one_epoch)
               .map(gathered, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE))
    guide = (tf.data.Dataset.range(rows).shuffle(rows, seed=42).repeat().batch(batch_size)
             .map(gathered, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE))
    tutorial = (tf.data.Dataset.from_tensor_slices(columns).map(lambda x: dict(x))
                .shuffle(100_000, seed=42).batch(batch_size).repeat())
    return {"ours": batches(columns, batch_size, shuffle=True, epochs=None),
            "by_hand": by_hand, "tf_data_guide": guide, "tutorial": tutorial}


def check_first_epochs(batch_size: int, rows: int) -> None:
    """Each pipeline's first `rows // batch_size` batches of a `rows`-row log hold as many
    distinct rows, shuffled: every side does the same work."""
    steps = rows // batch_size
    for name, dataset in input_pipelines({"row": np.arange(rows)}, batch_size).items():
        seen = np.concatenate([batch["row"].numpy() for batch in dataset.take(steps)])
        if len(np.unique(seen)) != steps * batch_size or np.all(np.diff(seen) > 0):
            raise AssertionError(f"input pipeline {name!r}: its first epoch is not "
                                 f"{steps * batch_size} distinct shuffled rows")


def bench_input(smoke: bool = False, batch_size: int = 4096) -> dict:
    """Ours against the strongest tf.data pipeline a user would write, by hand, with the
    tf.data guide's and the TFRS tutorials' pipelines beside it, labelled (`input_pipelines`),
    on a 1M-row log; every pipeline yields the same integer columns, and each is checked
    first, on a small log, to read each row once in its first epoch (`check_first_epochs`)."""
    log = generate(PRESETS["tiny" if smoke else "1m"], seed=0)
    columns = {"user": log.user, "item": log.item, "timestamp": log.timestamp,
               "rating": log.rating}
    check_first_epochs(batch_size, 10 * batch_size + 7)
    seconds = 0.2 if smoke else 3.0
    rates = {name: examples_per_second(dataset, seconds)
             for name, dataset in input_pipelines(columns, batch_size).items()}
    return {"interactions": len(log), "batch_size": batch_size,
            **{f"{name}_examples_per_second": round(rate) for name, rate in rates.items()},
            "ratio": round(rates["ours"] / rates["by_hand"], 2),
            "ratio_vs_tf_data_guide": round(rates["ours"] / rates["tf_data_guide"], 1),
            "ratio_vs_tutorial": round(rates["ours"] / rates["tutorial"], 1)}


def first_batch(examples: dict[str, np.ndarray], batch_size: int) -> tf.data.Dataset:
    """A dataset of the first `batch_size` examples, one batch: what a reference model makes
    its variables from before `fit` (`training.create_variables`), so that its training step
    is traced once, as ours is, without filling its shuffle buffer once more."""
    import tensorflow as tf
    return tf.data.Dataset.from_tensors({name: values[:batch_size]
                                         for name, values in examples.items()})


def in_turn(sides: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each side's rate (examples/s), measured once a round, the sides in turn, in the order
    given and then reversed, round after round (no side always first in the process, or always
    after another): a drift of the machine's speed slower than a round moves a round's sides
    alike, and `paired_ratios` compares them there."""
    rates = {name: [] for name in sides}
    order = list(sides.items())
    for round_number in range(rounds):
        for name, measure in order if round_number % 2 == 0 else order[::-1]:
            rates[name].append(measure())
    return rates


def paired_ratios(ours: list[float], reference: list[float]) -> dict:
    """{"ratio": the median over rounds of ours / the reference, "round_ratios": each round's}:
    a round's two sides are compared with each other alone."""
    each = np.divide(ours, reference)
    return {"ratio": round(float(np.median(each)), 2),
            "round_ratios": [round(float(ratio), 2) for ratio in each]}


def bench_train_retrieval(smoke: bool = False, rounds: int = 3) -> dict:
    """Our two-tower training against the TFRS-tutorial way of training the same towers, a
    per-example pipeline (`from_tensor_slices`, `map`, `shuffle`, `batch`) into `model.fit`:
    the fair reference computes no metric while training, as TFRS's docs advise; the
    tutorials' own setting, `FactorizedTopK` over the catalogue at every step, is kept beside
    it, labelled. Three epochs, so that one-off tracing weighs little; each side trains once
    a round, the sides in turn (`in_turn`; smoke: one round), the rates are the medians."""
    import tensorflow as tf
    import tensorflow_recommenders as tfrs
    from tworec.features import split
    from tworec.features.inputs import prepare
    from tworec.features.training import create_variables
    from tworec.retrieval.config import preset
    from tworec.retrieval.train import build_model, fit
    log = generate(PRESETS["tiny" if smoke else "default"], seed=0)
    data = prepare(log, split(log, "temporal"), history_length=20)
    epochs = 1 if smoke else 3
    config = preset("tiny" if smoke else "default", epochs=epochs, early_stopping_patience=0,
                    batch_size=256 if smoke else 1024, members=1)   # one model, as the tutorial
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
        create_variables(reference, first_batch(train, config.batch_size))   # as ours does
        reference.fit(tutorial, epochs=epochs, verbose=0)
        return epochs * steps * config.batch_size / (time.perf_counter() - start)

    rates = in_turn({"ours": lambda: fit(data, config, verbose=0)[1]["examples_per_second"],
                     "tutorial": lambda: tutorial_rate(False),
                     "with_metrics": lambda: tutorial_rate(True)}, 1 if smoke else rounds)
    median = {name: round(float(np.median(values))) for name, values in rates.items()}
    return {"examples": len(train["user"]), "batch_size": config.batch_size,
            "rounds": len(rates["ours"]),
            "tutorial_examples_per_second": median["tutorial"],
            "tutorial_with_metrics_every_step_examples_per_second": median["with_metrics"],
            "ours_examples_per_second": median["ours"],
            **paired_ratios(rates["ours"], rates["tutorial"]),
            "ratio_vs_metrics_every_step": paired_ratios(rates["ours"],
                                                         rates["with_metrics"])["ratio"]}


def bench_train_ranking(smoke: bool = False, epochs: int = 2, rounds: int = 3) -> dict:
    """Our ranking training (batch-first lists) against the same model fed by a per-example
    pipeline (`from_tensor_slices`, `map`, `shuffle`, `batch`), on the same lists; two epochs,
    so that one-off tracing weighs less than the per-epoch work; each side trains once a
    round, the sides in turn (`in_turn`; smoke: one round), the rates are the medians."""
    import tensorflow as tf
    from tworec.features import split
    from tworec.features.inputs import prepare
    from tworec.features.training import create_variables
    from tworec.ranking.config import preset
    from tworec.ranking.features import list_examples, signals
    from tworec.ranking.train import build_model, candidate_lists, fit
    log = generate(PRESETS["tiny" if smoke else "default"], seed=0)
    config = preset("tiny" if smoke else "default", epochs=epochs, early_stopping_patience=0)
    inputs = prepare(log, split(log, "temporal"), history_length=20)
    given = signals(inputs, config)
    lists = candidate_lists(inputs, "train", config.num_negatives, 0.0, seed=config.seed)
    train = list_examples(inputs, given, "train", lists)
    tutorial = (tf.data.Dataset.from_tensor_slices(train).map(lambda x: dict(x))
                .shuffle(100_000, seed=42).batch(config.batch_size))
    validation_lists = candidate_lists(inputs, "validation", config.num_negatives, 0.0,
                                       seed=config.seed + 1)
    validation = tf.data.Dataset.from_tensor_slices(
        list_examples(inputs, given, "validation", validation_lists)).batch(4096)
    def tutorial_rate() -> float:
        reference = build_model(config, inputs, given)
        start = time.perf_counter()   # both sides validate after every epoch, as `fit` does
        create_variables(reference, first_batch(train, config.batch_size))    # as ours does
        reference.fit(tutorial, epochs=epochs, validation_data=validation, verbose=0)
        return epochs * len(lists) / (time.perf_counter() - start)

    rates = in_turn({"ours": lambda: fit(inputs, config, given, verbose=0)[1][
        "examples_per_second"], "tutorial": tutorial_rate}, 1 if smoke else rounds)
    return {"examples": len(lists), "list_size": lists.shape[1], "batch_size": config.batch_size,
            "rounds": len(rates["ours"]),
            "tutorial_examples_per_second": round(float(np.median(rates["tutorial"]))),
            "ours_examples_per_second": round(float(np.median(rates["ours"]))),
            **paired_ratios(rates["ours"], rates["tutorial"])}


def bench_index(smoke: bool = False, dim: int = 64, num_queries: int = 200) -> dict:
    """ScaNN against brute force on a clustered 1M x 64 catalogue: single-query latency
    through the TF path (the two asked in turn, each query by both) and recall@10 against
    exact search."""
    from tworec.retrieval.index import (ScannParams, build_index, exact_top_k, found_codes,
                                        one_query_seconds, recall_against)
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
    scann_ms, brute_ms = 1000 * np.median(one_query_seconds([scann, brute], queries,
                                                             num_queries), axis=1)  # in turn
    return {"items": num_items, "dim": dim, "params": params.__dict__,
            "scann_build_seconds": round(build_seconds, 1),
            "recall@10_vs_exact": round(recall_against(found_codes(scann, queries), exact), 4),
            "scann_latency_ms_p50": round(scann_ms, 3), "brute_force_latency_ms_p50": round(brute_ms, 3),
            "ratio": round(brute_ms / scann_ms, 1)}


def bench_serving(smoke: bool = False) -> dict:
    """p50/p99 latency and requests/s of retrieval (1M items, brute force and ScaNN) and the
    composed recommender, over REST and gRPC with 1, 8 and 16 clients (smoke: 8), without and
    with batching, and in-process (the same SavedModel in a TF-Serving-style
    session) as the floor (`serving.loadtest`)."""
    from tworec.features import split
    from tworec.features.inputs import prepare
    from tworec.features.synthetic import SyntheticConfig
    from tworec.ranking.config import preset as ranking_preset
    from tworec.ranking.features import signals
    from tworec.ranking.train import fit as fit_ranking
    from tworec.retrieval.config import preset as retrieval_preset
    from tworec.retrieval.train import embeddings_for_ranking, fit as fit_retrieval
    from tworec.serving.loadtest import CLIENTS

    num_users, num_items, interactions, seconds, clients = (
        (500, 2_000, 3_000, 0.2, (8,)) if smoke else (2_000, 1_000_000, 60_000, 3.0, CLIENTS))
    log = generate(SyntheticConfig(num_users=num_users, num_items=num_items,
                                   num_interactions=interactions), seed=0)
    inputs = prepare(log, split(log, "temporal"), history_length=5)
    retrieval_model, _ = fit_retrieval(inputs, retrieval_preset("tiny", epochs=1), verbose=0)
    ranking_config = ranking_preset("tiny", epochs=1)
    ranking_signals = signals(inputs, ranking_config,
                              retrieval=embeddings_for_ranking(retrieval_model, inputs))
    ranking_model, _ = fit_ranking(inputs, ranking_config, ranking_signals, verbose=0)
    root = tempfile.mkdtemp(prefix="bench-serving-")
    try:
        return {"items": num_items, **_serve_exports(root, inputs, retrieval_model,
                                                     ranking_model, ranking_signals, smoke,
                                                     clients, seconds)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _serve_exports(root: str, inputs, retrieval_model, ranking_model, ranking_signals,
                   smoke: bool, clients: tuple[int, ...], seconds: float) -> dict:
    """Exports the models under `root` and measures them served (`bench_serving`)."""
    from tworec.ranking.export import export as export_ranking
    from tworec.retrieval.export import export as export_retrieval
    from tworec.retrieval.index import ScannParams
    from tworec.serving.compose import compose_recommender
    from tworec.serving.layout import write_version
    from tworec.serving.loadtest import serving_figures
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
    return serving_figures(served, clients=clients, seconds=seconds)


SCALE_SIZES = ("1m", "10m", "100m")
# The in-memory path peaks at ~6.6 GiB for 10M rows and grows ~0.6 GiB per million rows, so
# 100M rows (~60 GiB) do not fit this 24 GiB machine; it is measured where it fits.
IN_MEMORY_SIZES = ("1m", "10m")


def bench_scale(smoke: bool = False, steps: int = 2000, batch_size: int = 4096) -> dict:
    """Out-of-core preparation and streamed training against today's in-memory path, on
    synthetic logs of 1M, 10M and 100M rows written as Parquet shards. Each job runs in a fresh
    process, as a user runs them (`python -m tworec.features.prepare`, then training), so its
    peak resident memory is its own, read when its preparation or training ends; a size's
    `peak_rss_gib` is the larger of its two. The training process's peak including the rate
    measurements that follow training is reported apart
    (`train_with_rate_measurements_peak_rss_gib`; `with_rate_measurements_peak_rss_gib` of
    the in-memory side). The
    streaming side prepares the shards with DuckDB (`prepare_shards`, memory limit 1GB), then
    trains the default two-tower model (without item features, which a prepared log does not
    carry) with `lazy_adam` (Keras's Adam moves every row of the 1M-user table at every step:
    its training peaked 1.1 GiB higher at 100M rows) for `steps` steps of `batch_size` from
    the stream (`fit_prepared`); the in-memory side loads the shards, splits and prepares them
    in NumPy and trains the same model the same steps (`fit`), in one process. After training,
    each measures its stream of batches alone and its training step alone (on one batch held
    in memory). `input_ratio` is the input's examples/s over the training step's, the smallest
    over the sizes. The stream reads files just written, so mostly from the page cache."""
    sizes, steps, batch_size = (("tiny",), 5, 256) if smoke else (SCALE_SIZES, steps, batch_size)
    root = tempfile.mkdtemp(prefix="bench-scale-")
    rows = []
    try:
        for name in sizes:
            source, out = (os.path.join(root, f"{name}-{part}") for part in ("log", "prepared"))
            _log(f"scale {name}: writing the shards")
            _run_quietly([sys.executable, "-m", "tworec.features.shards", "--synthetic", name,
                          "--out", source])
            job = {"source": source, "steps": steps, "batch_size": batch_size, "out": out}
            _log(f"scale {name}: preparing")
            prepared = scale_job({**job, "kind": "prepare"})
            _log(f"scale {name}: training {steps} steps from the stream")
            trained = scale_job({**job, "kind": "stream"})
            measuring = trained.pop("with_rate_measurements_peak_rss_gib")
            row = {"preset": name, **prepared, **trained,
                   "prepare_peak_rss_gib": prepared["peak_rss_gib"],
                   "train_peak_rss_gib": trained["peak_rss_gib"],
                   "train_with_rate_measurements_peak_rss_gib": measuring,
                   "peak_rss_gib": max(prepared["peak_rss_gib"], trained["peak_rss_gib"])}
            if smoke or name in IN_MEMORY_SIZES:
                _log(f"scale {name}: the same in memory")
                row["in_memory"] = scale_job({**job, "kind": "in_memory"})
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root, exist_ok=True)
            rows.append(row)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {"steps": steps, "batch_size": batch_size, "sizes": rows,
              "input_ratio": min(row["input_ratio"] for row in rows)}
    if len(rows) > 1:
        result["peak_rss_ratio_largest_to_previous"] = round(
            rows[-1]["peak_rss_gib"] / rows[-2]["peak_rss_gib"], 2)
    return result


def scale_job(job: dict) -> dict:
    """Runs one job of `bench_scale` in a fresh Python process and returns its figures."""
    done = _run_quietly([sys.executable, "-m", "tworec.pipeline.benchmark", json.dumps(job)])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_quietly(command: list[str]) -> subprocess.CompletedProcess:
    """Runs a command, its output kept; raises with its last lines when it fails."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({done.returncode}):\n{tail}")
    return done


def _scale_job(kind: str, source: str, steps: int, batch_size: int, out: str) -> dict:
    """In this process, one job of `bench_scale`: 'prepare' the shards of `source` into `out`;
    train `steps` steps from the 'stream' of `out`; or, 'in_memory', load, prepare and train
    as today's path does. Its figures and this process's peak resident memory when its
    preparation or training ended (`peak_rss_gib`) and, for training, also after the rate
    measurements (`with_rate_measurements_peak_rss_gib`)."""
    if kind == "prepare":
        import duckdb  # noqa: F401  (imported before the clock starts)
        from tworec.features.prepare import prepare_shards
        start = time.perf_counter()
        rows = prepare_shards(source, out)["rows"]
        seconds = time.perf_counter() - start
        return {"rows": rows, "peak_rss_gib": _peak_rss_gib(),
                "prepare_seconds": round(seconds, 1),
                "prepare_rows_per_second": round(rows / seconds)}
    import tensorflow as tf  # noqa: F401  (loaded before any clock starts)
    from tworec.retrieval.config import preset
    config = preset("default", batch_size=batch_size, epochs=1, early_stopping_patience=0,
                    use_item_features=False, optimizer="lazy_adam", members=1)
    figures = {}
    if kind == "stream":
        from tworec.features.stream import PreparedLog
        from tworec.retrieval.train import fit_prepared
        prepared = PreparedLog.load(out)
        make_stream = functools.partial(prepared.training_batches, batch_size)
        model, summary = fit_prepared(prepared, config, steps_per_epoch=steps, verbose=0)
    else:
        from tworec.features import split
        from tworec.features.batches import batches
        from tworec.features.inputs import prepare
        from tworec.features.shards import load
        from tworec.retrieval.train import fit
        start = time.perf_counter()
        log = load(source)
        data = prepare(log, split(log, "temporal"), history_length=20)
        seconds = time.perf_counter() - start
        figures = {"rows": len(log), "prepare_seconds": round(seconds, 1),
                   "prepare_rows_per_second": round(len(log) / seconds)}
        model, summary = fit(data, config, verbose=0, steps_per_epoch=steps, validate=False)
        make_stream = functools.partial(batches, data.examples["train"], batch_size,
                                        shuffle=True, epochs=None, drop_remainder=True)
    figures["peak_rss_gib"] = _peak_rss_gib()          # through loading, preparing, training
    stream = make_stream()                             # the rates' batches, after training
    seconds, step_steps = (0.5, 5) if steps < 100 else (3.0, 100)
    input_rate = examples_per_second(stream, seconds)
    step_rate = training_step_rate(model, stream, step_steps)
    return {**figures, "with_rate_measurements_peak_rss_gib": _peak_rss_gib(),
            "train_examples_per_second": round(summary["examples_per_second"]),
            "input_examples_per_second": round(input_rate),
            "step_examples_per_second": round(step_rate),
            "input_ratio": round(input_rate / step_rate, 1)}


def _peak_rss_gib() -> float:
    """This process's peak resident memory in GiB. On Linux the kernel's high-water mark
    (VmHWM): `ru_maxrss` of a process started by another starts at its parent's peak, so a
    scale job started after the other parts would read theirs."""
    try:
        with open("/proc/self/status") as status:
            kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kib = peak / 1024 if sys.platform == "darwin" else peak      # bytes there, KiB here
    return round(kib / 2**20, 2)


def training_step_rate(model, dataset, steps: int) -> float:
    """Examples/s of the model's training step alone: `steps` steps on one batch of `dataset`
    held in memory, after a warm-up."""
    import tensorflow as tf
    batch = next(iter(dataset))
    one = tf.data.Dataset.from_tensors(batch).repeat()
    batch_size = int(batch["user"].shape[0])
    model.fit(one, steps_per_epoch=max(steps // 5, 1), epochs=1, verbose=0)
    start = time.perf_counter()
    model.fit(one, steps_per_epoch=steps, epochs=1, verbose=0)
    return steps * batch_size / (time.perf_counter() - start)


def _log(message: str) -> None:
    print(f"[benchmark] {message}", file=sys.stderr, flush=True)


PARTS = {"input": bench_input, "train_retrieval": bench_train_retrieval,
         "train_ranking": bench_train_ranking, "index": bench_index, "serving": bench_serving,
         "scale": bench_scale}


def run(names: list[str], smoke: bool = False) -> dict:
    """Runs the named parts in order, logging each to stderr; returns {part: figures}. With
    `smoke`, every part runs on small data for seconds: a check that it works, not figures."""
    unknown = [name for name in names if name not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; known: {list(PARTS)}")
    if not names or len(set(names)) < len(names):
        raise ValueError(f"name each part once, e.g. {','.join(PARTS)}; got {names}")
    results = {}
    for name in names:
        _log(f"{name} ...")
        start = time.perf_counter()
        try:
            results[name] = PARTS[name](smoke=smoke)
        except BaseException:                      # minutes of figures are not lost
            if results:
                _log(f"stopped in {name}; the parts done: {json.dumps(results)}")
            raise
        ratio = f", ratio {results[name]['ratio']}" if "ratio" in results[name] else ""
        _log(f"{name}: done in {time.perf_counter() - start:.0f} s{ratio}")    # figures: stdout
    return results


if __name__ == "__main__":     # one job of `bench_scale`
    from tworec import console
    parser = console.parser_for("Runs one job of the scale benchmark in this process and prints "
                                "its figures as one JSON line.")
    parser.add_argument("job", help='JSON: {"kind": "prepare" | "stream" | "in_memory", '
                        '"source": LOG, "out": PREPARED, "steps": N, "batch_size": B}')
    text = parser.parse_args().job
    try:
        job = json.loads(text)
    except json.JSONDecodeError as error:
        parser.error(f"job {text!r} is not JSON ({error})")
    if (not isinstance(job, dict) or job.get("kind") not in ("prepare", "stream", "in_memory")
            or set(job) != {"kind", "source", "out", "steps", "batch_size"}):
        parser.error(f"job {text!r}: give kind (prepare, stream or in_memory), source, out, "
                     "steps and batch_size")
    console.filter_native_logs()
    print(json.dumps(_scale_job(**job)))
