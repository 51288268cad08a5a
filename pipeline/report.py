"""The run's report: RUN/report.json (every result), RUN/report.md (for people),
RUN/report.html (the same with the plots inline, one file to share) and RUN/plots/*.png,
written from the results the run's steps produced. A section a run did not produce (ranking,
in a retrieval-only run) is left out."""
from __future__ import annotations

import base64
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


def warnings_of(report: dict) -> list[str]:
    """A line for every model that does worse than a baseline on test Recall@10 or NDCG@10,
    and for a two-stage list that does worse than retrieval alone."""
    def test(section):
        return (report.get(section) or {}).get("test") or {}
    lines = []
    comparisons = [("retrieval", test("retrieval"), name, metrics)
                   for name, metrics in (report.get("baselines") or {}).items() if metrics]
    comparisons += [("two-stage", test("two_stage"), name, metrics)
                    for name, metrics in (report.get("baselines") or {}).items() if metrics]
    comparisons.append(("two-stage", test("two_stage"), "retrieval alone", test("retrieval")))
    for model, ours, name, theirs in comparisons:
        for metric in ("recall@10", "ndcg@10"):
            if metric in ours and metric in theirs and ours[metric] < theirs[metric]:
                lines.append(f"{model} does worse than {name} on test {metric}: "
                             f"{ours[metric]:.4f} against {theirs[metric]:.4f}")
    return lines


def write(out: str, report: dict) -> None:
    """Writes report.json, the plots and report.md."""
    report["warnings"] = warnings_of(report)
    os.makedirs(os.path.join(out, "plots"), exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=float)
    plots = plot(out, report)
    text = markdown(report, out, plots)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "report.html"), "w") as f:
        f.write(html(text, out, plots))


def html(text: str, out: str, plots: list[str]) -> str:
    """report.md as one self-contained HTML page: Python-Markdown's rendering, the plots
    embedded as data URIs, no external resource."""
    import markdown as markdown_library
    body = markdown_library.markdown(text, extensions=["tables"])
    for name in plots:
        with open(os.path.join(out, "plots", name), "rb") as f:
            data = base64.b64encode(f.read()).decode()
        body += f'<figure><img alt="{name}" src="data:image/png;base64,{data}"></figure>\n'
    return ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>tworec run report"
            "</title><style>body{font-family:sans-serif;max-width:60em;margin:2em auto;"
            "line-height:1.4}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:.2em .6em;text-align:right}img{max-width:100%}pre{background:#f4f4f4;"
            "padding:.5em;overflow-x:auto}</style></head><body>\n" + body + "</body></html>\n")


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
    from matplotlib.ticker import MaxNLocator

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
            axis.set(title=f"{name} per epoch", xlabel="epoch", ylabel="loss")
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
            handles = axis.get_legend_handles_labels()
            if "val_recall@10" in history:             # the metric early stopping follows
                twin = axis.twinx()
                values = history["val_recall@10"]
                twin.plot(range(1, len(values) + 1), values, marker="s", color="tab:green",
                          label="val_recall@10")
                twin.set_ylabel("validation recall@10")
                more = twin.get_legend_handles_labels()
                handles = (handles[0] + more[0], handles[1] + more[1])
            axis.legend(*handles, loc="best")
        save(figure, "training.png")

    curves = {name: report[section]["test"] for name, section in
              (("retrieval", "retrieval"), ("two-stage", "two_stage"))
              if (report.get(section) or {}).get("test")}
    curves.update({name: metrics for name, metrics in report.get("baselines", {}).items() if metrics})
    if curves:
        figure, axis = plt.subplots(figsize=(8, 4))
        for name, metrics in curves.items():
            ks = [k for k in KS if f"recall@{k}" in metrics]
            axis.plot(ks, [metrics[f"recall@{k}"] for k in ks], marker="o", label=name)
        axis.set(title="test Recall@K", xlabel="K", ylabel="recall", xscale="log")
        axis.set_xticks(KS, [str(k) for k in KS])
        axis.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))    # beside, never over a curve
        save(figure, "recall_at_k.png")

    if "index" in report:
        index = report["index"]
        figure, axis = plt.subplots(figsize=(6, 4))
        axis.scatter([r["latency_ms_p50"] for r in index["table"]],
                     [r["recall"] for r in index["table"]], label="ScaNN settings")
        axis.axvline(index["exact_latency_ms_p50"], color="grey", linestyle="--",
                     label="brute force")
        chosen = [row for row in index["table"] if index["params"] and all(
            row[key] == value for key, value in index["params"].items())]
        if chosen:
            axis.scatter([chosen[0]["latency_ms_p50"]], [chosen[0]["recall"]], s=160,
                         facecolors="none", edgecolors="red", linewidths=2, label="chosen")
            axis.annotate(f"{chosen[0]['num_leaves']} leaves, search "
                          f"{chosen[0]['num_leaves_to_search']}, re-score "
                          f"{chosen[0]['num_reordering_candidates']}",
                          (chosen[0]["latency_ms_p50"], chosen[0]["recall"]),
                          textcoords="offset points", xytext=(8, -14), fontsize=8)
        axis.set(title="ScaNN recall against latency", xlabel="single-query latency p50 (ms)",
                 ylabel="recall vs exact")
        axis.legend()
        save(figure, "index.png")
    return written


PROTOCOLS = {
    "temporal": "per user, the last interaction is held out (test) and the one before it is "
                "validation; other users' later rows stay in training",
    "random": "an 80/20 shuffle of the rows (seed 42), as in the TFRS tutorials; several "
              "held-out rows per user, each scored from the user's training rows",
    "global": "every row after a quantile of time is held out (test), and the same quantile "
              "of the earlier rows is validation; each user is scored from their state frozen "
              "at the cut, users first seen after it get the popular items, and nothing after "
              "the cut reaches any fitted statistic",
    "none": "every row trains; nothing is held out, so nothing is evaluated (the deployment run)",
}


def scann_sentence(params: dict) -> str:
    """A ScaNN setting in words."""
    return (f"ScaNN with {params['num_leaves']} leaves, searching "
            f"{params['num_leaves_to_search']} of them and re-scoring the best "
            f"{params['num_reordering_candidates']} exactly")


def markdown(report: dict, out: str, plots: list[str]) -> str:
    """report.md: data, metrics against the baselines, ranking, index, serving, timings."""
    def row(name, metrics):
        return f"| {name} | {metrics['recall@10']:.4f} | {metrics['ndcg@10']:.4f} |"
    data = report["data"]
    state = data.get("state", {})
    excluded = ("each user's known items excluded, as the exports serve"
                if data.get("exclude_seen", True) else "nothing excluded (repeats allowed)")
    lines = [f"# Run report: {data['source']}", "",
             f"{data['users']} users, {data['items']} items, {data['interactions']} interactions; "
             f"split `{data['split']}` with {data['test_users']} test users; dropped rows: "
             f"{data['dropped'] or 'none'}.", "",
             f"Protocol `{data['split']}`: {PROTOCOLS[data['split'].partition(':')[0]]}. "
             f"The exports know the "
             f"{state.get('rows', '?')} training and validation rows of {state.get('users', '?')} "
             f"users, never the test rows.", "",
             "## Test Recall@10 and NDCG@10", "",
             f"Full catalogue, {excluded}. Over the full catalogue a tie counts against the "
             "held-out item; where the order is the one served (retrieval's candidates "
             "re-ranked, the popular order for users the exports do not know) ties keep the "
             "served order. The baselines are fit on the same training rows.", "",
             "| model | Recall@10 | NDCG@10 |", "| --- | --- | --- |"]
    for name, section in (("retrieval (two-tower)", "retrieval"),
                          ("two-stage (retrieval + ranking)", "two_stage")):
        if (report.get(section) or {}).get("test"):
            lines.append(row(name, report[section]["test"]))
    lines += [row(name, metrics) for name, metrics in report.get("baselines", {}).items() if metrics]
    lines += [""] + [f"- **Warning:** {line}." for line in report.get("warnings", [])]
    if (report.get("ranking") or {}).get("test"):
        ranking = report["ranking"]["test"]
        rmse = "none (no ratings)" if ranking["rmse"] is None else f"{ranking['rmse']:.3f}"
        auc = "not computed" if ranking["auc"] is None else f"{ranking['auc']:.3f}"
        lines += ["", "## Ranking on its own", "",
                  f"RMSE of the rating head: {rmse}. AUC of each held-out item against "
                  f"retrieval's top candidates for its user (the items it must beat when "
                  f"served): {auc}."]
    if "index" in report:
        index = report["index"]
        recall = next(value for key, value in index.items()
                      if key.endswith("_vs_exact") and not key.startswith("test_"))
        test = next((value for key, value in index.items() if key.startswith("test_")), None)
        lines += ["", "## Candidate index", ""]
        if index["params"] is None:
            lines.append("No ScaNN setting reached the recall target; only the brute-force "
                         "export is written.")
        else:
            lines.append(
                f"{scann_sentence(index['params'])}, tuned on {index['tuned_on']} queries, finds "
                f"{recall:.1%} of the exact top 10 there"
                + (f" and {test:.1%} on test queries" if test is not None else "")
                + f"; one query takes {index['latency_ms_p50']:.2f} ms (p50) against "
                f"{index['exact_latency_ms_p50']:.2f} ms for brute force.")
        if "exported" in index:
            exported = index["exported"]
            lines.append(f"The `retrieval_scann` export fetches {exported['fetch']} items per "
                         f"query so that k unseen ones remain, so it searches with "
                         f"{scann_sentence(exported)[len('ScaNN with '):]}.")
    if "serving" in report:
        serving = report["serving"]
        lines += ["", "## Served", "",
                  f"The exports were served by the embedded server and asked for "
                  f"{serving['users']} test users over REST and gRPC (identical answers). "
                  "Recall@10 and NDCG@10 of the served lists:", "",
                  "| served model | Recall@10 | NDCG@10 | seen items served |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {figures.get('recall@10', float('nan')):.4f} | "
                  f"{figures.get('ndcg@10', float('nan')):.4f} | {figures['seen_items_served']} |"
                  for name, figures in serving["served"].items()]
        lines += ["", f"The ranking export's scores differ from the Keras ranker's by at most "
                  f"{serving['ranking_export_max_abs_diff']:.1e}."]
    if "exports" in report:
        root = os.path.abspath(out)
        lines += ["", "## Serve", "",
                  "With the embedded server (every model, `retrieval_scann` included):", "",
                  f"    python scripts/serve.py --model_config_file={root}/export/models_scann.config",
                  "", "With TF Serving (every model but `retrieval_scann`, which needs ScaNN's ops):",
                  "", f"    tensorflow_model_server --port=8500 --rest_api_port=8501 "
                  f"--model_config_file={root}/export/models.config", "",
                  "or its Docker image, with the config written for the container's `/models`:",
                  "", f"    docker run -p 8500:8500 -p 8501:8501 -v {root}/export:/models "
                  "tensorflow/serving --model_config_file=/models/models.docker.config"]
    lines += ["", "## Timings (seconds)", "", "| step | seconds |", "| --- | --- |"]
    lines += [f"| {name} | {seconds:.1f} |" for name, seconds in report["timings"].items()]
    lines += ["", "Plots: " + ", ".join(f"`plots/{name}`" for name in plots) + ".", ""]
    return "\n".join(lines)
