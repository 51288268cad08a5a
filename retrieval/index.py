"""Candidate indexes over item embeddings: exact brute force and ScaNN, both through
`tfrs.layers.factorized_top_k`, exact NumPy scoring in which equal candidates tie, and
recall-targeted ScaNN tuning."""
from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs
from scann import scann_ops

from tworec.console import quiet_native_logs
from tworec.evaluation import top_k_rows

# ScaNN's asymmetric hashing (lut16) trains 16 centres per block on the candidates themselves:
# a smaller catalogue cannot be indexed ("Number of clusters per block (16) is greater than
# asymmetric hashing training data size").
SCANN_MIN_ITEMS = 16
COPY_COLUMNS = 4096        # score columns `exact_scorer` copies to equal candidates at a time
# A speed verdict (`faster`) needs a difference beyond this share of the reference's time.
SPEED_MARGIN = 0.05


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

    def work(self, num_items: int) -> float:
        """Candidates one query scores over `num_items`, a cost that does not vary run to run:
        every leaf centre, the items of the searched leaves (quantized; num_items / num_leaves
        a leaf on average) and the reordered ones (exactly)."""
        return (self.num_leaves + self.num_leaves_to_search * num_items / self.num_leaves
                + self.num_reordering_candidates)


class SeededScaNN(tfrs.layers.factorized_top_k.ScaNN):
    """TFRS's ScaNN layer with the partitioner's k-means started from k-means++ centres (ScaNN's
    fixed seed) instead of randomly drawn ones, which TFRS does not let one choose: the same
    candidates then build the same index, and answer the same."""

    def __init__(self, k: int, params: ScannParams, training_iterations: int = 10):
        super().__init__(k=k, distance_measure="dot_product", num_leaves=params.num_leaves,
                         num_leaves_to_search=params.num_leaves_to_search,
                         num_reordering_candidates=params.num_reordering_candidates,
                         dimensions_per_block=params.dimensions_per_block,
                         training_iterations=training_iterations)

        def build_searcher(candidates: tf.Tensor):     # TFRS's builder, random_init=False
            return (scann_ops.builder(candidates, k, "dot_product")
                    .tree(num_leaves=params.num_leaves,
                          num_leaves_to_search=params.num_leaves_to_search,
                          training_iterations=training_iterations, random_init=False)
                    .score_ah(dimensions_per_block=params.dimensions_per_block)
                    .reorder(params.num_reordering_candidates)
                    .build(shared_name=f"{self.name}/{uuid.uuid4()}"))
        self._build_searcher = build_searcher


def build_index(candidates: np.ndarray, k: int, scann: ScannParams | None = None,
                codes: np.ndarray | None = None):
    """A top-k layer over [n, d] candidates whose identifiers are their catalogue `codes` ([n]
    int; None: 0..n-1, the whole catalogue).

    Returns:
        A `tfrs.layers.factorized_top_k` layer: queries [b, d] -> (scores [b, k], codes [b, k]).
        ScaNN is built with `scann.with_enough_answers`, so it has k answers to give, and
        deterministically (`SeededScaNN`).

    Raises:
        ValueError: k exceeds the catalogue, or ScaNN is asked for one under SCANN_MIN_ITEMS.
    """
    if k > len(candidates):
        raise ValueError(f"k={k} is larger than the catalogue ({len(candidates)} items)")
    codes = tf.range(len(candidates), dtype=tf.int64) if codes is None else \
        tf.constant(codes, tf.int64)
    if scann is None:
        layer = tfrs.layers.factorized_top_k.BruteForce(k=k)
    elif len(candidates) < SCANN_MIN_ITEMS:
        raise ValueError(f"ScaNN cannot index {len(candidates)} candidates: its asymmetric "
                         f"hashing trains on at least {SCANN_MIN_ITEMS}")
    else:
        layer = SeededScaNN(k, scann.with_enough_answers(len(candidates), k))
    with quiet_native_logs():                   # ScaNN's partitioner logs its training
        layer.index(tf.constant(candidates, tf.float32), codes)
    return layer


def equal_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows [n, f] grouped by value: ([u] the first row of each distinct value, [n] each row's
    distinct value), so that `rows[first][inverse]` equals `rows`."""
    _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    return first, inverse.ravel()


def exact_scorer(candidates: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """queries [b, d] -> [b, num_items] dot products with candidates [num_items, d], equal
    candidate rows scoring bit-identically: a batched product can score equal columns an ulp
    apart (by their position), which would break their tie at random, so every later copy of
    a row is given the score of its first occurrence (`COPY_COLUMNS` at a time, so that the
    copy adds at most [b, COPY_COLUMNS] to the scores' memory)."""
    first, inverse = equal_rows(candidates)
    source = first[inverse]                          # [num_items] first item with that row
    copies = np.flatnonzero(source != np.arange(len(candidates)))

    def score(queries: np.ndarray) -> np.ndarray:
        scores = queries @ candidates.T                                   # [b, d] x [d, I]
        for start in range(0, len(copies), COPY_COLUMNS):
            columns = copies[start:start + COPY_COLUMNS]
            scores[:, columns] = scores[:, source[columns]]
        return scores
    return score


def exact_top_k(candidates: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """[b, k] codes of the k best dot products (`exact_scorer`), ties to the lower code."""
    return top_k_rows(exact_scorer(candidates)(queries), k)


def found_codes(index, queries: np.ndarray) -> np.ndarray:
    """[b, <=k] codes an index answers for queries [b, d], best first, -1 in the slots ScaNN
    pads (a NaN score and code 0 when the searched leaves hold fewer than k items)."""
    scores, codes = index(tf.constant(queries))
    return np.where(np.isfinite(scores.numpy()), codes.numpy(), -1)


def recall_against(found: np.ndarray, exact: np.ndarray) -> float:
    """Share of the exact top-k found, averaged over queries ([b, k] each; -1 finds nothing:
    use `found_codes`, not an index's raw codes, whose padding is code 0)."""
    hits = [len(np.intersect1d(a, b)) for a, b in zip(found, exact)]
    return float(np.sum(hits) / exact.size)


def single_query_latency_ms(index, queries: np.ndarray, repeats: int = 200) -> float:
    """Median milliseconds of one-query calls through the TF path."""
    return 1000 * float(np.median(one_query_seconds([index], queries, repeats)[0]))


def one_query_seconds(indexes: list, queries: np.ndarray, repeats: int) -> np.ndarray:
    """[len(indexes), repeats] seconds of one-query calls through the TF path (`in_turn`)."""
    calls = [tf.function(lambda q, index=index: index(q)) for index in indexes]
    for call in calls:
        call(tf.constant(queries[:1]))                   # traced before timing
    return in_turn([lambda q, call=call: call(q)[1].numpy() for call in calls],
                   [tf.constant(query[None, :]) for query in queries], repeats)


def in_turn(calls: list[Callable], queries: list, repeats: int) -> np.ndarray:
    """[len(calls), repeats] seconds of each call asked with query i % len(queries), the calls
    in turn with each query, in the reverse order every other query: what slows the machine
    for a moment slows them alike, and being asked second (warm caches) favours neither."""
    seconds = np.zeros([len(calls), repeats])
    for i in range(repeats):
        order = range(len(calls)) if i % 2 == 0 else reversed(range(len(calls)))
        for which in order:
            start = time.perf_counter()
            calls[which](queries[i % len(queries)])
            seconds[which, i] = time.perf_counter() - start
    return seconds


def faster(seconds: np.ndarray, reference: np.ndarray, margin: float = SPEED_MARGIN,
           samples: int = 2000) -> tuple[str, list[float]]:
    """Whether calls taking `seconds` [n] (timed `in_turn` with the `reference` [n] calls)
    are faster: ("faster" | "slower" | "unclear", the 95% interval of the median difference
    in milliseconds).

    The differences are averaged over each pair of queries (one asked in each order), and the
    interval is a moving-block bootstrap of their median (blocks of about sqrt(n) pairs, as
    the times of neighbouring calls are correlated). A verdict needs the interval to clear
    `margin` times the reference's median on one side, so that a difference within the noise
    of a busy machine is "unclear" run after run, not faster in one and slower in the next.
    """
    difference = 1000 * (np.asarray(seconds, np.float64) - np.asarray(reference, np.float64))
    pairs = difference[:len(difference) // 2 * 2].reshape(-1, 2).mean(axis=1)       # [m]
    block = max(1, int(round(np.sqrt(len(pairs)))))
    blocks = -(-len(pairs) // block)
    starts = np.random.default_rng(0).integers(0, len(pairs) - block + 1, (samples, blocks))
    drawn = pairs[(starts[:, :, None] + np.arange(block)).reshape(samples, -1)[:, :len(pairs)]]
    low, high = (float(value) for value in np.percentile(np.median(drawn, axis=1), [2.5, 97.5]))
    threshold = margin * 1000 * float(np.median(reference))
    return ("faster" if high < -threshold else "slower" if low > threshold else "unclear",
            [low, high])


def exported_setting(candidates: np.ndarray, queries: np.ndarray, params: ScannParams,
                     fetch: int, k: int, repeats: int = 200) -> dict:
    """The ScaNN setting an export that fetches `fetch` items a query (for k once seen items
    are gone) searches with (`ScannParams.with_enough_answers`), and its one-query latency
    against brute force's top k of the whole catalogue (the search alone, no mask on either
    side), the two timed in turn (`one_query_seconds`): {"fetch", the setting's fields,
    "latency_ms_p50", "exact_latency_ms_p50", `faster`'s "verdict", "difference_ms_ci95" and
    "verdict_margin", and "short_answers": how many of `queries` ScaNN answers with fewer
    than `fetch` items (leaves holding fewer items than their share: such a user may be served
    fewer than k)}."""
    index = build_index(candidates, fetch, params)
    scann, exact = one_query_seconds([index, build_index(candidates, k)], queries, repeats)
    verdict, interval = faster(scann, exact)
    answers = (found_codes(index, queries) >= 0).sum(axis=1)                        # [b]
    return {"fetch": fetch,
            **dataclasses.asdict(params.with_enough_answers(len(candidates), fetch)),
            "latency_ms_p50": 1000 * float(np.median(scann)),
            "exact_latency_ms_p50": 1000 * float(np.median(exact)),
            "verdict": verdict, "difference_ms_ci95": interval, "verdict_margin": SPEED_MARGIN,
            "short_answers": int((answers < fetch).sum())}


def scann_settings(num_items: int, k: int) -> list[ScannParams]:
    """The settings `tune_scann` tries for top-k over `num_items`, each as `build_index` builds
    it (`ScannParams.with_enough_answers`) and once; none under SCANN_MIN_ITEMS items."""
    if num_items < SCANN_MIN_ITEMS:
        return []
    root = max(1, int(np.sqrt(num_items)))
    leaves_options = sorted({max(1, root // 2), root, min(num_items, 2 * root)})
    settings = []
    for leaves, share, reorder in itertools.product(leaves_options, (0.05, 0.1, 0.25),
                                                    (4 * k, 10 * k, 50 * k)):
        params = ScannParams(leaves, max(1, int(round(share * leaves))), min(reorder, num_items)
                             ).with_enough_answers(num_items, k)
        if params not in settings:                # not raised onto a setting already there
            settings.append(params)
    return settings


def tune_scann(candidates: np.ndarray, queries: np.ndarray, k: int = 10,
               target_recall: float = 0.95, repeats: int = 100) -> dict:
    """Measures the `scann_settings` and picks, of those whose recall@k against exact search
    meets the target, the one with the least work per query (`ScannParams.work`; ties to the
    higher recall, then the smaller setting). Builds are deterministic (`SeededScaNN`), so the
    same candidates and queries always give the same choice; latency, which varies from run
    to run, is measured and reported, not chosen by.

    Returns:
        {"params": ScannParams as a dict (None if no setting met the target or ScaNN cannot
        index the catalogue), "skipped": why no setting was tried (None when they were),
        "table": every setting with recall, work and latency, "exact_latency_ms_p50": brute
        force}.
    """
    num_items = len(candidates)
    exact = exact_top_k(candidates, queries, k)
    table, settings = [], scann_settings(num_items, k)
    for params in settings:
        index = build_index(candidates, k, params)
        table.append({**dataclasses.asdict(params),
                      "recall": recall_against(found_codes(index, queries), exact),
                      "work": params.work(num_items),
                      "latency_ms_p50": single_query_latency_ms(index, queries, repeats)})
    exact_ms = single_query_latency_ms(build_index(candidates, k), queries, repeats)
    fields = [field.name for field in dataclasses.fields(ScannParams)]
    best = min((row for row in table if row["recall"] >= target_recall), default=None,
               key=lambda row: (row["work"], -row["recall"], [row[name] for name in fields]))
    skipped = None if settings else (
        f"ScaNN was not tuned: the catalogue's {num_items} items are fewer than the "
        f"{SCANN_MIN_ITEMS} its asymmetric hashing trains on")
    return {"params": None if best is None else {name: best[name] for name in fields},
            f"recall@{k}_vs_exact": None if best is None else best["recall"],
            "latency_ms_p50": None if best is None else best["latency_ms_p50"],
            "exact_latency_ms_p50": exact_ms, "target_recall": target_recall, "table": table,
            "skipped": skipped}
