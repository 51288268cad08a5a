"""The run's report: RUN/report.json (every result), RUN/report.md (for people) and
RUN/plots/*.png, written from the results the run's steps produced. A section a run did not
produce (ranking, in a retrieval-only run) is left out."""
from __future__ import annotations

import json
import os

from tworec.evaluation import KS


def read(out: str) -> dict:
    """The report a run folder already has (a continued run adds to it), or an empty one."""
    path = os.path.join(out, "report.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def write(out: str, report: dict) -> None:
    """Writes report.json, the plots and report.md."""
    os.makedirs(os.path.join(out, "plots"), exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=float)
    plots = plot(out, report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(report, out, plots))


def _training_summaries(out: str) -> dict[str, dict]:
    """stage -> its per-epoch logs, from the RUN/STAGE_train.json files present."""
    summaries = {}
    for stage in ("retrieval", "ranking"):
        path = os.path.join(out, f"{stage}_train.json")
        if os.path.exists(path):
            with open(path) as f:
                summaries[stage] = json.load(f)["history"]
    return summaries


def plot(out: str, report: dict) -> list[str]:
    """Draws the plots the report's sections allow; returns their file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(figure, name: str) -> None:
        figure.tight_layout()
        figure.savefig(os.path.join(out, "plots", name), dpi=100)
        plt.close(figure)
        written.append(name)

    summaries = _training_summaries(out)
    if summaries:
        figure, axes = plt.subplots(1, len(summaries), figsize=(5 * len(summaries), 4),
                                    squeeze=False)
        for axis, (name, history) in zip(axes[0], summaries.items()):
            for key in ("loss", "val_loss"):
                if key in history:
                    axis.plot(range(1, len(history[key]) + 1), history[key], marker="o", label=key)
            axis.set(title=f"{name} loss per epoch", xlabel="epoch", ylabel="loss")
            axis.legend()
        save(figure, "training.png")

    curves = {name: report[section]["test"] for name, section in
              (("retrieval", "retrieval"), ("two-stage", "two_stage")) if section in report}
    curves.update({name: metrics for name, metrics in report.get("baselines", {}).items() if metrics})
    if curves:
        figure, axis = plt.subplots(figsize=(6, 4))
        for name, metrics in curves.items():
            ks = [k for k in KS if f"recall@{k}" in metrics]
            axis.plot(ks, [metrics[f"recall@{k}"] for k in ks], marker="o", label=name)
        axis.set(title="test Recall@K", xlabel="K", ylabel="recall", xscale="log")
        axis.legend()
        save(figure, "recall_at_k.png")

    if "index" in report:
        index = report["index"]
        figure, axis = plt.subplots(figsize=(6, 4))
        axis.scatter([r["latency_ms_p50"] for r in index["table"]],
                     [r["recall"] for r in index["table"]], label="ScaNN settings")
        axis.axvline(index["exact_latency_ms_p50"], color="grey", linestyle="--",
                     label="brute force")
        axis.set(title="ScaNN recall against latency", xlabel="single-query latency p50 (ms)",
                 ylabel="recall vs exact")
        axis.legend()
        save(figure, "index.png")
    return written


def markdown(report: dict, out: str, plots: list[str]) -> str:
    """report.md: data, metrics against the baselines, ranking, index, serving, timings."""
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
             "| model | Recall@10 | NDCG@10 |", "| --- | --- | --- |"]
    for name, section in (("retrieval (two-tower)", "retrieval"),
                          ("two-stage (retrieval + ranking)", "two_stage")):
        if section in report:
            lines.append(row(name, report[section]["test"]))
    lines += [row(name, metrics) for name, metrics in report.get("baselines", {}).items() if metrics]
    if "ranking" in report:
        ranking = report["ranking"]["test"]
        lines += ["", "## Ranking on its own", "",
                  f"RMSE of the rating head: {ranking['rmse']}; AUC of positives over their "
                  f"negatives: {ranking['auc']}."]
    if "index" in report:
        index = report["index"]
        recall = next(value for key, value in index.items() if key.endswith("_vs_exact"))
        lines += ["", "## Candidate index", "",
                  f"ScaNN {index['params']}: recall@10 against exact search {recall}, "
                  f"single-query latency p50 {index['latency_ms_p50']} ms against "
                  f"{index['exact_latency_ms_p50']} ms for brute force."]
    if "serving" in report:
        lines += ["", "## Serving", "",
                  f"{report['serving']['smoke_users']} test users were queried over REST and "
                  f"gRPC; the answers matched the in-process models: "
                  f"{report['serving']['matches_in_process']}."]
    if "exports" in report:
        lines += ["", "Serve the exports with the embedded server:", "",
                  f"    python scripts/serve.py --model_config_file {out}/export/models.config", "",
                  "or with TF Serving (every model but `retrieval_scann`, which needs ScaNN's ops):",
                  "", f"    tensorflow_model_server --port=8500 --rest_api_port=8501 "
                  f"--model_config_file={os.path.abspath(out)}/export/models.config"]
    lines += ["", "## Timings (seconds)", "", "| step | seconds |", "| --- | --- |"]
    lines += [f"| {name} | {seconds} |" for name, seconds in report["timings"].items()]
    lines += ["", "Plots: " + ", ".join(f"`plots/{name}`" for name in plots) + ".", ""]
    return "\n".join(lines)
