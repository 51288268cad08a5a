"""Candidate indexes over item embeddings: exact brute force and ScaNN, both through
`tfrs.layers.factorized_top_k`, and recall-targeted ScaNN tuning."""
from __future__ import annotations

import dataclasses
import itertools
import time

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

from tworec.console import quiet_native_logs


@dataclasses.dataclass(frozen=True)
class ScannParams:
    num_leaves: int
    num_leaves_to_search: int
    num_reordering_candidates: int
    dimensions_per_block: int = 2

    def with_enough_answers(self, num_items: int, k: int) -> "ScannParams":
        """The setting `build_index` really builds for top-k over `num_items`: the searched leaves
        hold about 2k items and at least k candidates are reordered, so ScaNN has k answers."""
        enough_leaves = -(-2 * k * self.num_leaves // num_items)
        return dataclasses.replace(
            self, num_leaves_to_search=min(self.num_leaves,
                                           max(self.num_leaves_to_search, enough_leaves)),
            num_reordering_candidates=max(self.num_reordering_candidates, k))


def build_index(candidates: np.ndarray, k: int, scann: ScannParams | None = None):
    """A top-k layer over [num_items, d] candidates whose identifiers are catalogue codes.

    Returns:
        A `tfrs.layers.factorized_top_k` layer: queries [b, d] -> (scores [b, k], codes [b, k]).
        ScaNN is built with `scann.with_enough_answers`, so it has k answers to give.
    """
    if k > len(candidates):
        raise ValueError(f"k={k} is larger than the catalogue ({len(candidates)} items)")
    codes = tf.range(len(candidates), dtype=tf.int64)
    if scann is None:
        layer = tfrs.layers.factorized_top_k.BruteForce(k=k)
    else:
        scann = scann.with_enough_answers(len(candidates), k)
        layer = tfrs.layers.factorized_top_k.ScaNN(
            k=k, distance_measure="dot_product", num_leaves=scann.num_leaves,
            num_leaves_to_search=scann.num_leaves_to_search,
            num_reordering_candidates=scann.num_reordering_candidates,
            dimensions_per_block=scann.dimensions_per_block, training_iterations=10)
    with quiet_native_logs():                   # ScaNN's partitioner logs its training
        layer.index(tf.constant(candidates, tf.float32), codes)
    return layer


def exact_top_k(candidates: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """[b, k] codes of the k best dot products, by a full NumPy argsort."""
    return np.argsort(-(queries @ candidates.T), axis=1, kind="stable")[:, :k]


def recall_against(found: np.ndarray, exact: np.ndarray) -> float:
    """Share of the exact top-k found, averaged over queries ([b, k] each)."""
    hits = [len(np.intersect1d(a, b)) for a, b in zip(found, exact)]
    return float(np.sum(hits) / exact.size)


def single_query_latency_ms(index, queries: np.ndarray, repeats: int = 200) -> float:
    """Median milliseconds of one-query calls through the TF path."""
    call = tf.function(lambda q: index(q))
    call(tf.constant(queries[:1]))
    times = []
    for i in range(repeats):
        q = tf.constant(queries[i % len(queries)][None, :])
        start = time.perf_counter()
        call(q)[1].numpy()
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times))


def tune_scann(candidates: np.ndarray, queries: np.ndarray, k: int = 10,
               target_recall: float = 0.95, repeats: int = 100) -> dict:
    """Searches num_leaves, num_leaves_to_search and reordering candidates and picks the fastest
    setting whose recall@k against exact search meets the target.

    Returns:
        {"params": ScannParams as a dict (None if no setting met the target), "table": every
        measured setting with recall and latency, "exact_latency_ms_p50": brute force}.
    """
    num_items = len(candidates)
    exact = exact_top_k(candidates, queries, k)
    root = max(1, int(np.sqrt(num_items)))
    table, measured = [], set()
    leaves_options = sorted({max(1, root // 2), root, min(num_items, 2 * root)})
    for leaves, share, reorder in itertools.product(leaves_options, (0.05, 0.1, 0.25),
                                                    (4 * k, 10 * k, 50 * k)):
        params = ScannParams(leaves, max(1, int(round(share * leaves))), min(reorder, num_items)
                             ).with_enough_answers(num_items, k)
        if params in measured:
            continue                                  # raised onto a setting already measured
        measured.add(params)
        index = build_index(candidates, k, params)
        _, found = index(tf.constant(queries))
        table.append({**dataclasses.asdict(params),
                      "recall": recall_against(found.numpy(), exact),
                      "latency_ms_p50": single_query_latency_ms(index, queries, repeats)})
    exact_ms = single_query_latency_ms(build_index(candidates, k), queries, repeats)
    good = [row for row in table if row["recall"] >= target_recall]
    best = min(good, key=lambda row: row["latency_ms_p50"]) if good else None
    return {"params": None if best is None else
            {key: best[key] for key in ("num_leaves", "num_leaves_to_search",
                                        "num_reordering_candidates", "dimensions_per_block")},
            "recall@%d_vs_exact" % k: None if best is None else best["recall"],
            "latency_ms_p50": None if best is None else best["latency_ms_p50"],
            "exact_latency_ms_p50": exact_ms, "target_recall": target_recall, "table": table}
