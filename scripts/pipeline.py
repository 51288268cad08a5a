"""One command from a log to served recommendations and a report.

    python scripts/pipeline.py --data SOURCE --out RUN [--split temporal|random]
        [--preset tiny|default] [--epochs N]

Steps: load and split, train retrieval, tune the ScaNN index, train ranking on retrieval's
candidates, export every model with `models.config`, serve them with the embedded server on
free ports, query test users over REST and gRPC against the in-process models, and write
RUN/report.json, RUN/report.md and RUN/plots/.
"""
import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time


import numpy as np

from tworec.features import DataError, load, split
from tworec.features.evaluation import KS, baselines, eval_set
from tworec.features.sources import parse_columns
from tworec.ranking import config as ranking_config
from tworec.ranking.export import export as export_ranking
from tworec.ranking.train import (RetrievalSignal, evaluate as evaluate_ranking, fit as fit_ranking,
                           two_stage_metrics)
from tworec.retrieval import config as retrieval_config
from tworec.retrieval.export import export as export_retrieval
from tworec.retrieval.index import ScannParams, exact_top_k, tune_scann
from tworec.retrieval.train import (candidate_embeddings, embeddings_for_ranking, evaluate_model,
                             fit as fit_retrieval, latest_queries, query_embeddings,
                             top_candidates)
from tworec.serving.client import Client
from tworec.serving.compose import compose_recommender
from tworec.serving.layout import write_models_config, write_version
from tworec.serving.manager import ModelManager, parse_config
from tworec.serving.recommender import Recommender
from tworec.serving.server import ModelServer

SMOKE_USERS = 8


class StepFailed(RuntimeError):
    pass


@contextlib.contextmanager
def step(name: str, timings: dict):
    """Logs a step and its duration; a failure names the step and keeps what was written."""
    print(f"[pipeline] {name} ...", flush=True)
    start = time.perf_counter()
    try:
        yield
    except Exception as error:
        raise StepFailed(f"step '{name}' failed: {type(error).__name__}: {error}") from error
    timings[name] = round(time.perf_counter() - start, 2)
    print(f"[pipeline] {name}: {timings[name]} s", flush=True)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="synthetic")
    parser.add_argument("--columns", default="")
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--split", default="temporal", choices=["temporal", "random"])
    parser.add_argument("--preset", default="default", choices=sorted(retrieval_config.PRESETS))
    parser.add_argument("--epochs", type=int, help="epochs of both stages")
    parser.add_argument("--top-k", type=int, default=100, help="retrieval candidates to re-rank")
    parser.add_argument("--top-n", type=int, default=10, help="items the recommender returns")
    return parser.parse_args(argv)


def configs(args, num_items: int, has_ratings: bool):
    epochs = {} if args.epochs is None else {"epochs": args.epochs}
    first = retrieval_config.preset(args.preset, k=min(args.top_k, num_items), **epochs)
    second = ranking_config.preset(args.preset, history_length=first.history_length, **epochs)
    first.validate(num_items=num_items)
    second.validate(has_ratings=has_ratings)
    return first, second


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        log = load(args.data, columns=parse_columns(args.columns))
        parts = split(log, args.split)
        first, second = configs(args, log.num_items, log.rating is not None)
    except (DataError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    os.makedirs(os.path.join(args.out, "plots"), exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({"args": vars(args), "retrieval": dataclasses.asdict(first),
                   "ranking": dataclasses.asdict(second)}, f, indent=2)
    try:
        report = run(args, log, parts, first, second)
    except StepFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(json.dumps({"retrieval": report["retrieval"]["test"], "two_stage": report["two_stage"]["test"],
                      "serving": report["serving"]}))
    return 0


def run(args, log, parts, first, second) -> dict:
    timings, report = {}, {}
    exclude = parts.kind == "temporal"
    test_users = np.unique(log.user[parts.test])
    report["data"] = {"source": args.data, "users": log.num_users, "items": log.num_items,
                      "interactions": len(log), "split": parts.kind,
                      "test_users": int(len(test_users)), "dropped": dict(log.dropped)}
    with step("train retrieval", timings):
        retrieval_model, inputs, retrieval_summary = fit_retrieval(log, parts, first, run_dir=args.out)
        test_set = eval_set(log, parts, "test", exclude_seen=exclude)
        retrieval_test = evaluate_model(retrieval_model, inputs, "test", evalset=test_set)
        report["retrieval"] = {"test": retrieval_test,
                               "train": {k: retrieval_summary[k] for k in
                                         ("seconds", "epochs", "examples_per_second")},
                               "loss": retrieval_summary["loss"]}
    with step("baselines", timings):
        report["baselines"] = baselines(log, parts, test_set)
    with step("tune index", timings):
        candidates = candidate_embeddings(retrieval_model, inputs.num_items)
        queries = query_embeddings(retrieval_model, inputs.examples["test"])[:200]
        tuning = tune_scann(candidates, queries, k=min(10, inputs.num_items))
        report["index"] = {"kind": "scann", "params": tuning["params"],
                           "recall@10_vs_exact": tuning["recall@10_vs_exact"],
                           "latency_ms_p50": tuning["latency_ms_p50"],
                           "exact_latency_ms_p50": tuning["exact_latency_ms_p50"],
                           "table": tuning["table"]}
    with step("train ranking", timings):
        hard = {part: top_candidates(retrieval_model, inputs, part, min(50, inputs.num_items),
                                     exclude_seen=False) for part in ("train", "validation")}
        test_candidates = top_candidates(retrieval_model, inputs, "test", first.k, exclude_seen=exclude)
        signal = RetrievalSignal(**embeddings_for_ranking(retrieval_model, inputs))
        ranking_model, ranking_summary = fit_ranking(inputs, second, hard=hard, run_dir=args.out,
                                                     retrieval=signal)
        report["ranking"] = {"test": evaluate_ranking(ranking_model, inputs, "test", hard=test_candidates),
                             "train": {k: ranking_summary[k] for k in ("seconds", "examples_per_second")}}
        report["two_stage"] = {"test": two_stage_metrics(ranking_model, inputs, "test",
                                                         test_candidates, ks=KS)}
    smoke = log.user_ids[test_users[:SMOKE_USERS]]
    with step("export", timings):
        report["exports"] = export_all(args, inputs, retrieval_model, ranking_model, tuning, smoke)
    with step("serve and check", timings):
        report["serving"] = serve_and_check(args, inputs, retrieval_model, smoke)
    report["timings"] = timings
    with step("report", timings):
        write_report(args.out, report, retrieval_summary, ranking_summary)
    return report


def export_all(args, inputs, retrieval_model, ranking_model, tuning, smoke) -> dict:
    export_dir = os.path.join(args.out, "export")
    paths = {"retrieval": export_retrieval(retrieval_model, inputs, os.path.join(export_dir, "retrieval"),
                                           warmup_users=smoke)}
    if tuning["params"]:
        paths["retrieval_scann"] = export_retrieval(
            retrieval_model, inputs, os.path.join(export_dir, "retrieval_scann"),
            scann=ScannParams(**tuning["params"]), warmup_users=smoke)
    items = inputs.interactions.item_ids
    paths["ranking"] = export_ranking(ranking_model, inputs, os.path.join(export_dir, "ranking"),
                                      warmup={"user_id": smoke,
                                              "item_ids": np.tile(items[:10], (len(smoke), 1))})
    paths["recommender"] = write_version(
        os.path.join(export_dir, "recommender"),
        lambda path: compose_recommender(paths["retrieval"], paths["ranking"], path, args.top_n,
                                         warmup_user_ids=list(smoke)))
    write_models_config(os.path.join(export_dir, "models.config"),
                        {name: os.path.dirname(path) for name, path in paths.items()})
    return paths


def serve_and_check(args, inputs, retrieval_model, smoke) -> dict:
    """Serves the exports on free ports; checks REST, gRPC and in-process answers agree."""
    with open(os.path.join(args.out, "export", "models.config")) as f:
        manager = ModelManager(parse_config(f.read()), poll_seconds=0)
    server = ModelServer(manager, grpc_port=0, rest_port=0).start()
    try:
        rest = Client(url=f"http://127.0.0.1:{server.rest_port}")
        grpc = Client(grpc_target=f"127.0.0.1:{server.grpc_port}")
        served = rest.predict("retrieval", {"user_id": smoke})["item_ids"]
        order = np.argsort(inputs.interactions.user_ids)
        users = order[np.searchsorted(inputs.interactions.user_ids[order], smoke)]
        queries = latest_queries(retrieval_model, inputs)[users]
        expected = inputs.interactions.item_ids[exact_top_k(
            candidate_embeddings(retrieval_model, inputs.num_items), queries, served.shape[1])]
        retrieval_matches = bool(np.array_equal(_strings(served), expected))
        composed_rest = rest.predict("recommender", {"user_id": smoke})
        composed_grpc = grpc.predict("recommender", {"user_id": smoke})
        two_stage = Recommender(grpc).recommend(smoke, n=args.top_n)
        recommender_matches = bool(
            np.array_equal(_strings(composed_rest["item_ids"]), _strings(composed_grpc["item_ids"]))
            and np.array_equal(_strings(composed_rest["item_ids"]), _strings(two_stage["item_ids"])))
        rest.close()
        grpc.close()
    finally:
        server.stop()
    return {"smoke_users": int(len(smoke)), "retrieval_matches_keras": retrieval_matches,
            "recommender_rest_grpc_recommender_agree": recommender_matches,
            "matches_in_process": retrieval_matches and recommender_matches}


def _strings(values) -> np.ndarray:
    values = np.asarray(values)
    return np.vectorize(lambda v: v.decode() if isinstance(v, bytes) else str(v))(values) \
        if values.size else values.astype(str)


def write_report(out: str, report: dict, retrieval_summary: dict, ranking_summary: dict) -> None:
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=float)
    plot(out, report, retrieval_summary, ranking_summary)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(report, out))


def plot(out: str, report: dict, retrieval_summary: dict, ranking_summary: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, (name, history) in zip(axes, (("retrieval", retrieval_summary["history"]),
                                            ("ranking", ranking_summary["history"]))):
        for key in ("loss", "val_loss"):
            if key in history:
                axis.plot(range(1, len(history[key]) + 1), history[key], marker="o", label=key)
        axis.set(title=f"{name} loss per epoch", xlabel="epoch", ylabel="loss")
        axis.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(out, "plots", "training.png"), dpi=100)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(6, 4))
    curves = {"retrieval": report["retrieval"]["test"], "two-stage": report["two_stage"]["test"]}
    curves.update({name: metrics for name, metrics in report["baselines"].items() if metrics})
    for name, metrics in curves.items():
        ks = [k for k in KS if f"recall@{k}" in metrics]
        axis.plot(ks, [metrics[f"recall@{k}"] for k in ks], marker="o", label=name)
    axis.set(title="test Recall@K", xlabel="K", ylabel="recall", xscale="log")
    axis.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(out, "plots", "recall_at_k.png"), dpi=100)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(6, 4))
    table = report["index"]["table"]
    axis.scatter([r["latency_ms_p50"] for r in table], [r["recall"] for r in table], label="ScaNN settings")
    axis.axvline(report["index"]["exact_latency_ms_p50"], color="grey", linestyle="--", label="brute force")
    axis.set(title="ScaNN recall@10 against latency", xlabel="single-query latency p50 (ms)",
             ylabel="recall@10 vs exact")
    axis.legend()
    figure.tight_layout()
    figure.savefig(os.path.join(out, "plots", "index.png"), dpi=100)
    plt.close(figure)


def markdown(report: dict, out: str) -> str:
    def row(name, metrics):
        return f"| {name} | {metrics['recall@10']:.4f} | {metrics['ndcg@10']:.4f} |"
    data = report["data"]
    lines = [f"# Run report: {data['source']}", "",
             f"{data['users']} users, {data['items']} items, {data['interactions']} interactions; "
             f"split `{data['split']}` with {data['test_users']} test users; dropped rows: "
             f"{data['dropped'] or 'none'}.", "",
             "## Test Recall@10 and NDCG@10", "",
             "Full catalogue, each user's earlier items excluded (temporal split); the baselines "
             "are fit on the same training rows.", "",
             "| model | Recall@10 | NDCG@10 |", "| --- | --- | --- |",
             row("retrieval (two-tower)", report["retrieval"]["test"]),
             row("two-stage (retrieval + ranking)", report["two_stage"]["test"])]
    lines += [row(name, metrics) for name, metrics in report["baselines"].items() if metrics]
    ranking = report["ranking"]["test"]
    index = report["index"]
    lines += ["", "## Ranking on its own", "",
              f"RMSE of the rating head: {ranking['rmse']}; AUC of positives over their "
              f"negatives: {ranking['auc']}.", "",
              "## Candidate index", "",
              f"ScaNN {index['params']}: recall@10 against exact search "
              f"{index['recall@10_vs_exact']}, single-query latency p50 {index['latency_ms_p50']} ms "
              f"against {index['exact_latency_ms_p50']} ms for brute force.", "",
              "## Serving", "",
              f"{report['serving']['smoke_users']} test users were queried over REST and gRPC; the "
              f"answers matched the in-process models: {report['serving']['matches_in_process']}.", "",
              "Serve the exports with the embedded server:", "",
              f"    python scripts/serve.py --model_config_file {out}/export/models.config", "",
              "or with TF Serving (every model but `retrieval_scann`, which needs ScaNN's ops):", "",
              f"    tensorflow_model_server --port=8500 --rest_api_port=8501 "
              f"--model_config_file={os.path.abspath(out)}/export/models.config", "",
              "## Timings (seconds)", "", "| step | seconds |", "| --- | --- |"]
    lines += [f"| {name} | {seconds} |" for name, seconds in report["timings"].items()]
    lines += ["", "Plots: `plots/training.png`, `plots/recall_at_k.png`, `plots/index.png`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
