"""The run: one flow from a log to evaluated, exported and served models, shared by every entry
point (`scripts/pipeline.py`, `train_retrieval.py`, `train_ranking.py`, the benchmark, tests).

    data -> retrieval -> baselines -> index -> ranking (on retrieval's and title candidates)
         -> exports -> served check -> report

`execute` runs a chosen subset of the steps into one run folder. A run folder describes one
training of each stage: `train_ranking --retrieval-run RUN` reloads RUN's retrieval model
(`pipeline.store`) and trains ranking into the same folder instead of retraining retrieval.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time

import numpy as np
import scipy.sparse as sp

from tworec.console import one_line
from tworec.evaluation import (EvalSet, baseline_ranks, cold_start_window, eval_set,
                               evaluate_ranks, rank_metrics)
from tworec.evaluation.metrics import paired_bootstrap, row_metrics
from tworec.evaluation.sets import part_catalogue, repeated_targets
from tworec.features import Interactions, Split, split
from tworec.features.history import latest_history
from tworec.features.inputs import EMPTY_SLOT, ModelInputs, prepare
from tworec.features.layers import STATE_FILE
from tworec.pipeline import config as run_config, folder, report as run_report, served, store
from tworec.pipeline.config import PIPELINE, Configs
from tworec.ranking import features as ranking_features
from tworec.ranking import train as ranking
from tworec.ranking.export import export as export_ranking
from tworec.retrieval import train as retrieval
from tworec.retrieval.export import export as export_retrieval, scann_fetch
from tworec.retrieval.index import (ScannParams, build_index, exact_top_k, exported_setting,
                                    found_codes, recall_against, tune_scann)
from tworec.serving.client import Client
from tworec.serving.compose import compose_recommender
from tworec.serving.layout import list_versions, write_models_config, write_version
from tworec.serving.manager import ModelManager, parse_config
from tworec.serving.model import settle_native_logs
from tworec.serving.recommender import Recommender
from tworec.serving.server import ModelServer

EXPORT_ORDER = ("retrieval", "retrieval_scann", "ranking", "recommender")
# Where `models.docker.config` expects the export folder mounted in a TF Serving container.
DOCKER_FOLDER = "/models/{}"
# The report sections a retrained ranking makes stale in a continued run, and their steps.
RETRAINED_WITH_RANKING = ("ranking", "two_stage", "serving")
STEP_OF_SECTION = {"ranking": "train ranking", "two_stage": "train ranking",
                   "serving": "serve and check"}
# The report's example users: how many, and how many of each one's last items it shows.
EXAMPLE_USERS, EXAMPLE_HISTORY = 5, 5
# The cut-off of the two-stage gain's bootstrap (Recall@K and NDCG@K at this K).
GAIN_AT = 10
RANKING_GAP_ROWS = 64        # rows whose ranking-export scores the served check compares


@dataclasses.dataclass(frozen=True)
class CheckedLists:
    """What the served check compares the ranking export on: the rows of a "test" part of
    `inputs` (`signals` to score them), every row's user id [m] and candidate lists [m, C]
    (catalogue codes, `EMPTY_SLOT` pads: retrieval's, then the title candidates), and the
    `rows` [r] (positions) to ask for."""

    inputs: ModelInputs
    signals: ranking_features.RankingSignals
    user_ids: np.ndarray
    lists: np.ndarray
    rows: np.ndarray

    def ids(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(user ids [r], candidate ids [r, C], "" for an empty slot) of `rows`."""
        lists = self.lists[rows]
        return (self.user_ids[rows],
                np.where(lists == EMPTY_SLOT, "", self.inputs.interactions.item_ids[lists]))


def seeded_sample(users: np.ndarray, most: int) -> np.ndarray:
    """[min(u, most)] of `users` [u] (increasing): all of them, or a sample drawn with seed 0,
    increasing."""
    return users if len(users) <= most else \
        np.sort(np.random.default_rng(0).choice(users, most, replace=False))


class StepFailed(RuntimeError):
    """A step that failed; the message names it, and the run folder keeps what was written."""


class Run:
    """One run folder and what its steps have produced so far.

    Attributes:
        out: the run folder. log: the interaction log. configs: the resolved configs.
        parts: the split. inputs: the model inputs both stages read.
        report: the run's results, section by section (written as report.json).
        offline_test: model ("retrieval", "recommender") -> the offline ranks and target
            scores of every test row, computed once (`offline`).
        served_lists: after the served check, {"users": [c] user codes asked for,
            "lists": model -> its REST answers {"item_ids": [c, n], "scores": [c, n]}}.
    """

    def __init__(self, out: str, log: Interactions, configs: Configs, source: dict,
                 verbose: int = 1, report: dict | None = None, parts: Split | None = None):
        self.out, self.log, self.configs, self.verbose = out, log, configs, verbose
        self.source, self.config_written = source, False
        self.parts = parts if parts is not None else split(log, configs.data.split)
        given = configs.data.cold_start_window
        previous = ((report or {}).get("data") or {}).get("cold_start") or {}
        reusable = previous.get("window") == given and ("rows" in previous or "given" in previous)
        cold_start = (cold_start_window(log, self.parts) if given is None else
                      previous if reusable else {"window": given, "given": True})
        # The window chosen is written to config.json, so a continued run serves the same.
        self.configs = configs = dataclasses.replace(configs, data=dataclasses.replace(
            configs.data, cold_start_window=cold_start["window"]))
        self.inputs: ModelInputs = prepare(log, self.parts, configs.data.history_length,
                                           exclude_seen=configs.data.exclude_seen,
                                           cold_start_window=cold_start["window"])
        self.report = report if report is not None else {}
        self.report["data"] = {"source": source["data"], "users": log.num_users,
                               "items": log.num_items, "interactions": len(log),
                               "split": self.parts.kind, "test_users": len(self.test_users()),
                               "test_rows": len(self.parts.test),
                               "dropped": dict(log.dropped),
                               "exclude_seen": configs.data.exclude_seen,
                               "cold_start": {**cold_start, "validation": {
                                   str(share): row for share, row in
                                   cold_start.get("validation", {}).items()}},
                               "state": self.inputs.state(),
                               "untrained_items": self.inputs.untrained_items,
                               "outside_catalogue": int((~self.inputs.catalogue).sum())}
        self.timings = self.report.setdefault("timings", {})
        self.retrieval_model, self.retrieval_trained = None, False
        self.retrieval_resumed = False   # trained by this run's command before it stopped
        self.signals = self.ranking_model = None
        self.test_candidates = self.tuning = None
        self.offline_test: dict[str, served.Offline] = {}
        self.baseline_ranks: dict[str, np.ndarray | None] = {}
        self.served_lists: dict | None = None
        self.evaluating = len(self.parts.test) > 0      # splits `none` and `latest` test nothing

    # ------------------------------------------------------------------ helpers

    def write_config(self) -> None:
        """RUN/config.json: the source and the configs, what a rerun or a continued run reads."""
        run_config.write(os.path.join(self.out, "config.json"), self.configs, self.source)
        self.config_written = True

    def notice(self, text: str) -> None:
        """Records a notice in the report and prints it."""
        self.report.setdefault("notices", []).append(text)
        self.say(f"note: {text}")

    def say(self, text: str) -> None:
        """Prints a `[run]` line unless the run is quiet (`verbose` 0)."""
        if self.verbose:
            print(f"[run] {text}", flush=True)

    @contextlib.contextmanager
    def step(self, name: str):
        """Prints a step and its duration; a failure names the step."""
        self.say(f"{name} ...")
        start = time.perf_counter()
        try:
            yield
        except Exception as error:
            raise StepFailed(f"step '{name}' failed: {one_line(error)}") from error
        self.timings[name] = round(time.perf_counter() - start, 2)
        self.say(f"{name}: {self.timings[name]:.1f} s")

    def test_users(self) -> np.ndarray:
        """[t] codes of the users with a test row, increasing."""
        return np.unique(self.log.user[self.parts.test])

    def checked_users(self) -> np.ndarray:
        """[c] codes of the test users the served check asks for: all, or a seeded sample of
        `checked_users`, increasing."""
        return seeded_sample(self.test_users(), self.configs.run.checked_users)

    def warmup_user_ids(self) -> np.ndarray:
        """[w] string ids of the users whose requests warm the exports up: test users, or
        without a test part the first users the exports know."""
        users = self.test_users() if self.evaluating else np.flatnonzero(self.inputs.known)
        return self.log.user_ids[users[:self.configs.run.warmup_users]]

    def test_set(self):
        return eval_set(self.log, self.parts, "test", exclude_seen=self.inputs.exclude_seen)

    def miss_notices(self) -> list[str]:
        """The held-out rows no model can hit, per part: those whose item no earlier part has
        (outside the catalogue ranked there), and, with seen items excluded, those whose item
        is already among their user's known rows (`repeated_targets`: never served). Empty
        when there are none."""
        notices = []
        consequence = {"validation": "validation ranks the training rows' items alone "
                                     "(retrieval's early stopping, the cold-start choice, the "
                                     "lists calibration refits on), so none ranks them",
                       "test": "they are outside the catalogue the exports serve, so every "
                               "model and baseline misses them"}
        for part in ("validation", "test"):
            outside = ~part_catalogue(self.log, self.parts, part)[
                self.log.item[getattr(self.parts, part)]]
            if outside.any():
                notices.append(
                    f"{int(outside.sum()):,} of {len(outside):,} {part} rows "
                    f"({outside.mean():.1%}) hold an item no earlier part has (first seen "
                    f"there): {consequence[part]}")
        for part in ("validation", "test") if self.inputs.exclude_seen else ():
            repeats = repeated_targets(self.log, self.parts, part)
            if repeats.any():
                notices.append(
                    f"{int(repeats.sum()):,} of {len(repeats):,} {part} rows "
                    f"({repeats.mean():.1%}) hold an item already among their user's known "
                    "rows: seen items are excluded, as served, so every model misses them; a "
                    "run with --keep-seen serves and ranks the items users have")
        return notices

    def export_dir(self, name: str = "") -> str:
        return os.path.join(self.out, "export", name)

    # ------------------------------------------------------------------ steps

    def train_retrieval(self) -> None:
        model, summary = retrieval.fit(self.inputs, self.configs.retrieval, run_dir=self.out,
                                       verbose=self.verbose)
        store.save_vocabularies(self.out, self.inputs)
        store.save_retrieval(self.out, model)
        self.retrieval_model, self.retrieval_trained = model, True
        self.report["retrieval"] = {
            "serves": self.configs.run.candidates,     # items a list holds: past it, a miss
            "train": {k: summary[k] for k in ("seconds", "epochs", "best_epoch",
                                              "examples_per_second")},
            "loss": summary["loss"]}
        folder.save_retrieval_report(self.out, self.report["retrieval"])   # from here, a rerun
        self.evaluate_retrieval()                                          # resumes after it

    def evaluate_retrieval(self) -> None:
        """The retrieval section's test figures, of the model the exports serve."""
        self.report["retrieval"] = {
            "test": rank_metrics(self.offline("retrieval").ranks) if self.evaluating else None,
            **self.report["retrieval"]}

    def load_retrieval(self) -> None:
        store.check_vocabularies(self.out, self.inputs)
        self.retrieval_model = store.load_retrieval(self.out, self.inputs, self.configs.retrieval)

    def baselines(self) -> None:
        if self.evaluating:
            self.baseline_ranks = baseline_ranks(self.log, self.parts, self.test_set(),
                                                 self.inputs.popular["test"])
            self.report["baselines"] = {name: None if ranks is None else rank_metrics(ranks)
                                        for name, ranks in self.baseline_ranks.items()}

    def tune_index(self) -> None:
        """Tunes ScaNN on validation queries of users it knows (training queries when the
        split has none) and reports the chosen setting's recall against exact search on test
        queries, and the setting the export searches with its latency against brute force at
        the export's fetch (noticed when it is no faster, and when it answers some sampled
        queries with fewer items than it fetches); a catalogue ScaNN cannot index is noticed,
        and only brute force exported."""
        run, model = self.configs.run, self.retrieval_model
        candidates = retrieval.candidate_embeddings(   # [C, d] the catalogue's, as exported
            model, self.inputs.num_items)[self.inputs.catalogue]
        part = "validation" if self.inputs.known_in("validation").any() else "train"
        queries = self.searched_queries(part)
        sample = queries[np.sort(np.random.default_rng(0).permutation(len(queries))[
            :run.tuning_queries])]
        self.tuning = tune_scann(candidates, sample, k=run.tuning_k)
        recall_key = f"recall@{run.tuning_k}_vs_exact"
        self.report["index"] = {"kind": "scann", "tuned_on": part,
                                **{key: self.tuning[key] for key in (
                                    "params", recall_key, "latency_ms_p50",
                                    "exact_latency_ms_p50", "table", "skipped")}}
        if self.tuning["skipped"]:
            self.notice(f"{self.tuning['skipped']}; only the brute-force retrieval export is "
                        "written")
        if self.tuning["params"]:
            self.report["index"]["exported"] = exported = exported_setting(
                candidates, sample, ScannParams(**self.tuning["params"]),
                scann_fetch(self.inputs, run.candidates, self.inputs.exclude_seen), run.candidates)
            if not run_report.scann_is_faster(exported):
                self.notice(run_report.slow_scann_notice(exported, run.candidates,
                                                         self.inputs.exclude_seen))
            if exported["short_answers"]:
                self.notice(run_report.short_scann_notice(exported, len(sample), part,
                                                          run.candidates))
        test = self.searched_queries("test") if self.evaluating else []
        if self.tuning["params"] and len(test):
            index = build_index(candidates, run.tuning_k, ScannParams(**self.tuning["params"]))
            self.report["index"][f"test_{recall_key}"] = recall_against(
                found_codes(index, test), exact_top_k(candidates, test, run.tuning_k))

    def searched_queries(self, part: str) -> np.ndarray:
        """[m, d] the query embeddings of the rows of `part` whose users an export searches
        for: those with rows known before the part (the others are served the popular list,
        and share one query when the towers read no history)."""
        return retrieval.query_embeddings(self.retrieval_model, self.inputs.examples[part]
                                          )[self.inputs.known_in(part)]

    def train_ranking(self) -> None:
        run, model = self.configs.run, self.retrieval_model
        hard = {part: retrieval.top_candidates(model, self.inputs, part, run.hard_negative_pool)
                for part in ("train", "validation")}
        self.signals = ranking_features.signals(
            self.inputs, self.configs.ranking,
            retrieval.embeddings_for_ranking(model, self.inputs))
        if self.evaluating:
            self.test_candidates = self.served_candidates(self.test_set(), "test")
        served_validation = self.served_candidates(
            eval_set(self.log, self.parts, "validation", exclude_seen=self.inputs.exclude_seen),
            "validation") if ranking.calibrates(self.configs.ranking) else None
        self.ranking_model, summary = ranking.fit(self.inputs, self.configs.ranking, self.signals,
                                                  hard=hard, run_dir=self.out,
                                                  verbose=self.verbose,
                                                  served_validation=served_validation)
        self.report["ranking"] = {
            "model": self.configs.ranking.model, "task": self.configs.ranking.task,
            "test": ranking.evaluate(self.ranking_model, self.inputs, self.signals, "test",
                                     hard=self.test_candidates) if self.evaluating else None,
            "train": {k: summary[k] for k in ("seconds", "epochs", "best_epoch",
                                              "examples_per_second", "calibration")
                      if k in summary}}
        if self.evaluating:
            self.report["two_stage"] = {"test": rank_metrics(self.offline("recommender").ranks),
                                        "serves": self.configs.run.top_n,
                                        "title_candidates": self.title_candidates_per_user(),
                                        "gain_over_retrieval": self.gain_over_retrieval()}

    def served_candidates(self, evalset: EvalSet, part: str) -> np.ndarray:
        """[m, k + E] what the ranker re-orders for each row of `part` as served: retrieval's
        top k (`run.candidates`; `evalset`'s excluded items skipped), then the title candidates
        the ranking export's `candidates` signature adds."""
        lists = retrieval.top_candidates(self.retrieval_model, self.inputs, part,
                                         self.configs.run.candidates, evalset=evalset)
        return ranking_features.with_title_candidates(self.signals, self.inputs, part, lists,
                                                      evalset.excluded)

    def gain_over_retrieval(self) -> dict[str, dict]:
        """Recall@10 and NDCG@10 of the two-stage lists against retrieval's on the same test
        rows: the difference and ratio of the means with paired bootstrap 95% intervals over
        test users (a user's rows are drawn together; `evaluation.metrics.paired_bootstrap`)."""
        return self.paired(self.offline("recommender").ranks, self.offline("retrieval").ranks)

    def paired(self, ranks: np.ndarray, reference: np.ndarray) -> dict[str, dict]:
        """Recall@10 and NDCG@10 of test ranks [m] against a reference's on the same rows, with
        paired bootstrap 95% intervals over test users (`evaluation.metrics.paired_bootstrap`)."""
        ours, theirs = row_metrics(ranks, GAIN_AT), row_metrics(reference, GAIN_AT)
        users = self.log.user[self.parts.test]
        return {name: paired_bootstrap(ours[name], theirs[name], groups=users) for name in ours}

    def against_baselines(self) -> None:
        """Each model's test figures against every baseline's, with intervals (report.json's
        `retrieval.against_baselines` and `two_stage.against_baselines`), when this run
        computed the baselines."""
        for section, model in (("retrieval", "retrieval"), ("two_stage", "recommender")):
            if self.baseline_ranks and (self.report.get(section) or {}).get("test"):
                self.report[section]["against_baselines"] = {
                    name: self.paired(self.offline(model).ranks, ranks)
                    for name, ranks in self.baseline_ranks.items() if ranks is not None}

    def export(self) -> None:
        """Exports the models this run trained (the retrieval export a continued run already
        has is kept) and writes `export/models.config`, the models stock TF Serving loads, and
        `export/models_scann.config`, the same with `retrieval_scann`."""
        run, users = self.configs.run, self.warmup_user_ids()
        paths = self.report.setdefault("exports", {})
        if self.retrieval_trained:
            paths["retrieval"] = export_retrieval(self.retrieval_model, self.inputs,
                                                  self.export_dir("retrieval"), run.candidates,
                                                  warmup_users=users)
            if self.tuning and self.tuning["params"]:
                paths["retrieval_scann"] = export_retrieval(
                    self.retrieval_model, self.inputs, self.export_dir("retrieval_scann"),
                    run.candidates, scann=ScannParams(**self.tuning["params"]),
                    warmup_users=users)
        if self.ranking_model is not None:
            items = self.log.item_ids
            paths["ranking"] = export_ranking(
                self.ranking_model, self.inputs, self.signals, self.export_dir("ranking"),
                warmup={"user_id": users, "item_ids": np.tile(items[:10], (len(users), 1))})
            retrieval_path = self.latest_export("retrieval")

            def compose(path: str) -> None:
                compose_recommender(retrieval_path, paths["ranking"], path, run.top_n,
                                    warmup_user_ids=list(users))
                shutil.copy(os.path.join(retrieval_path, STATE_FILE),
                            os.path.join(path, STATE_FILE))      # the state it serves
            paths["recommender"] = write_version(self.export_dir("recommender"), compose)
        exported = [name for name in EXPORT_ORDER if list_versions(self.export_dir(name))]
        stock = [name for name in exported if name != "retrieval_scann"]
        for config, names, folder_of in (("models.config", stock, self.export_dir),
                                         ("models_scann.config", exported, self.export_dir),
                                         ("models.docker.config", stock, DOCKER_FOLDER.format)):
            write_models_config(self.export_dir(config), {name: folder_of(name) for name in names})

    def latest_export(self, name: str) -> str:
        versions = list_versions(self.export_dir(name))
        if not versions:
            raise folder.RunFolderError(f"{self.out}: no {name} export in {self.export_dir(name)}")
        return os.path.join(self.export_dir(name), str(versions[-1]))

    def serve_and_check(self) -> None:
        """Serves every export with the embedded server, asks for every checked test user over
        REST and gRPC, and records the metrics of the served lists beside the offline ones
        (`pipeline.served`; the approximate `retrieval_scann`'s are measured, with the share of
        the exact lists' items it serves); fails when they differ beyond float ties, when REST
        and gRPC disagree, when a served list holds a seen item, when a retrieval export's
        `with_history` given each user's latest fit items serves other lists than by id, or
        when the ranking export adds or scores the candidates otherwise than the offline lists
        and the Keras ranker.
        Without a test part (split `none` or `latest`) it asks for the first `checked_users`
        users the exports know (in code order), with the same checks except the metrics: the
        ranking export is compared on each user's latest state and the list the retrieval
        export served them (`latest_lists`)."""
        with open(self.export_dir("models_scann.config")) as f:
            manager = ModelManager(parse_config(f.read()), poll_seconds=0)
        settle_native_logs()             # a library caller's terminal gets no native banner
        server = ModelServer(manager, grpc_port=0, rest_port=0).start()
        try:
            self.check_served(f"http://127.0.0.1:{server.rest_port}",
                              f"127.0.0.1:{server.grpc_port}")
        finally:
            server.stop()

    def check_served(self, rest_url: str, grpc_target: str) -> None:
        """`serve_and_check`'s asks and checks against a server already serving this run's
        exports (`models_scann.config`'s models) at `rest_url` and `grpc_target`."""
        users = self.checked_users() if self.evaluating else \
            np.flatnonzero(self.inputs.known)[:self.configs.run.checked_users]
        ids = self.log.user_ids[users]
        test = self.parts.test
        rows = np.flatnonzero(np.isin(self.log.user[test], users))         # positions in test
        answer_of_row = np.searchsorted(users, self.log.user[test][rows])
        targets = self.log.item_ids[self.log.item[test][rows]]
        with Client(url=rest_url) as rest, Client(grpc_target=grpc_target) as grpc:
            answers = {name: {"rest": served.ask(rest, name, ids),
                              "grpc": served.ask(grpc, name, ids)}
                       for name in ("retrieval", "retrieval_scann", "recommender")
                       if name != "retrieval_scann" or
                       list_versions(self.export_dir("retrieval_scann"))}
            with_history = {name: served.ask(rest, name, ids, self.fit_history(users))
                            for name in answers if name != "recommender"}
            checked = self.test_lists(rows) if self.evaluating else self.latest_lists(
                users, answers["retrieval"]["rest"]["item_ids"])
            ranking_gap = self.ranking_export_gap(rest, checked, RANKING_GAP_ROWS)
            self.check_added_candidates(grpc, checked)
            sample = ids[:8]
            client_side = Recommender(grpc).recommend(sample, n=self.configs.run.top_n)
        result = {"users": int(len(users)), "rows": int(len(rows)),
                  "exclude_seen": self.inputs.exclude_seen, "ranking_export_max_abs_diff":
                  ranking_gap, "served": {}}
        if not np.array_equal(served.strings(client_side["item_ids"]),
                              answers["recommender"]["grpc"]["item_ids"][:len(sample)]):
            raise served.ServedMismatch("recommender: serving.Recommender over gRPC and the "
                                        "composed SavedModel served different lists")
        self.served_lists = {"users": users, "lists": {name: by_transport["rest"]
                                                       for name, by_transport in answers.items()}}
        offline = {name: self.offline(name).at(rows) for name in answers
                   if name != "retrieval_scann"} if self.evaluating else {}
        for name, by_transport in answers.items():
            rest_lists, grpc_lists = by_transport["rest"], by_transport["grpc"]
            if not np.array_equal(rest_lists["item_ids"], grpc_lists["item_ids"]):
                raise served.ServedMismatch(f"{name}: REST and gRPC served different lists")
            seen = served.seen_served(rest_lists["item_ids"], self.log.item_ids,
                                      self.inputs.seen[users])
            if seen and self.inputs.exclude_seen:
                raise served.ServedMismatch(f"{name}: {seen} served items were already seen")
            outside = served.outside_served(rest_lists["item_ids"], self.log.item_ids,
                                            self.inputs.catalogue)
            if outside:
                raise served.ServedMismatch(f"{name}: {outside} served items are outside the "
                                            "catalogue (no fit rows)")
            if name in with_history and not np.array_equal(
                    rest_lists["item_ids"], with_history[name]["item_ids"]):
                raise served.ServedMismatch(
                    f"{name}: with_history, given each user's latest items as the export "
                    "knows them, served other lists than serving_default")
            result["served"][name] = {"seen_items_served": seen}
            if name == "retrieval_scann":         # approximate: measured, not compared
                known = self.inputs.known[users]         # others get the same popular list
                result["served"][name].update(
                    share_of_exact_items=served.shared_share(
                        rest_lists["item_ids"][known],
                        answers["retrieval"]["rest"]["item_ids"][known]),
                    share_users=int(known.sum()))
            if self.evaluating:
                per_row = {key: values[answer_of_row] for key, values in rest_lists.items()}
                result["served"][name].update(
                    served.scored(per_row, targets) if name == "retrieval_scann" else
                    served.compare(name, per_row, offline[name], targets))
        if ranking_gap > 1e-4:
            raise served.ServedMismatch(f"ranking: the export's scores differ from the Keras "
                                        f"ranker's by up to {ranking_gap:.2e}")
        known = self.inputs.known[users]
        if self.title_candidates_per_user() and known.any():   # items retrieval did not list
            result["served"]["recommender"]["title_candidate_share"] = 1 - served.shared_share(
                answers["retrieval"]["rest"]["item_ids"][known],
                answers["recommender"]["rest"]["item_ids"][known])
        self.report["serving"] = result

    def fit_history(self, users: np.ndarray) -> np.ndarray:
        """[u, max(L, 1)] str: the latest items of `users` (codes) among the fit rows, oldest
        first, "" for padding: a `with_history` request that the exports must answer as they
        answer the users by id."""
        codes = latest_history(self.log.take(self.parts.fit),
                               max(self.inputs.history_length, 1))[users]               # [u, S]
        return np.where(codes >= 0, self.log.item_ids[np.maximum(codes, 0)], "")

    def title_candidates_per_user(self) -> int:
        """The title candidates the ranking stage adds to a known user's list (0: none)."""
        titles = self.signals.titles if self.signals is not None else None
        return titles.candidates if titles is not None else 0

    def offline(self, model: str) -> served.Offline:
        """The offline ranks and target scores of every test row under `model`: "retrieval"
        or "recommender" (the served candidates re-ranked), computed once and kept for the
        report's metrics, the gain's bootstrap and the served check."""
        if model not in self.offline_test:
            compute = {"retrieval": self.offline_retrieval,
                       "recommender": self.offline_two_stage}[model]
            self.offline_test[model] = compute()
        return self.offline_test[model]

    def offline_retrieval(self) -> served.Offline:
        """Every test row's rank over the full catalogue as the retrieval export scores it
        (`evaluation.target_ranks`: ties count against the target), a miss past the
        `candidates` items the export serves, and the target's score."""
        evalset = self.test_set()
        score = retrieval.catalogue_scorer(self.retrieval_model, self.inputs, "test", evalset)
        target_scores = np.zeros(len(evalset), np.float32)

        def score_keeping_targets(positions: np.ndarray) -> np.ndarray:
            scores = score(positions)                                          # [b, num_items]
            target_scores[positions] = scores[np.arange(len(positions)),
                                              evalset.targets[positions]]
            return scores
        ranks = evaluate_ranks(score_keeping_targets, evalset, "retrieval")
        return served.Offline(ranks=served.beyond_list_missed(ranks, self.configs.run.candidates),
                              target_scores=target_scores)

    def offline_two_stage(self) -> served.Offline:
        """Every test row's rank in its candidates (`served_candidates`) re-ranked by the
        ranker (ties counting against the target but for users the models do not know, whose
        popular list is a strict order: `ranking.reranked_ranks`), and the target's
        score; a target missing from the candidates or past the `top_n` items served is a miss
        at every K."""
        scores = ranking.score_lists(self.ranking_model, self.inputs, self.signals, "test",
                                     self.test_candidates)                        # [m, C]
        ranks, target_scores = ranking.reranked_ranks(scores, self.test_candidates,
                                                      self.inputs.examples["test"]["item"],
                                                      in_order=~self.inputs.known_in("test"))
        return served.Offline(ranks=served.beyond_list_missed(ranks, self.configs.run.top_n),
                              target_scores=target_scores)

    def test_lists(self, rows: np.ndarray) -> CheckedLists:
        """The test `rows` (positions) the served check asks for, with what the served
        two-stage lists re-order."""
        return CheckedLists(
            self.inputs, self.signals, self.log.user_ids[self.log.user[self.parts.test]],
            self.test_candidates, rows)

    def latest_lists(self, users: np.ndarray, retrieval_ids: np.ndarray) -> CheckedLists:
        """Known `users` [u] (codes) in their latest state, what the exports serve them, as a
        test part of one row each, with the lists `retrieval_ids` ([u, k] the retrieval
        export served them) and the title candidates the ranking stage adds to them: what a
        run without test rows checks the ranking export on."""
        fit = self.parts.fit
        # a fit row of each user (the one latest in file order): its user decides the features;
        # its item and rating are unused
        fit_row = np.full(self.log.num_users, -1)
        np.maximum.at(fit_row, self.log.user[fit], fit)
        rows = fit_row[users]
        examples = {**self.inputs.latest_examples(users),
                    "item": self.log.item[rows].astype(np.int64)}
        inputs = dataclasses.replace(
            self.inputs, split=dataclasses.replace(self.parts, test=rows),
            examples={**self.inputs.examples, "test": examples})
        signals = self.signals
        if signals.has_retrieval:
            signals = dataclasses.replace(signals, retrieval_queries={
                **signals.retrieval_queries, "test": signals.retrieval_latest[users]})
        codes = served.catalogue_codes(retrieval_ids, self.log.item_ids)
        lists = np.where(codes < 0, EMPTY_SLOT, codes)
        excluded = self.inputs.seen[users] if self.inputs.exclude_seen else \
            sp.csr_matrix((len(users), self.inputs.num_items))
        lists = ranking_features.with_title_candidates(signals, inputs, "test", lists, excluded)
        return CheckedLists(inputs, signals, self.log.user_ids[users], lists,
                            np.arange(len(users)))

    def ranking_export_gap(self, client: Client, checked: CheckedLists, most_rows: int) -> float:
        """Largest absolute difference between the served ranking's and the Keras ranker's
        scores of the checked lists, for the first `most_rows` checked rows."""
        rows = checked.rows[:most_rows]
        keras = ranking.score_lists(self.ranking_model, checked.inputs, checked.signals, "test",
                                    checked.lists)[rows]
        users, items = checked.ids(rows)
        answer = client.predict("ranking", {"user_id": users, "item_ids": items})["scores"]
        return float(np.abs(answer - keras).max())

    def check_added_candidates(self, client: Client, checked: CheckedLists) -> None:
        """Asks the ranking export's `candidates` signature, `served.REQUEST_USERS` rows at a
        time, to add its title candidates to retrieval's candidates of the checked rows.

        Raises:
            ServedMismatch: it answers other lists than the offline ones re-order.
        """
        if not self.title_candidates_per_user():
            return
        for start in range(0, len(checked.rows), served.REQUEST_USERS):
            users, items = checked.ids(checked.rows[start:start + served.REQUEST_USERS])
            added = served.strings(client.predict(
                "ranking", {"user_id": users, "item_ids": items[:, :self.configs.run.candidates]},
                signature_name="candidates")["item_ids"])
            if not np.array_equal(added, items):
                raise served.ServedMismatch(
                    "ranking: the export's candidates signature adds other title candidates "
                    "than the offline lists hold")

    def examples(self) -> dict:
        """`EXAMPLE_USERS` test users drawn with seed 0, each with their last items as the
        exports know them (up to `EXAMPLE_HISTORY`, most recent last), the top-n list they are
        served, and their held-out items in time order with their 1-based positions in it
        (None: absent). Users the exports know are drawn first, the others (who all get the
        same popular list) only to make up the number.

        The list is the served check's two-stage list as it came over REST (not asked again);
        in a run that served nothing, retrieval's list as its export serves it.
        """
        top_n = self.configs.run.top_n
        candidates = self.served_lists["users"] if self.served_lists is not None else \
            self.test_users()
        known = self.inputs.known[candidates]
        users = seeded_sample(candidates[known], EXAMPLE_USERS)
        users = np.concatenate([users, seeded_sample(candidates[~known],
                                                     EXAMPLE_USERS - len(users))])
        if self.served_lists is not None:
            served_ids = self.served_lists["lists"]["recommender"]["item_ids"]     # [c, n]
            lists = served.catalogue_codes(served_ids[np.searchsorted(candidates, users), :top_n],
                                           self.log.item_ids)                     # [e, n]
            source = "served two-stage"
        else:
            first_rows = (self.log.user[self.parts.test][None, :] == users[:, None]).argmax(1)
            lists = retrieval.top_candidates(self.retrieval_model, self.inputs, "test", top_n,
                                             evalset=self.test_set())[first_rows]  # [e, n]
            source = "retrieval"
        last = latest_history(self.log.take(self.parts.fit), EXAMPLE_HISTORY)[users]  # [e, H]
        held_out = self.log.take(self.parts.test)
        by_time = held_out.time_order()                            # [m] by user, then time
        held_users, held_items = held_out.user[by_time], held_out.item[by_time]
        shown = []
        for user, history, listed in zip(users, last, lists):       # -1: a pad, an empty slot
            listed = listed[listed >= 0]
            targets = [{**self.describe_items([item])[0],
                        "position": int(np.argmax(listed == item)) + 1
                        if (listed == item).any() else None}
                       for item in held_items[held_users == user]]
            shown.append({"user": str(self.log.user_ids[user]),
                          "known": bool(self.inputs.known[user]),
                          "last_items": self.describe_items(history[history >= 0]),
                          "list": self.describe_items(listed), "held_out": targets})
        return {"list": source, "drawn_from": len(candidates), "users": shown}

    def describe_items(self, codes) -> list[dict]:
        """[{"id": ..., "title": ...}] of catalogue codes [c]; "title" where the log has one."""
        titles = self.log.item_features.get("title")
        return [{"id": str(self.log.item_ids[code]),
                 **({"title": str(titles[code])} if titles is not None and titles[code] else {})}
                for code in codes]

    def write_report(self) -> None:
        if self.evaluating:
            self.against_baselines()
            self.report["examples"] = self.examples()
        run_report.write(self.out, self.report)


STEP_METHODS = {"train retrieval": Run.train_retrieval, "baselines": Run.baselines,
                "tune index": Run.tune_index, "train ranking": Run.train_ranking,
                "export": Run.export, "serve and check": Run.serve_and_check}


def prepare_run(out: str, source: dict, configs: Configs, verbose: int = 1,
                continue_run: bool = False, overwrite: bool = False) -> Run:
    """`folder.check_run` (every check, before any training; its arguments), then `start_run`.
    `verbose` 0 prints nothing (the notices are still in the report); 1 a line a step, each
    notice and the trainings' epochs."""
    return start_run(folder.check_run(out, source, configs, continue_run, overwrite), verbose)


def start_run(checked: folder.CheckedRun, verbose: int = 1) -> Run:
    """The run of a checked folder: the log split and prepared, its notices recorded and
    printed (with how many held-out rows no model can hit, `Run.miss_notices`), the folder
    cleared when it is replaced, and its config.json written; a continued run's folder gets a
    report without the ranking stage it replaces, so that one stopped midway (its new exports
    maybe served) shows no figure of the old ranker."""
    out = checked.out
    result = Run(out, checked.log, checked.configs, checked.source, verbose=verbose,
                 report=checked.report, parts=checked.parts)
    for section in RETRAINED_WITH_RANKING if checked.continue_run else ():
        result.report.pop(section, None)          # no longer describes the folder's models
        result.timings.pop(STEP_OF_SECTION.get(section, section), None)
    kept = [notice for notice in result.report.get("notices", []) if checked.continue_run
            and not notice.startswith(folder.COMMAND_NOTICES)]     # still true of the folder
    result.report["notices"] = kept + [notice for notice in checked.notices if notice not in kept]
    for notice in checked.notices:
        result.say(f"note: {notice}")
    for notice in result.miss_notices():      # a continued run's are in the folder's report
        if notice in kept:
            result.say(f"note: {notice}")
        else:
            result.notice(notice)
    if checked.continue_run:     # until it ends, the folder's report shows no ranking stage
        run_report.write(out, {key: value for key, value in result.report.items()
                               if key != "examples"})           # lists served by the ranking
    if checked.overwrite and not checked.continue_run:
        folder.clear(out)
    if checked.resume == folder.AFTER_RETRIEVAL:
        result.report["retrieval"] = folder.resume_after_retrieval(out)   # evaluated again
        result.retrieval_resumed = True
    os.makedirs(out, exist_ok=True)
    if not checked.continue_run:      # a continued run's once it finished (`execute`): one
        result.write_config()         # stopped leaves the folder's config with its models
    return result


def execute(run: Run, steps: tuple[str, ...]) -> dict:
    """Runs `steps` (a subset of PIPELINE, in its order) on a prepared run and writes the
    report; returns it. A run without "train retrieval" reloads the folder's retrieval model."""
    unknown = [name for name in steps if name not in PIPELINE]
    if unknown:
        raise ValueError(f"unknown step(s) {unknown}; known: {list(PIPELINE)}")
    if run.retrieval_resumed:
        steps = tuple(name for name in steps if name != "train retrieval")
    if "train retrieval" not in steps:
        with run.step("load retrieval"):
            run.load_retrieval()
            if run.retrieval_resumed:
                run.evaluate_retrieval()
        run.retrieval_trained = run.retrieval_resumed     # then its exports are this run's
    for name in (name for name in PIPELINE if name in steps):
        with run.step(name):
            STEP_METHODS[name](run)
        if name == "export" and not run.config_written:
            run.write_config()           # a continued run's: the folder now serves its models
    with run.step("report"):
        run.write_report()
    if not run.config_written:
        run.write_config()
    return run.report
