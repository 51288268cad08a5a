"""Trains the ranking model on retrieval's candidates, evaluates it alone and as the second
stage over retrieval's top-K, and exports `ranking`.

    python scripts/train_ranking.py --data SOURCE --out RUN [--split temporal|random]
        [--preset tiny|default] [--model dcn|bst] [--task listwise|binary|regression] [--top-k 100]

Retrieval is trained first in the same process (same preset) to supply hard negatives and the
candidates to re-rank.
"""
import argparse
import json
import os
import sys


from tworec.features import DataError, load, split
from tworec.features.sources import parse_columns
from tworec.ranking import config as ranking_config
from tworec.ranking.export import export
from tworec.ranking.train import RetrievalSignal, evaluate, fit, two_stage_metrics
from tworec.retrieval import config as retrieval_config
from tworec.retrieval.train import (embeddings_for_ranking, evaluate_model, fit as fit_retrieval,
                             top_candidates)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--columns", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--split", default="temporal", choices=["temporal", "random"])
    parser.add_argument("--preset", default="default", choices=sorted(ranking_config.PRESETS))
    parser.add_argument("--model", choices=ranking_config.MODELS)
    parser.add_argument("--task", choices=ranking_config.TASKS)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--top-k", type=int, default=100, help="retrieval candidates to re-rank")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("model", args.model), ("task", args.task),
                                   ("epochs", args.epochs)) if v is not None}
    try:
        log = load(args.data, columns=parse_columns(args.columns))
        parts = split(log, args.split)
        first = retrieval_config.preset(args.preset)
        second = ranking_config.preset(args.preset, history_length=first.history_length, **overrides)
        first.validate(num_items=log.num_items)
        second.validate(has_ratings=log.rating is not None)
        if args.top_k > log.num_items:
            raise ValueError(f"--top-k {args.top_k} is larger than the catalogue ({log.num_items})")
    except (DataError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    retrieval_model, inputs, _ = fit_retrieval(log, parts, first, run_dir=args.out)
    hard = {part: top_candidates(retrieval_model, inputs, part, 50, exclude_seen=False)
            for part in ("train", "validation")}
    test_candidates = top_candidates(retrieval_model, inputs, "test", args.top_k)
    signal = RetrievalSignal(**embeddings_for_ranking(retrieval_model, inputs))
    model, summary = fit(inputs, second, hard=hard, run_dir=args.out, retrieval=signal)
    report = {"ranking": {"test": evaluate(model, inputs, "test", hard=test_candidates),
                          "train": {k: v for k, v in summary.items() if k != "history"}},
              "retrieval": {"test": evaluate_model(retrieval_model, inputs, "test", ks=(10,))},
              "two_stage": {"test": two_stage_metrics(model, inputs, "test", test_candidates)},
              "exports": {"ranking": export(model, inputs, os.path.join(args.out, "export", "ranking"))}}
    with open(os.path.join(args.out, "ranking_report.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
