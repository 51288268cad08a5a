"""The run's report: RUN/report.json (every result), RUN/report.md (for people),
RUN/report.html (the same with the plots inline, one file to share) and RUN/plots/*.png,
written from the results the run's steps produced. A section a run did not produce (ranking,
in a retrieval-only run) is left out."""
from __future__ import annotations

import base64
import json
import os
import re

from tworec.evaluation import KS


def read(out: str) -> dict:
    """The report a run folder already has (a continued run adds to it), or an empty one."""
    path = os.path.join(out, "report.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} cannot be read as a run's report ({error})") from None


# How the report names each baseline of `evaluation.baselines`.
BASELINE_NAMES = {"popularity": "popularity", "ease": "EASE",
                  "item_transition": "item transitions",
                  "popular_now": "popular now (the list users never seen get)"}


def baselines_of(report: dict) -> list[tuple[str, dict]]:
    """[(display name, test metrics)] of the baselines the report holds figures for."""
    return [(BASELINE_NAMES.get(key, key), metrics)
            for key, metrics in (report.get("baselines") or {}).items() if metrics]


def warnings_of(report: dict) -> list[str]:
    """A line for every model that does worse than a baseline on test Recall@10 or NDCG@10,
    and for a two-stage list that does worse than retrieval alone, with the 95% interval of
    the difference where the run computed it."""
    def section(name):
        return report.get(name) or {}
    baselines = [(key, BASELINE_NAMES.get(key, key), metrics)
                 for key, metrics in (report.get("baselines") or {}).items() if metrics]
    comparisons = [(model, section(name), display, metrics,
                    section(name).get("against_baselines", {}).get(key))
                   for model, name in (("retrieval", "retrieval"), ("two-stage", "two_stage"))
                   for key, display, metrics in baselines]
    comparisons.append(("two-stage", section("two_stage"), "retrieval alone",
                        section("retrieval").get("test") or {},
                        section("two_stage").get("gain_over_retrieval")))
    lines = []
    for model, ours, name, theirs, paired in comparisons:
        ours = ours.get("test") or {}
        for metric in ("recall@10", "ndcg@10"):
            if metric in ours and metric in theirs and ours[metric] < theirs[metric]:
                interval = (paired or {}).get(metric)
                lines.append(f"{model} does worse than {name} on test {metric}: "
                             f"{ours[metric]:.4f} against {theirs[metric]:.4f}"
                             + ("" if not interval else
                                " (difference {:+.4f}, 95% interval {:+.4f} to {:+.4f})".format(
                                    interval["difference"], *interval["ci95"])))
    return lines


def write(out: str, report: dict) -> None:
    """Writes the plots, report.md, report.html and, last, report.json (a finished run's mark),
    each file whole or not at all."""
    report["warnings"] = warnings_of(report)
    os.makedirs(os.path.join(out, "plots"), exist_ok=True)
    plots = plot(out, report)
    text = markdown(report, out, plots)
    for name, content in (("report.md", text), ("report.html", html(text, out, plots)),
                          ("report.json", json.dumps(report, indent=2, default=float))):
        path = os.path.join(out, name)
        with open(path + ".tmp", "w") as f:
            f.write(content)
        os.replace(path + ".tmp", path)


def html(text: str, out: str, plots: list[str]) -> str:
    """report.md as one self-contained HTML page: Python-Markdown's rendering, the plots
    embedded where report.md shows them, as data URIs; no external resource."""
    import markdown as markdown_library
    body = markdown_library.markdown(text, extensions=["tables"])
    for name in plots:                         # where report.md shows them: in their section
        with open(os.path.join(out, "plots", name), "rb") as f:
            data = base64.b64encode(f.read()).decode()
        body = body.replace(f'src="plots/{name}"', f'src="data:image/png;base64,{data}"')
    return ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>tworec run report"
            "</title><style>body{font-family:sans-serif;max-width:60em;margin:2em auto;"
            "line-height:1.4}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
            "padding:.2em .6em;text-align:right}img{max-width:100%}pre{background:#f4f4f4;"
            "padding:.5em;overflow-x:auto}</style></head><body>\n" + body + "</body></html>\n")


def _training_summaries(out: str) -> dict[str, dict]:
    """stage -> its training summary (per-epoch logs in "history", "best_epoch"), from the
    RUN/STAGE_train.json files present."""
    summaries = {}
    for stage in ("retrieval", "ranking"):
        path = os.path.join(out, f"{stage}_train.json")
        if os.path.exists(path):
            with open(path) as f:
                summaries[stage] = json.load(f)
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
        for axis, (name, summary) in zip(axes[0], summaries.items()):
            history = summary["history"]
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
            if "best_epoch" in summary:                # the epoch whose weights are kept
                kept = axis.axvline(summary["best_epoch"], color="grey", linestyle=":")
                handles = (handles[0] + [kept],
                           handles[1] + [f"weights kept (epoch {summary['best_epoch']})"])
            axis.legend(*handles, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2,
                        fontsize=8, frameon=False)      # below the axes, never over a curve
        save(figure, "training.png")

    curves = {name: (report[section]["test"], report[section].get("serves"))
              for name, section in (("retrieval", "retrieval"), ("two-stage", "two_stage"))
              if (report.get(section) or {}).get("test")}
    curves.update({name: (metrics, None) for name, metrics in baselines_of(report)})
    if curves:
        figure, axis = plt.subplots(figsize=(8, 4))
        for name, (metrics, serves) in curves.items():     # a model's lists: what it serves
            ks = [k for k in KS if f"recall@{k}" in metrics and k <= (serves or k)]
            axis.plot(ks, [metrics[f"recall@{k}"] for k in ks], marker="o", label=name)
        axis.set(title="test Recall@K", xlabel="K", ylabel="recall", xscale="log")
        axis.set_xticks(KS, [str(k) for k in KS])
        axis.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))    # beside, never over a curve
        save(figure, "recall_at_k.png")

    if "index" in report:
        index = report["index"]
        figure, axis = plt.subplots(figsize=(8, 4))
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
        axis.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))    # beside the points
        save(figure, "index.png")
    return written


PROTOCOLS = {
    "temporal": "per user, the last interaction is held out (test) and the one before it is "
                "validation. It leaks: other users' later rows train the models and the "
                "baselines",
    "random": "an 80/20 shuffle of the rows (seed 42), the TFRS tutorials' protocol; several "
              "held-out rows per user, each scored from the user's training rows. Without "
              "validation, training runs its epochs without early stopping, the ranker's "
              "signals are not calibrated and ScaNN is tuned on training queries. It leaks "
              "the future most: training rows can be later than held-out ones",
    "global": "every row after the {quantile} quantile of time is held out (test), and the "
              "rows after the same quantile of the earlier rows are validation; each user is "
              "scored from their "
              "state frozen at the cut, users first seen after it get the popular items, and "
              "nothing after the cut reaches any fitted statistic; the catalogue is the items "
              "of the rows before the cut: one first seen after it is never served (its "
              "held-out rows are misses), one first seen in validation is scored by its "
              "features and the untrained out-of-vocabulary id",
    "latest": "each user's last row is validation (early stopping, calibration), the rest "
              "train; nothing is tested, so no test metric is reported (the deployment run of "
              "what `temporal` evaluates)",
    "none": "every row trains; nothing is held out, so nothing is evaluated (a deployment run "
            "without validation)",
}
def metric_name(key: str) -> str:
    """"recall@10" -> "Recall@10", "ndcg@10" -> "NDCG@10"."""
    name, _, k = key.partition("@")
    return {"recall": "Recall", "ndcg": "NDCG"}.get(name, name) + f"@{k}"


def protocol_sentence(split: str) -> str:
    """What a split holds out and what it leaks, in words (`global:0.8` names its 0.8)."""
    name, _, quantile = split.partition(":")
    return PROTOCOLS[name].format(quantile=quantile or "0.9")


def scann_sentence(params: dict) -> str:
    """A ScaNN setting in words."""
    return (f"ScaNN with {params['num_leaves']} leaves, searching "
            f"{params['num_leaves_to_search']} of them and re-scoring the best "
            f"{params['num_reordering_candidates']} exactly")


def escape(text: str) -> str:
    """`text` (a title, an id) shown as it is in markdown and in a table cell."""
    return re.sub(r"([\\`*_\[\]|])", r"\\\1", text).replace("<", "&lt;")


def image(name: str, plots: list[str], alt: str) -> list[str]:
    """The markdown lines showing plots/`name`, when it was drawn (html() inlines it)."""
    return ["", f"![{alt}](plots/{name})"] if name in plots else []


def markdown(report: dict, out: str, plots: list[str]) -> str:
    """report.md: the data and protocol, the run's notices, test metrics against the baselines
    with the two-stage gain, training, ranking, the index, the served check, example users, how
    to serve, and timings; each plot inside the section it illustrates."""
    sections = (data_section(report), notices_section(report), metrics_section(report, plots),
                training_section(report, plots), ranking_section(report),
                index_section(report, plots), served_section(report),
                examples_section(report), serve_section(report, out), timings_section(report))
    lines = [line for section in sections for line in section]
    placed = "\n".join(lines)
    for name in plots:                          # a plot no section showed still reaches the page
        if f"(plots/{name})" not in placed:
            lines += image(name, plots, name)
    return "\n".join(lines) + "\n"


def data_section(report: dict) -> list[str]:
    data = report["data"]
    state, split = data.get("state", {}), data["split"]
    dropped = ", ".join(f"{count:,} ({reason.replace('_', ' ')})"
                        for reason, count in data["dropped"].items()) or "none"
    if split in ("none", "latest"):
        held_out = "nothing held out" if split == "none" else "nothing tested"
        known = (f"The exports know all {state.get('rows', 0):,} rows of "
                 f"{state.get('users', 0):,} users as their state (each user's latest and seen "
                 "items, the popular list); the models, their vocabularies and counts are fit "
                 "on the training rows.")
    else:
        rows = data.get("test_rows", data["test_users"])
        held_out = (f"{data['test_users']:,} test users" if rows == data["test_users"] else
                    f"{rows:,} held-out rows of {data['test_users']:,} users")
        fit = "training" if split == "random" else "training and validation"
        known = (f"The exports know the {state.get('rows', 0):,} {fit} rows of "
                 f"{state.get('users', 0):,} users, never the test rows.")
    outside, untrained = data.get("outside_catalogue", 0), data.get("untrained_items", 0)
    if outside and split in ("none", "latest"):
        known += (f" They serve the {state.get('items', 0):,} items of the rows they know: the "
                  f"{outside:,} others, of the item table alone, are never served.")
    elif outside:
        validation = "" if split == "random" else " (validation ranks the training rows' items)"
        known += (f" They serve the {state.get('items', 0):,} items of those rows, the "
                  f"catalogue every test figure ranks{validation}: the {outside:,} others (of "
                  "the item table alone, or first seen in held-out rows) are never served, and "
                  "a held-out row of one is a miss.")
    if untrained:
        known += (f" {untrained:,} served items have validation rows alone: the models score "
                  "them by their features and the untrained out-of-vocabulary id.")
    return [f"# Run report: {data['source']}", "",
            f"{data['users']:,} users, {data['items']:,} items, {data['interactions']:,} "
            f"interactions; split `{split}`, {held_out}; dropped rows: {dropped}.", "",
            f"Protocol `{split}`: {protocol_sentence(split)}. {known}"
            f"{cold_start_sentence(data.get('cold_start'), split)}"]


def notices_section(report: dict) -> list[str]:
    """The settings the run fitted to the log and what it noticed, as the command printed them."""
    notices = report.get("notices") or []
    return ["", "## Notes", ""] + [f"- {escape(notice)}" for notice in notices] if notices else []


def cold_start_sentence(cold_start: dict | None, split: str = "temporal") -> str:
    """What users the exports do not know are served, and how the window was chosen."""
    if not cold_start:
        return ""
    window, table = cold_start["window"], cold_start.get("validation") or {}
    counted = "all of them" if window == 1 else f"the latest {window:.0%} of them"
    if cold_start.get("given"):
        why = " (set in the run's config)"
    elif split == "none":
        why = " (nothing is held out to choose on)"
    elif split == "random":
        why = " (the split has no validation to choose on)"
    elif not cold_start["rows"]:
        why = " (validation holds no rows of users never seen)"
    elif not table:
        why = (f" (validation holds {cold_start['rows']:,} rows of {cold_start['users']:,} "
               "users never seen, too few to choose on)")
    elif window == 1:
        why = (" (on validation no shorter share beat all rows with the 95% interval of its "
               "NDCG@10 gain above zero)")
    else:
        chosen, low, high = table[str(window)], *table[str(window)]["ci95"]
        why = (f" (chosen on validation, on the {cold_start['rows']:,} rows of "
               f"{cold_start['users']:,} users never seen: NDCG@10 {chosen['ndcg@10']:.4f} "
               f"against {table['1.0']['ndcg@10']:.4f} when all rows count, 95% interval of "
               f"the gain over users {low:+.4f} to {high:+.4f})")
    return (f" Users they do not know are served the items most frequent in the known rows, "
            f"counted over {counted}{why}.")


def metrics_section(report: dict, plots: list[str]) -> list[str]:
    """The test metrics table, the two-stage gain over retrieval, warnings, Recall@K plot."""
    def row(name, metrics):
        return f"| {name} | {metrics['recall@10']:.4f} | {metrics['ndcg@10']:.4f} |"
    models = [(name, report[section]["test"]) for name, section in
              (("retrieval (two-tower)", "retrieval"),
               ("two-stage (retrieval + ranking)", "two_stage"))
              if (report.get(section) or {}).get("test")]
    models += baselines_of(report)
    if not models:
        return []
    excluded = ("each user's known items excluded, as the exports serve"
                if report["data"].get("exclude_seen", True) else
                "nothing excluded (repeats allowed)")
    known_rows = "training" if report["data"]["split"] == "random" else "training and validation"
    lines = ["", "## Test Recall@10 and NDCG@10", "",
             f"Full catalogue, {excluded}; each figure is a mean over the held-out rows (a "
             "user with several counts once for each). Over the full catalogue and among the "
             "re-ranked "
             "candidates a tie counts against the held-out item; the popular list of users "
             "the exports do not know is ranked in its strict served order, by both stages. "
             "The models' lists are the ones their exports serve"
             + served_lengths(report) + ": a held-out item past them is a miss. The baselines "
             f"are fit on the same training rows (popular now counts the {known_rows} "
             "rows, as the exports do) and rank as a list of them is served, in one strict "
             "order, not with ties against the held-out item: popularity by training counts, "
             "then item id; popular now in its served order; item transitions by how often an "
             "item followed the user's last item, then as popularity (to float32 precision).",
             "",
             "| model | Recall@10 | NDCG@10 |", "| --- | --- | --- |"]
    lines += [row(name, metrics) for name, metrics in models]
    gain = (report.get("two_stage") or {}).get("gain_over_retrieval") or {}
    lines += [""] + [f"- {gain_sentence(metric_name(metric), figures)}"
                     for metric, figures in gain.items()]
    lines += title_candidates_sentence(report)
    lines += [f"- **Warning:** {line}." for line in report.get("warnings", [])]
    return lines + image("recall_at_k.png", plots, "test Recall@K of every model")


def title_candidates_sentence(report: dict) -> list[str]:
    """One line on the title candidates the two-stage lists re-ranked (report.json's
    `two_stage.title_candidates`) and their share of the items the served check was served;
    none without them."""
    added = (report.get("two_stage") or {}).get("title_candidates")
    if not added:
        return []
    share = ((report.get("serving") or {}).get("served", {}).get("recommender") or {}).get(
        "title_candidate_share")
    served = ("" if share is None else f"; {share:.1%} of the items served to the known users "
              "checked are title candidates")
    return [f"- The two-stage lists re-rank retrieval's candidates and up to {added} title "
            "candidates a known user: the items of the training rows whose titles are most like "
            f"those of the user's latest items{served}."]


def gain_sentence(metric: str, gain: dict) -> str:
    """One line: the two-stage gain over retrieval on `metric` with its 95% interval."""
    ratio = "" if gain["ratio"] is None else f" (×{gain['ratio']:.2f})"
    lo, hi = gain["ci95"]
    units = (f"{gain['units']:,} users" if gain["units"] == gain["rows"] else
             f"{gain['units']:,} users holding {gain['rows']:,} held-out rows, a user's rows "
             "drawn together")
    return (f"Two-stage against retrieval: {metric} {gain['difference']:+.3f}{ratio}, 95% "
            f"interval {lo:+.3f} to {hi:+.3f} (paired bootstrap over {units}).")


def training_section(report: dict, plots: list[str]) -> list[str]:
    stages = [(name, report[name]["train"]) for name in ("retrieval", "ranking")
              if (report.get(name) or {}).get("train")]
    if not stages:
        return []
    lines = ["", "## Training", "",
             "The best epoch is the one whose weights the model keeps: early stopping's best on "
             "validation (Recall@10 for retrieval, the loss for ranking), else the last.", "",
             "| stage | epochs | best epoch | seconds | examples per second |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {name} | {train['epochs']} | {train.get('best_epoch', train['epochs'])} | "
              f"{train['seconds']:.1f} | {train['examples_per_second']:,.0f} |"
              for name, train in stages]
    return lines + image("training.png", plots, "loss and validation metric per epoch")


def ranking_section(report: dict) -> list[str]:
    ranking = (report.get("ranking") or {}).get("test")
    if not ranking:                   # nothing tested: what calibration chose, if it ran
        calibration = ((report.get("ranking") or {}).get("train") or {}).get("calibration")
        refitted = calibration_sentence(calibration)
        return ["", "## Ranking on its own"] + refitted if refitted else []
    rmse = ("none (no rating head: rating_weight 0, or a log without ratings)"
            if ranking["rmse"] is None else f"{ranking['rmse']:.3f}")
    auc = "not computed" if ranking["auc"] is None else f"{ranking['auc']:.3f}"
    regression = report["ranking"].get("task") == "regression"
    scores = "predicted ratings" if regression else "scores"
    model = report["ranking"].get("model")                  # older reports did not say
    calibration = report["ranking"]["train"].get("calibration")
    calibrated = bool(calibration) and "skipped" not in calibration and not regression
    below = (" (0.5 is chance: below it, retrieval's top candidates score above the held-out "
             "item more often than not)" if ranking["auc"] is not None and ranking["auc"] < 0.5
             else "")
    retrieved = ("" if ranking.get("auc_retrieved") is None else
                 f"; {ranking['auc_retrieved']:.3f} over the {ranking['retrieved_rows']:,} "
                 f"held-out items among the up to {ranking['retrieved_among']} candidates of "
                 "their list, the lists it re-orders when served (a held-out item the "
                 "candidates miss is never served, whatever its score)")
    return ["", "## Ranking on its own", "",
            (f"The ranker: {model.upper()}, trained on the {report['ranking']['task']} task. "
             if model else "")
            + f"RMSE of the {'regression ranker' if regression else 'rating head'}: {rmse}. "
            "AUC of each held-out item against retrieval's "
            f"top candidates for its user (the items it must beat when served), by the "
            f"ranker's {scores}{' as balanced below' if calibrated else ''}: {auc}{below}"
            f"{retrieved}."
            ] + calibration_sentence(calibration)


def served_lengths(report: dict) -> str:
    """' (retrieval's top 100, two-stage's top 10)', the lengths the sections record."""
    lengths = [f"{name}'s top {report[section]['serves']}" for name, section in
               (("retrieval", "retrieval"), ("two-stage", "two_stage"))
               if "serves" in (report.get(section) or {})]
    return f" ({', '.join(lengths)})" if lengths else ""


def calibration_sentence(calibration: dict | None) -> list[str]:
    """What `ranking.train.calibrate` refitted, as one paragraph; none when it did not run."""
    if not calibration:
        return []
    if "skipped" in calibration:
        return ["", f"The logit's balance was not refitted: {calibration['skipped']}."]
    weights = ", ".join(f"{name} {weight:.3g}" for name, weight in calibration["weights"].items())
    signals = f", the signal weights {weights}" if weights else ""
    before, after = calibration["loss_before"], calibration["loss_after"]
    unused = (" The ranker's own logit keeps no weight: the two-stage order is that of the "
              "signals alone." if calibration["scale"] == 0 else "")
    return ["", f"The logit's balance was refitted on {calibration['rows']:,} validation lists "
                f"as served (those of users known before validation holding their "
                f"positive): the ranker's own logit × "
                f"{calibration['scale']:.2f}{signals}; their cross-entropy {before:.3f} → "
                f"{after:.3f} (on the lists it was fitted on).{unused}"]


def index_section(report: dict, plots: list[str]) -> list[str]:
    if "index" not in report:
        return []
    index = report["index"]
    key, recall = next((key, value) for key, value in index.items()
                       if key.endswith("_vs_exact") and not key.startswith("test_"))
    k = key[len("recall@"):-len("_vs_exact")]                       # the tuning_k
    test = next((value for key, value in index.items() if key.startswith("test_")), None)
    lines = ["", "## Candidate index", ""]
    if index["params"] is None:
        reason = index.get("skipped") or "No ScaNN setting reached the recall target"
        lines.append(f"{reason}; only the brute-force export is written.")
    else:
        lines.append(
            f"{scann_sentence(index['params'])}, tuned on {index['tuned_on']} queries of users "
            f"the models know, finds {recall:.1%} of the exact top {k} there"
            + (f" and {test:.1%} on their test queries" if test is not None else "")
            + f"; one query takes {index['latency_ms_p50']:.2f} ms (p50) against "
            f"{index['exact_latency_ms_p50']:.2f} ms for brute force's top {k} (timed "
            "separately, not in turn).")
    if "exported" in index:
        exported = index["exported"]
        why = (" so that k unseen ones remain" if (report.get("data") or {}).get(
            "exclude_seen", True) else " (seen items kept: the k it serves)")
        lines.append(f"The `retrieval_scann` export fetches {exported['fetch']} items per "
                     f"query{why}, so it searches with "
                     f"{scann_sentence(exported)[len('ScaNN with '):]}"
                     + ("." if "latency_ms_p50" not in exported else   # older reports
                        f"; one query takes {exported['latency_ms_p50']:.2f} ms (p50) against "
                        f"{exported['exact_latency_ms_p50']:.2f} ms for the brute-force "
                        f"export's search, {scann_verdict(exported)}"
                        + ("." if scann_is_faster(exported) else
                           ": ask `retrieval` instead.")))
    return lines + image("index.png", plots, "ScaNN recall against latency")


def scann_is_faster(exported: dict) -> bool:
    """Whether the ScaNN export's search was found faster than brute force (older reports,
    without a verdict: its median was lower)."""
    if "verdict" in exported:
        return exported["verdict"] == "faster"
    return exported["latency_ms_p50"] < exported["exact_latency_ms_p50"]


def scann_verdict(exported: dict) -> str:
    """The ScaNN export's speed against brute force in words, with the 95% interval of the
    median difference when the report has one ("faster by 20 to 50 µs a query ...")."""
    if "verdict" not in exported:
        return "faster" if scann_is_faster(exported) else "no faster"
    low, high = (1000 * value for value in exported["difference_ms_ci95"])        # µs
    if exported["verdict"] == "faster":
        return f"faster by {-high:.0f} to {-low:.0f} µs a query (95% interval)"
    if exported["verdict"] == "slower":
        return f"slower by {low:.0f} to {high:.0f} µs a query (95% interval)"
    return (f"not clearly faster (the difference is {low:+.0f} to {high:+.0f} µs a query, "
            f"95% interval; a verdict needs it beyond {exported['verdict_margin']:.0%} of "
            "brute force's time)")


def slow_scann_notice(exported: dict, candidates: int, exclude_seen: bool) -> str:
    """The run's notice when the ScaNN export is not found faster than brute force."""
    fetched = (f"({candidates} candidates and the most items a user has seen or a history "
               "holds) "
               if exclude_seen else "")
    return (f"the retrieval_scann export fetches {exported['fetch']} items a query {fetched}"
            f"and takes {exported['latency_ms_p50']:.2f} ms a query against "
            f"{exported['exact_latency_ms_p50']:.2f} ms for the brute-force export's search, "
            f"{scann_verdict(exported)}: ask retrieval (served by models.config and "
            "models_scann.config) instead")


def short_scann_notice(exported: dict, queries: int, part: str, candidates: int) -> str:
    """The run's notice when ScaNN answered some of the `queries` timed queries (of `part`)
    with fewer items than the export fetches."""
    return (f"the retrieval_scann export's search answered {exported['short_answers']} of "
            f"{queries} {part} queries with fewer than the {exported['fetch']} items it fetches "
            "(its leaves hold fewer items than their share): it may serve some users fewer than "
            f"{candidates} items, where retrieval serves {candidates}")


def served_section(report: dict) -> list[str]:
    if "serving" not in report:
        return []
    serving = report["serving"]
    scored = all("recall@10" in figures for figures in serving["served"].values())
    asked = (f"{serving['users']:,} test users" if scored else
             f"{serving['users']:,} users the exports know (nothing is tested to score)")
    lines = ["", "## Served", "",
             f"The exports were served by the embedded server and asked for {asked} over REST "
             "and gRPC (identical answers)."
             + (" Recall@10 and NDCG@10 of the served lists:" if scored else ""), ""]
    if scored:
        lines += ["| served model | Recall@10 | NDCG@10 | seen items served |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {name} | {figures['recall@10']:.4f} | {figures['ndcg@10']:.4f} | "
                  f"{figures['seen_items_served']} |"
                  for name, figures in serving["served"].items()]
    else:
        lines += ["| served model | seen items served |", "| --- | --- |"]
        lines += [f"| {name} | {figures['seen_items_served']} |"
                  for name, figures in serving["served"].items()]
    scann = serving["served"].get("retrieval_scann")
    approximate = [] if scann is None else [
        "", f"`retrieval_scann` searches approximately: its lists hold "
            f"{scann['share_of_exact_items']:.1%} of the items of `retrieval`'s (exact) lists"
            + (f" for the {scann['share_users']:,} users the exports know"
               + (" (the others get the same popular list from both)"
                  if scann["share_users"] < serving["users"] else "")
               if "share_users" in scann else "") + "."]
    return lines + approximate + [
        "", f"The ranking export's scores differ from the Keras ranker's by at most "
            f"{serving['ranking_export_max_abs_diff']:.1e}."]


def examples_section(report: dict) -> list[str]:
    """Per example user: their last items, the list they are served with the held-out items
    in bold, and where the held-out items are."""
    examples = report.get("examples")
    if not examples or not examples["users"]:
        return []
    served = examples["list"] == "served two-stage"
    n = max(len(user["list"]) for user in examples["users"])
    column = f"served two-stage top {n}" if served else f"retrieval's top {n}"
    source = ("the two-stage list the served check received over REST" if served else
              "retrieval's list as its export serves it (this run served nothing)")
    lines = ["", "## Example users", "",
             f"{len(examples['users'])} of the {examples['drawn_from']:,} test users"
             f"{' the served check asked for' if served else ''}, drawn with seed 0 (users "
             "the exports know first): the last items the exports know for each (most recent "
             f"last), {source}, and what the user did next (the held-out items), in bold where "
             "the list holds them."]
    for user in examples["users"]:
        targets = {item["id"] for item in user["held_out"]}
        last = " · ".join(escape(label(item)) for item in user["last_items"]) if user["known"] \
            else "none (the exports do not know this user; they serve the popular items)"
        held = held_out_sentence(user["held_out"])
        lines += ["", f"### User `{user['user']}`", "",
                  f"Last items: {last}.  ", f"Held out: {held}.", "",
                  f"| # | {column} |", "| ---: | :--- |"]
        lines += [f"| {position} | " + (f"**{escape(label(item))}** (held out)"
                                        if item["id"] in targets else escape(label(item))) + " |"
                  for position, item in enumerate(user["list"], 1)]
    return lines


def held_out_sentence(items: list[dict], named: int = 3) -> str:
    """The held-out items of a user: where the list holds them, and the first `named` of the
    others (a user may have many under the random and global protocols)."""
    found = [f"{escape(label(item))} at position {item['position']}"
             for item in items if item["position"] is not None]
    missed = [escape(label(item)) for item in items if item["position"] is None]
    if len(items) == 1:
        return found[0] if found else f"{missed[0]}, not in the list"
    others = ", ".join(missed[:named]) + (", …" if len(missed) > named else "")
    return (f"{len(items)} items; " + "; ".join(found + ([f"{len(missed)} not in the list "
                                                         f"({others})"] if missed else [])))


def label(item: dict) -> str:
    """An item as people read it: its title, else its id."""
    return item.get("title") or item["id"]


def serve_section(report: dict, out: str) -> list[str]:
    if "exports" not in report:
        return []
    root = os.path.abspath(out)
    scann = "retrieval_scann" in report["exports"]
    embedded = ("With the embedded server (every model, `retrieval_scann` included):" if scann
                else "With the embedded server (every model):")
    stock = ("With TF Serving (every model but `retrieval_scann`, which needs ScaNN's ops):"
             if scann else "With TF Serving:")
    return ["", "## Serve", "", embedded, "",
            f"    python scripts/serve.py --model_config_file={root}/export/models_scann.config",
            "", stock,
            "", f"    tensorflow_model_server --port=8500 --rest_api_port=8501 "
            f"--model_config_file={root}/export/models.config", "",
            "or its Docker image, with the config written for the container's `/models`:",
            "", f"    docker run -p 8500:8500 -p 8501:8501 -v {root}/export:/models "
            "tensorflow/serving --model_config_file=/models/models.docker.config"]


def timings_section(report: dict) -> list[str]:
    return (["", "## Timings (seconds)", "", "| step | seconds |", "| --- | --- |"]
            + [f"| {name} | {seconds:.1f} |" for name, seconds in report["timings"].items()])
