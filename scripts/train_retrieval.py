"""Trains the two-tower retrieval model, evaluates it beside the baselines, tunes a ScaNN index
and exports `retrieval` (brute force) and `retrieval_scann` SavedModels.

    python scripts/train_retrieval.py --data SOURCE --out RUN [--split temporal|random]
        [--preset tiny|default] [--epochs N] [--strategy default|mirrored|multi_worker]
"""
import argparse
import dataclasses
import json
import os
import sys



from tworec.features import DataError, load, split
from tworec.features.evaluation import baselines, eval_set
from tworec.features.sources import parse_columns
from tworec.retrieval.config import PRESETS, preset
from tworec.retrieval.index import ScannParams, tune_scann
from tworec.retrieval.train import candidate_embeddings, evaluate_model, fit, query_embeddings


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--columns", default="")
    parser.add_argument("--out", required=True, help="run folder")
    parser.add_argument("--split", default="temporal", choices=["temporal", "random"])
    parser.add_argument("--preset", default="default", choices=sorted(PRESETS))
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--history-encoder", choices=["none", "mean", "gru", "transformer"])
    parser.add_argument("--strategy", choices=["default", "mirrored", "multi_worker"])
    parser.add_argument("--mixed-precision", action="store_true")
    parser.add_argument("--jit-compile", action="store_true")
    parser.add_argument("--no-export", action="store_true")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    overrides = {name: value for name, value in (
        ("epochs", args.epochs), ("batch_size", args.batch_size),
        ("history_encoder", args.history_encoder), ("strategy", args.strategy)) if value is not None}
    if args.mixed_precision:
        overrides["mixed_precision"] = True
    if args.jit_compile:
        overrides["jit_compile"] = True
    try:
        config = preset(args.preset, **overrides)
        log = load(args.data, columns=parse_columns(args.columns))
        parts = split(log, args.split)
        config.validate(num_items=log.num_items)
    except (DataError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    model, data, summary = fit(log, parts, config, run_dir=args.out)
    test = eval_set(log, parts, "test", exclude_seen=args.split == "temporal")
    report = {"config": dataclasses.asdict(config), "data": log.summary(),
              "test": evaluate_model(model, data, "test", evalset=test),
              "baselines": baselines(log, parts, test) if args.split == "temporal" else None,
              "train": {k: v for k, v in summary.items() if k != "history"}}
    candidates = candidate_embeddings(model, data.num_items)
    queries = query_embeddings(model, data.examples["test"])[:200]
    if len(candidates) >= 10 and len(queries):
        report["index"] = tune_scann(candidates, queries, k=10)
    if not args.no_export:
        from tworec.retrieval.export import export
        export_dir = os.path.join(args.out, "export")
        report["exports"] = {"retrieval": export(model, data, os.path.join(export_dir, "retrieval"))}
        params = (report.get("index") or {}).get("params")
        if params:
            report["exports"]["retrieval_scann"] = export(
                model, data, os.path.join(export_dir, "retrieval_scann"), scann=ScannParams(**params))
    with open(os.path.join(args.out, "retrieval_report.json"), "w") as f:
        json.dump(report, f, indent=2, default=float)
    print(json.dumps({"test": report["test"], "baselines": report["baselines"]}, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
