"""Side-by-side performance figures; each part compares ours with a reference in one process.

    python scripts/benchmark.py [--only input,...] [--json]

With --json the last line is one JSON object keyed by part; a part that compares two things
carries `ratio` (ours over the reference).
"""
import argparse
import json
import sys
import time

import _common  # noqa: F401

import numpy as np
import tensorflow as tf

from features.pipeline import batches
from features.synthetic import PRESETS, generate


def examples_per_second(dataset: tf.data.Dataset, min_seconds: float = 3.0) -> float:
    """Iterates a dataset (one warm-up batch excluded) and returns its examples per second."""
    iterator = iter(dataset)
    next(iterator)
    examples, start = 0, time.perf_counter()
    for batch in iterator:
        examples += int(tf.shape(next(iter(batch.values())))[0])
        if time.perf_counter() - start > min_seconds:
            break
    return examples / (time.perf_counter() - start)


def bench_input(batch_size: int = 4096) -> dict:
    """Tutorial pipeline (per-example dicts, map, shuffle buffer, batch) against ours (a fresh
    permutation of all rows each epoch, whole-batch gathers) on a 1M-row log."""
    log = generate(PRESETS["1m"], seed=0)
    columns = {"user_id": log.user_ids[log.user], "item_id": log.item_ids[log.item],
               "timestamp": log.timestamp, "rating": log.rating}
    tutorial = (tf.data.Dataset.from_tensor_slices(columns)
                .map(lambda x: {"user_id": x["user_id"], "item_id": x["item_id"],
                                "timestamp": x["timestamp"], "rating": x["rating"]})
                .shuffle(100_000, seed=42)
                .batch(batch_size))
    ours = batches({"user": log.user, "item": log.item, "timestamp": log.timestamp,
                    "rating": log.rating}, batch_size, shuffle=True, epochs=None)
    reference_rate = examples_per_second(tutorial.repeat())
    our_rate = examples_per_second(ours)
    return {"interactions": len(log), "batch_size": batch_size,
            "tutorial_examples_per_second": round(reference_rate),
            "ours_examples_per_second": round(our_rate), "ratio": round(our_rate / reference_rate, 1)}


PARTS = {"input": bench_input}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(PARTS), help=f"parts: {','.join(PARTS)}")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; known: {list(PARTS)}")
    results = {}
    for name in names:
        print(f"[benchmark] {name} ...", file=sys.stderr, flush=True)
        results[name] = PARTS[name]()
        print(f"[benchmark] {name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results))
    else:
        for name, figures in results.items():
            print(name, json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
