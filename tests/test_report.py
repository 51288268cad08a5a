"""The run report: the paired bootstrap behind the two-stage gain, the report's text from a
hand-made report dict, and the report the tiny pipeline writes (example users, the gain over
retrieval, the protocol and the numbers' precision)."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import answers_of
from tworec.evaluation.metrics import paired_bootstrap, rank_metrics, row_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ paired bootstrap

def test_row_metrics_are_what_rank_metrics_average():
    ranks = np.array([0, 1, 9, 10, 500])
    rows = row_metrics(ranks, 10)
    assert rows["recall@10"].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert rows["ndcg@10"] == pytest.approx([1.0, 1 / np.log2(3), 1 / np.log2(11), 0.0, 0.0])
    assert rank_metrics(ranks, (10,)) == {"recall@10": 0.6,
                                          "ndcg@10": pytest.approx(rows["ndcg@10"].mean())}


def test_the_bootstrap_of_identical_models_is_zero():
    a = np.array([1.0, 0.75, 0.5, 0.25, 0.5, 1.0])
    result = paired_bootstrap(a, a.copy())
    assert result["difference"] == 0.0 and result["ci95"] == [0.0, 0.0]
    assert result["ratio"] == 1.0 and result["ratio_ci95"] == [1.0, 1.0]
    assert (result["rows"], result["units"], result["samples"]) == (6, 6, 2000)


def test_a_constant_shift_is_the_difference_and_its_whole_interval():
    b = np.array([0.0, 0.5, 0.25, 0.75, 0.0, 0.5, 1.0, 0.25])
    result = paired_bootstrap(b + 0.25, b)
    assert result["difference"] == 0.25 and result["ci95"] == [0.25, 0.25]
    assert result["ratio"] == (b.sum() + 2.0) / b.sum()      # 5.25 / 3.25


def test_the_hand_computed_difference_and_ratio():
    a, b = np.array([1.0, 0.0, 1.0, 1.0]), np.array([0.0, 0.0, 1.0, 0.0])
    result = paired_bootstrap(a, b, samples=500, seed=3)
    assert result["difference"] == 0.5 and result["ratio"] == 3.0
    # paired differences 1, 0, 0, 1: a resample's mean is 0 (or 1) with probability 1/16,
    # more than 2.5%, so the 95% interval is exactly [0, 1]
    assert result["ci95"] == [0.0, 1.0]
    assert result == paired_bootstrap(a, b, samples=500, seed=3)        # seeded: reproducible


def test_groups_are_resampled_as_units():
    """Two users of ten rows each, one winning every row, one tying every row. Drawing the two
    users with replacement gives a difference of 0, 1/2 or 1 (one chance in four for each
    end), so the interval is [0, 1]; drawing the 20 rows alone would give a narrow interval
    around 1/2."""
    a = np.array([1.0] * 10 + [0.0] * 10)
    b = np.zeros(20)
    users = np.repeat(np.array([7, 3]), 10)
    by_user = paired_bootstrap(a, b, groups=users)
    assert by_user["ci95"] == [0.0, 1.0] and by_user["units"] == 2
    assert by_user["ratio"] is None and by_user["ratio_ci95"] is None       # b's mean is 0
    lo, hi = paired_bootstrap(a, b)["ci95"]
    assert 0.2 < lo < 0.5 < hi < 0.8


def test_the_bootstrap_refuses_unpaired_inputs():
    with pytest.raises(ValueError, match=r"same non-empty shape \[m\], got \(3,\) and \(2,\)"):
        paired_bootstrap(np.zeros(3), np.zeros(2))
    with pytest.raises(ValueError, match=r"groups must be \[m\]"):
        paired_bootstrap(np.zeros(3), np.zeros(3), groups=np.zeros(2))


# ------------------------------------------------------------------ report.md from a report dict

def report_of(split: str, **sections) -> dict:
    """The smallest report `markdown` reads, for a `split`, with `sections` added."""
    data = {"source": "log.csv", "users": 1200, "items": 300, "interactions": 45678,
            "split": split, "test_users": 0 if split in ("none", "latest") else 600,
            "test_rows": {"none": 0, "latest": 0, "temporal": 600}.get(split, 9000),
            "dropped": {"duplicate_row": 3, "item_not_in_catalogue": 1200}, "exclude_seen": True,
            "state": {"rows": 36000, "users": 1100}}
    return {"data": data, "timings": {"report": 0.123}, **sections}


@pytest.mark.parametrize("split, says", [
    ("temporal", "per user, the last interaction is held out (test) and the one before it is "
                 "validation. It leaks: other users' later rows train the models"),
    ("random", "an 80/20 shuffle of the rows (seed 42)"),
    ("global:0.8", "every row after the 0.8 quantile of time is held out (test)"),
    ("global", "every row after the 0.9 quantile of time is held out (test)"),
    ("latest", "each user's last row is validation (early stopping, calibration), the rest "
               "train; nothing is tested, so no test metric is reported (the deployment run of "
               "what `temporal` evaluates)"),
    ("none", "every row trains; nothing is held out"),
])
def test_report_md_states_the_protocol_of_its_split(split, says):
    from tworec.pipeline.report import markdown
    text = markdown(report_of(split), "RUN", [])
    assert f"Protocol `{split}`: {says}" in text
    if split not in ("temporal", "latest"):
        assert "temporal" not in text
    assert "dropped rows: 3 (duplicate row), 1,200 (item not in catalogue)." in text
    held_out = {"none": "nothing held out", "latest": "nothing tested",
                "temporal": "600 test users"}.get(
        split, "9,000 held-out rows of 600 users")
    assert f"45,678 interactions; split `{split}`, {held_out};" in text
    if split in ("none", "latest"):
        assert ("know all 36,000 rows of 1,100 users as their state (each user's latest and "
                "seen items, the popular list); the models, their vocabularies and counts are "
                "fit on the training rows.") in text
    assert "{" not in text and "0.123" not in text and "| report | 0.1 |" in text


def test_the_gain_line_reads_as_the_issue_asks():
    from tworec.pipeline.report import gain_sentence
    gain = {"difference": 0.0123, "ratio": 1.1849, "ci95": [0.00351, 0.0204], "rows": 672,
            "units": 672}
    assert gain_sentence("NDCG@10", gain) == (
        "Two-stage against retrieval: NDCG@10 +0.012 (×1.18), 95% interval +0.004 to +0.020 "
        "(paired bootstrap over 672 users).")
    several = {**gain, "difference": -0.0051, "ratio": None, "ci95": [-0.019, 0.0043],
               "rows": 781, "units": 42}
    assert gain_sentence("Recall@10", several) == (
        "Two-stage against retrieval: Recall@10 -0.005, 95% interval -0.019 to +0.004 "
        "(paired bootstrap over 42 users holding 781 held-out rows, a user's rows drawn "
        "together).")


@pytest.mark.parametrize("scann_ms, timed, verdict", [
    (0.5, {"verdict": "faster", "difference_ms_ci95": [-0.61, -0.42]},
     ", faster by 420 to 610 µs a query (95% interval)."),
    (1.5, {"verdict": "slower", "difference_ms_ci95": [0.0381, 0.0524]},
     ", slower by 38 to 52 µs a query (95% interval): ask `retrieval` instead."),
    (0.9, {"verdict": "unclear", "difference_ms_ci95": [-0.021, 0.005], "verdict_margin": 0.05},
     ", not clearly faster (the difference is -21 to +5 µs a query, 95% interval; a verdict "
     "needs it beyond 5% of brute force's time): ask `retrieval` instead."),
    (0.5, {}, ", faster."),                                   # older reports: medians only
    (1.5, {}, ", no faster: ask `retrieval` instead.")])
def test_the_index_section_times_the_scann_export_as_it_searches(scann_ms, timed, verdict):
    from tworec.pipeline.report import index_section
    setting = {"num_leaves": 47, "num_leaves_to_search": 5, "num_reordering_candidates": 40}
    index = {"params": setting, "recall@10_vs_exact": 0.97, "tuned_on": "validation",
             "latency_ms_p50": 0.19, "exact_latency_ms_p50": 0.34,
             "exported": {**setting, "fetch": 2490, "num_leaves_to_search": 26,
                          "num_reordering_candidates": 2490, "latency_ms_p50": scann_ms,
                          "exact_latency_ms_p50": 1.0, **timed}}
    lines = index_section({"index": index}, plots=[])
    assert lines[3].endswith("; one query takes 0.19 ms (p50) against 0.34 ms for brute force's "
                             "top 10 (timed separately, not in turn).")
    assert lines[4] == (
        "The `retrieval_scann` export fetches 2490 items per query so that k unseen ones "
        "remain, so it searches with 47 leaves, searching 26 of them and re-scoring the best "
        f"2490 exactly; one query takes {scann_ms:.2f} ms (p50) against 1.00 ms for the "
        f"brute-force export's search{verdict}")
    kept = index_section({"index": index, "data": {"exclude_seen": False}}, plots=[])[4]
    assert kept.startswith("The `retrieval_scann` export fetches 2490 items per query (seen "
                           "items kept: the k it serves), so it searches with 47 leaves")


def test_a_scann_export_not_found_faster_is_noticed_with_why_it_fetches_what_it_does():
    from tworec.pipeline.report import slow_scann_notice
    exported = {"fetch": 352, "latency_ms_p50": 0.28, "exact_latency_ms_p50": 0.26,
                "verdict": "slower", "difference_ms_ci95": [0.01, 0.02], "verdict_margin": 0.05}
    assert slow_scann_notice(exported, 100, exclude_seen=True) == (
        "the retrieval_scann export fetches 352 items a query (100 candidates and the most "
        "items a user has seen or a history holds) and takes 0.28 ms a query against "
        "0.26 ms for the brute-force export's search, slower by 10 to 20 µs a query (95% "
        "interval): ask retrieval (served by models.config and models_scann.config) instead")
    assert slow_scann_notice({**exported, "fetch": 100}, 100, exclude_seen=False).startswith(
        "the retrieval_scann export fetches 100 items a query and takes 0.28 ms")  # --keep-seen
    from tworec.pipeline.report import short_scann_notice
    assert short_scann_notice({**exported, "short_answers": 3}, 200, "validation", 100) == (
        "the retrieval_scann export's search answered 3 of 200 validation queries with fewer "
        "than the 352 items it fetches (its leaves hold fewer items than their share): it may "
        "serve some users fewer than 100 items, where retrieval serves 100")


def test_the_notes_say_what_the_run_noticed_as_it_printed_it():
    from tworec.pipeline.report import notices_section
    assert notices_section({"notices": []}) == notices_section({}) == []
    assert notices_section({"notices": ["batch_size 512 lowered to the training rows, 180",
                                        "item features ['color'] are not read"]}) == [
        "", "## Notes", "", "- batch\\_size 512 lowered to the training rows, 180",
        "- item features \\['color'\\] are not read"]


def test_the_cold_start_sentence_says_what_users_never_seen_get_and_why():
    from tworec.pipeline.report import markdown
    assert "Users they do not know" not in markdown(report_of("global"), "RUN", [])
    table = {"1.0": {"ndcg@10": 0.01652, "ci95": None},
             "0.2": {"ndcg@10": 0.02181, "ci95": [0.00301, 0.00812]},
             "0.1": {"ndcg@10": 0.02121, "ci95": [0.00232, 0.00771]}}
    report = report_of("global")

    def sentence(**cold_start):
        report["data"]["cold_start"] = {"rows": 6361, "users": 60, **cold_start}
        text = markdown(report, "RUN", [])
        return text[text.index("never the test rows.") + 21:].splitlines()[0]
    assert sentence(window=0.2, validation=table) == (
        "Users they do not know are served the items most frequent in the known rows, counted "
        "over the latest 20% of them (chosen on validation, on the 6,361 rows of 60 users never "
        "seen: NDCG@10 0.0218 against 0.0165 when all rows count, 95% interval of the gain over "
        "users +0.0030 to +0.0081).")
    assert sentence(window=1.0, validation=table).endswith(
        "counted over all of them (on validation no shorter share beat all rows with the 95% "
        "interval of its NDCG@10 gain above zero).")
    assert sentence(window=1.0, validation={}, rows=99, users=9).endswith(
        "all of them (validation holds 99 rows of 9 users never seen, too few to choose on).")
    assert sentence(window=1.0, validation={}, rows=0, users=0).endswith(
        "all of them (validation holds no rows of users never seen).")
    report["data"]["cold_start"] = {"window": 0.05, "given": True, "validation": {}}
    assert "over the latest 5% of them (set in the run's config)." in markdown(report, "RUN", [])
    from tworec.pipeline.report import cold_start_sentence
    assert cold_start_sentence({"window": 1.0, "rows": 0, "users": 0}, "none").endswith(
        "counted over all of them (nothing is held out to choose on).")
    assert cold_start_sentence({"window": 1.0, "rows": 0, "users": 0}, "random").endswith(
        "counted over all of them (the split has no validation to choose on).")


@pytest.mark.parametrize("split, known", [("random", "training"),
                                          ("temporal", "training and validation")])
def test_popular_now_counts_the_rows_the_exports_know(split, known):
    from tworec.pipeline.report import markdown
    metrics = {"recall@10": 0.1, "ndcg@10": 0.05}
    text = markdown(report_of(split, retrieval={"test": metrics}), "RUN", [])
    assert f"(popular now counts the {known} rows, as the exports do)" in text


def test_the_calibration_sentence_says_what_was_refitted_or_why_not():
    from tworec.pipeline.report import calibration_sentence
    fitted = {"rows": 1234, "scale": 0.4567, "weights": {"retrieval_scores": 10.84,
                                                         "transitions": 0.5461},
              "loss_before": 4.2356, "loss_after": 4.2018}
    assert calibration_sentence(fitted) == ["", (
        "The logit's balance was refitted on 1,234 validation lists as served (those of users "
        "known before validation holding their positive): the ranker's own logit × 0.46, the signal weights retrieval_scores "
        "10.8, transitions 0.546; their cross-entropy 4.236 → 4.202 (on the lists it was "
        "fitted on).")]
    assert "signal weights" not in calibration_sentence({**fitted, "weights": {}})[1]
    assert "keeps no weight" not in calibration_sentence({**fitted, "scale": 0.004})[1]
    assert calibration_sentence({**fitted, "scale": 0.0})[1].endswith(
        "× 0.00, the signal weights retrieval_scores 10.8, transitions 0.546; their "
        "cross-entropy 4.236 → 4.202 (on the lists it was fitted on). The ranker's own logit "
        "keeps no weight: the two-stage order is that of the signals alone.")
    assert calibration_sentence({"rows": 0, "skipped": "no served validation list holds its "
                                 "positive"}) == ["", "The logit's balance was not refitted: no "
                                                  "served validation list holds its positive."]
    assert calibration_sentence(None) == []


def test_the_title_candidates_sentence_says_their_share_of_the_served_items():
    """Said when a run added title candidates, with their share of what was served when the
    run served; not for none, nor for a report before them."""
    from tworec.pipeline.report import title_candidates_sentence
    report = {"two_stage": {"title_candidates": 10},
              "serving": {"served": {"recommender": {"title_candidate_share": 0.01234}}}}
    assert title_candidates_sentence(report) == [
        "- The two-stage lists re-rank retrieval's candidates and up to 10 title candidates a "
        "known user: the items of the training rows whose titles are most like those of the "
        "user's latest items; 1.2% of the items served to the known users checked are title "
        "candidates."]
    assert title_candidates_sentence({"two_stage": {"title_candidates": 10}})[0].endswith(
        "user's latest items.")
    assert title_candidates_sentence({"two_stage": {"title_candidates": 0}}) == []
    assert title_candidates_sentence({"two_stage": {}}) == title_candidates_sentence({}) == []


@pytest.mark.parametrize("task, rated_by, scores", [
    ("listwise", "rating head", "scores"),
    ("regression", "regression ranker", "predicted ratings")])
def test_the_ranking_section_says_what_orders_the_auc(task, rated_by, scores):
    from tworec.pipeline.report import ranking_section
    report = {"ranking": {"task": task, "test": {"rmse": 0.9512, "auc": 0.6789}, "train": {}}}
    assert ranking_section(report)[3] == (
        f"RMSE of the {rated_by}: 0.951. AUC of each held-out item against retrieval's top "
        "candidates for its user (the items it must beat when served), by the ranker's "
        f"{scores}: 0.679.")
    report["ranking"]["test"].update(auc_retrieved=0.8123, retrieved_rows=1573,
                                     retrieved_among=100)
    report["ranking"]["train"]["calibration"] = {"rows": 9, "scale": 0.5, "weights": {},
                                                 "loss_before": 2.0, "loss_after": 1.9}
    assert ranking_section(report)[3].endswith(
        f"by the ranker's {scores}{' as balanced below' if task == 'listwise' else ''}: 0.679; "
        "0.812 over the 1,573 held-out items among the up to 100 candidates of their list, the "
        "lists it re-orders when served (a held-out item the candidates miss is never served, "
        "whatever its score).")
    report["ranking"]["test"]["rmse"] = None
    assert ranking_section(report)[3].startswith(
        f"RMSE of the {rated_by}: none (no rating head: rating_weight 0, or a log without "
        "ratings). AUC")
    report["ranking"].update(model="bst", test={"rmse": None, "auc": 0.1324})
    assert ranking_section(report)[3].startswith(f"The ranker: BST, trained on the {task} task. ")
    assert ranking_section(report)[3].endswith(
        f"by the ranker's {scores}{' as balanced below' if task == 'listwise' else ''}: 0.132 "
        "(0.5 is chance: below it, retrieval's top candidates score above the held-out item "
        "more often than not).")


def test_example_users_show_titles_and_mark_the_held_out_item():
    from tworec.pipeline.report import markdown
    items = [{"id": f"m{k}", "title": f"Film {k} (1999)"} for k in range(10)]
    examples = {"list": "served two-stage", "drawn_from": 600, "users": [
        {"user": "7", "known": True, "held_out": [{**items[2], "position": 3}],
         "last_items": [{"id": "m20", "title": "*batteries not included (1987)"},
                        {"id": "m21"}], "list": items},
        {"user": "8", "known": False, "list": items[:2], "last_items": [],
         "held_out": [{"id": "m30", "position": None}, {**items[1], "position": 2}]}]}
    text = markdown(report_of("temporal", examples=examples), "RUN", [])
    section = text[text.index("## Example users"):]
    assert ("2 of the 600 test users the served check asked for, drawn with seed 0 (users the "
            "exports know first)") in section
    first, second = section.split("### User ")[1:]
    assert first.splitlines()[2:12] == [
        r"Last items: \*batteries not included (1987) · m21.  ",
        "Held out: Film 2 (1999) at position 3.", "",
        "| # | served two-stage top 10 |", "| ---: | :--- |",
        "| 1 | Film 0 (1999) |", "| 2 | Film 1 (1999) |", "| 3 | **Film 2 (1999)** (held out) |",
        "| 4 | Film 3 (1999) |", "| 5 | Film 4 (1999) |"]
    assert "Last items: none (the exports do not know this user" in second
    assert ("Held out: 2 items; Film 1 (1999) at position 2; 1 not in the list (m30)."
            in second)


# ------------------------------------------------------------------ the report of a tiny run

def pipeline_script(name: str, out, *args: str) -> dict:
    """Runs scripts/`name` on the tiny synthetic log into `out`; returns its report.json."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), "--data",
                           "synthetic:tiny", "--preset", "tiny", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.load(open(out / "report.json"))


@pytest.fixture(scope="module")
def global_run(tmp_path_factory):
    """The whole pipeline under `global:0.8`: several held-out rows per user, and test users
    the exports do not know."""
    out = tmp_path_factory.mktemp("global_run")
    return out, pipeline_script("pipeline.py", out, "--split", "global:0.8")


def split_log(split: str):
    from tworec.features import load, split as split_of
    log = load("synthetic:tiny")
    return log, split_of(log, split)


def by_user_in_time(log, rows) -> dict[str, list[str]]:
    """user id -> item ids of `rows` in time order (ties in log order), a plain loop."""
    items = {}
    for row in sorted(rows, key=lambda row: (log.timestamp[row], row)):
        user, item = str(log.user_ids[log.user[row]]), str(log.item_ids[log.item[row]])
        items.setdefault(user, []).append(item)
    return items


def test_example_users_show_what_the_served_recommender_answered(global_run):
    """Five test users of the served check, those the exports know first (four, here); their
    last items are the fit rows' last five, their list the recommender export's answer, their
    held-out items the test rows'."""
    out, report = global_run
    examples = report["examples"]
    assert examples["list"] == "served two-stage"
    assert report["serving"]["users"] == report["data"]["test_users"]        # all were asked
    log, parts = split_log("global:0.8")
    fit, test = by_user_in_time(log, parts.fit), by_user_in_time(log, parts.test)
    assert examples["drawn_from"] == len(test)
    users = [user["user"] for user in examples["users"]]
    assert len(users) == 5 == len(set(users))
    known = sorted(set(fit) & set(test))
    assert len(known) == 4 and sorted(users[:4]) == known and users[4] not in fit
    served = answers_of(report["exports"]["recommender"], users)
    for user, answer in zip(examples["users"], served):
        assert [item["id"] for item in user["last_items"]] == fit.get(user["user"], [])[-5:]
        assert user["known"] == (user["user"] in fit)
        assert [item["id"] for item in user["list"]] == [i for i in answer[:10] if i]
        ids = [item["id"] for item in user["list"]]
        assert [(item["id"], item["position"]) for item in user["held_out"]] == [
            (item, ids.index(item) + 1 if item in ids else None) for item in test[user["user"]]]
        assert all(item["title"] == "Item " + item["id"][1:]
                   for item in user["list"] + user["last_items"])


def test_the_gain_over_retrieval_is_paired_over_users(global_run):
    out, report = global_run
    two_stage, alone = report["two_stage"]["test"], report["retrieval"]["test"]
    for metric in ("recall@10", "ndcg@10"):
        gain = report["two_stage"]["gain_over_retrieval"][metric]
        assert gain["difference"] == pytest.approx(two_stage[metric] - alone[metric], abs=1e-12)
        assert gain["ratio"] == pytest.approx(two_stage[metric] / alone[metric])
        assert gain["ci95"][0] <= gain["ci95"][1] and gain["samples"] == 2000
        assert (gain["units"], gain["rows"]) == (report["data"]["test_users"],
                                                report["data"]["test_rows"])
        assert gain["rows"] > gain["units"]                   # users, not rows, resampled
        text = (out / "report.md").read_text()
        lo, hi = gain["ci95"]
        name = {"recall@10": "Recall@10", "ndcg@10": "NDCG@10"}[metric]
        assert (f"- Two-stage against retrieval: {name} {gain['difference']:+.3f} "
                f"(×{gain['ratio']:.2f}), 95% interval {lo:+.3f} to {hi:+.3f} (paired "
                f"bootstrap over {gain['units']:,} users holding {gain['rows']:,} held-out "
                "rows, a user's rows drawn together).") in text


def test_the_report_says_its_protocol_and_rounds_its_numbers(global_run):
    out, report = global_run
    text = (out / "report.md").read_text()
    assert "Protocol `global:0.8`: every row after the 0.8 quantile of time" in text
    assert "temporal" not in text
    assert not re.findall(r"\d\.\d{5,}", text) and "{" not in text and "nan" not in text
    calibration = report["ranking"]["train"]["calibration"]
    assert calibration["rows"] > 0 and calibration["loss_after"] <= calibration["loss_before"]
    assert (f"refitted on {calibration['rows']:,} validation lists as served (those of users "
            "known before validation holding their positive): the ranker's own logit × "
            f"{calibration['scale']:.2f}") in text
    assert (report["retrieval"]["serves"], report["two_stage"]["serves"]) == (100, 10)
    log, parts = split_log("global:0.8")
    fit, trained = (np.unique(log.item[rows]) for rows in (parts.fit, parts.train))
    assert report["data"]["untrained_items"] == len(fit) - len(trained)
    assert report["data"]["outside_catalogue"] == log.num_items - len(fit)
    assert ("validation rows alone" in text) == (len(fit) > len(trained))
    assert ("The models' lists are the ones their exports serve (retrieval's top 100, "
            "two-stage's top 10): a held-out item past them is a miss.") in text
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3
    sections = ["<h2>Test Recall@10", 'alt="test Recall@K', "<h2>Training", 'alt="loss and',
                "<h2>Candidate index", 'alt="ScaNN', "<h2>Served", "<h2>Example users",
                "<strong>Item", "<h2>Serve</h2>"]
    assert [page.index(mark) for mark in sections] == sorted(page.index(m) for m in sections)


def test_a_deployment_run_reports_what_it_served_without_metrics():
    from tworec.pipeline.report import markdown
    serving = {"users": 40, "rows": 0, "exclude_seen": True, "ranking_export_max_abs_diff": 2e-7,
               "served": {"retrieval": {"seen_items_served": 0},
                          "recommender": {"seen_items_served": 0}}}
    train = {"epochs": 2, "seconds": 1.0, "examples_per_second": 100}       # not calibrated
    text = markdown(report_of("none", serving=serving, ranking={"test": None, "train": train}),
                    "RUN", [])
    assert "## Test Recall@10" not in text and "nan" not in text
    assert ("asked for 40 users the exports know (nothing is tested to score) over REST and "
            "gRPC (identical answers).") in text
    assert "## Ranking on its own" not in text                 # none: nothing to say
    calibration = {"rows": 9, "scale": 0.5, "weights": {}, "loss_before": 2.0, "loss_after": 1.0}
    train = {**train, "calibration": calibration}
    latest = markdown(report_of("latest", serving=serving, ranking={"test": None, "train": train}),
                      "RUN", [])
    assert "## Ranking on its own\n\nThe logit's balance was refitted on 9 validation " in latest
    assert "| served model | seen items served |\n| --- | --- |\n| retrieval | 0 |" in text
    serving["served"]["retrieval_scann"] = {"seen_items_served": 0, "share_of_exact_items": 0.9712,
                                            "share_users": 30}
    assert ("`retrieval_scann` searches approximately: its lists hold 97.1% of the items of "
            "`retrieval`'s (exact) lists for the 30 users the exports know (the others get "
            "the same popular list from both).") in markdown(report_of("none", serving=serving),
                                                             "RUN", [])
    serving["served"]["retrieval_scann"]["share_users"] = 40            # every user asked
    assert ("`retrieval`'s (exact) lists for the 40 users the exports know.") in markdown(
        report_of("none", serving=serving), "RUN", [])


def test_a_model_below_a_baseline_is_warned_with_the_interval_of_the_difference():
    from tworec.pipeline.report import warnings_of
    interval = {"difference": -0.0004, "ci95": [-0.0121, 0.0113]}
    report = {"retrieval": {"test": {"recall@10": 0.60, "ndcg@10": 0.4071},
                            "against_baselines": {"item_transition": {"ndcg@10": interval}}},
              "two_stage": {"test": {"recall@10": 0.59, "ndcg@10": 0.43}},
              "baselines": {"item_transition": {"recall@10": 0.50, "ndcg@10": 0.4075},
                            "ease": None}}
    assert warnings_of(report) == [
        "retrieval does worse than item transitions on test ndcg@10: 0.4071 against 0.4075 "
        "(difference -0.0004, 95% interval -0.0121 to +0.0113)",
        "two-stage does worse than retrieval alone on test recall@10: 0.5900 against 0.6000"]


def test_the_serve_section_names_retrieval_scann_only_when_it_was_exported():
    from tworec.pipeline.report import markdown
    exports = {"retrieval": "RUN/export/retrieval/1", "ranking": "RUN/export/ranking/1"}
    without = markdown(report_of("random", exports=exports), "RUN", [])
    assert "With the embedded server (every model):" in without
    assert "With TF Serving:" in without and "retrieval_scann" not in without
    exports["retrieval_scann"] = "RUN/export/retrieval_scann/1"
    with_scann = markdown(report_of("random", exports=exports), "RUN", [])
    assert "With the embedded server (every model, `retrieval_scann` included):" in with_scann
    assert "every model but `retrieval_scann`, which needs ScaNN's ops" in with_scann


def test_the_data_section_says_how_many_items_are_not_served_or_untrained():
    """The exports serve the items of their fit rows: the report says how many others the
    catalogue leaves out, and how many served items have no training rows."""
    from tworec.pipeline.report import markdown
    report = report_of("temporal")
    assert "never served" not in markdown(report, "RUN", [])
    assert "validation rows alone" not in markdown(report, "RUN", [])
    report["data"].update(outside_catalogue=10, untrained_items=3)
    report["data"]["state"]["items"] = 140
    random = report_of("random")
    random["data"].update(outside_catalogue=10)
    assert "catalogue every test figure ranks: the 10 others" in markdown(random, "RUN", [])
    assert ("never the test rows. They serve the 140 items of those rows, the catalogue every "
            "test figure ranks (validation ranks the training rows' items): the 10 others (of "
            "the item table alone, or first seen in held-out rows) are never served, and a "
            "held-out row of one is a miss. 3 served items have validation rows alone: the "
            "models score them by their features and the untrained out-of-vocabulary id."
            ) in markdown(report, "RUN", [])
    for split in ("none", "latest"):                         # nothing held out, nothing ranked
        report = report_of(split)
        report["data"].update(outside_catalogue=10)
        report["data"]["state"]["items"] = 140
        assert ("users as their state (each user's latest and seen items, the popular list); "
                "the models, their vocabularies and counts are fit on the training rows. They "
                "serve the 140 items of the rows they know: the 10 others, of the item table "
                "alone, are never served.") in markdown(report, "RUN", [])
