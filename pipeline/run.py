"""The run: one flow from a log to evaluated, exported and served models, shared by every entry
point (`scripts/pipeline.py`, `train_retrieval.py`, `train_ranking.py`, the benchmark, tests).

    data -> retrieval -> baselines -> index -> ranking (on retrieval's candidates)
         -> exports -> served check -> report

`execute` runs a chosen subset of the steps into one run folder. A run folder describes one
training of each stage: `train_ranking --retrieval-run RUN` reloads RUN's retrieval model
(`pipeline.store`) and trains ranking into the same folder instead of retraining retrieval.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import numpy as np

from tworec.evaluation import KS, baselines, eval_set
from tworec.features import Interactions, load, split
from tworec.features.inputs import ModelInputs, prepare
from tworec.pipeline import config as run_config, report as run_report, store
from tworec.pipeline.config import Configs
from tworec.ranking import features as ranking_features
from tworec.ranking import train as ranking
from tworec.ranking.export import export as export_ranking
from tworec.retrieval import train as retrieval
from tworec.retrieval.export import export as export_retrieval
from tworec.retrieval.index import ScannParams, exact_top_k, tune_scann
from tworec.serving.client import Client
from tworec.serving.compose import compose_recommender
from tworec.serving.layout import list_versions, write_models_config, write_version
from tworec.serving.manager import ModelManager, parse_config
from tworec.serving.recommender import Recommender
from tworec.serving.server import ModelServer

# The steps in the order they run; an entry point runs a subset.
PIPELINE = ("train retrieval", "baselines", "tune index", "train ranking", "export",
            "serve and check")
RETRIEVAL_ONLY = ("train retrieval", "baselines", "tune index", "export")
RANKING_ONLY = ("train ranking", "export")
EXPORT_ORDER = ("retrieval", "retrieval_scann", "ranking", "recommender")
# The report sections a retrained ranking makes stale in a continued run.
RETRAINED_WITH_RANKING = ("ranking", "two_stage", "serving")


class StepFailed(RuntimeError):
    """A step that failed; the message names it, and the run folder keeps what was written."""


class Run:
    """One run folder and what its steps have produced so far.

    Attributes:
        out: the run folder. log: the interaction log. configs: the resolved configs.
        parts: the split. inputs: the model inputs both stages read.
        report: the run's results, section by section (written as report.json).
    """

    def __init__(self, out: str, log: Interactions, configs: Configs, source: dict,
                 verbose: int = 1):
        self.out, self.log, self.configs, self.verbose = out, log, configs, verbose
        self.parts = split(log, configs.data.split)
        self.inputs: ModelInputs = prepare(log, self.parts, configs.data.history_length)
        self.report = run_report.read(out)
        self.report["data"] = {"source": source["data"], "users": log.num_users,
                               "items": log.num_items, "interactions": len(log),
                               "split": self.parts.kind, "test_users": len(self.test_users()),
                               "dropped": dict(log.dropped)}
        self.timings = self.report.setdefault("timings", {})
        self.retrieval_model, self.retrieval_trained = None, False
        self.signals = self.ranking_model = None
        self.test_candidates = self.tuning = None

    # ------------------------------------------------------------------ helpers

    @contextlib.contextmanager
    def step(self, name: str):
        """Prints a step and its duration; a failure names the step."""
        print(f"[run] {name} ...", flush=True)
        start = time.perf_counter()
        try:
            yield
        except Exception as error:
            raise StepFailed(f"step '{name}' failed: {type(error).__name__}: {error}") from error
        self.timings[name] = round(time.perf_counter() - start, 2)
        print(f"[run] {name}: {self.timings[name]} s", flush=True)

    def test_users(self) -> np.ndarray:
        """[t] codes of the users with a test row, increasing."""
        return np.unique(self.log.user[self.parts.test])

    def check_users(self) -> np.ndarray:
        """[c] codes of the test users the served check and the warmup requests use."""
        return self.test_users()[:self.configs.run.check_users]

    def check_user_ids(self) -> np.ndarray:
        """[c] their string ids."""
        return self.log.user_ids[self.check_users()]

    def exclude_seen(self) -> bool:
        return self.parts.kind == "temporal"

    def test_set(self):
        return eval_set(self.log, self.parts, "test", exclude_seen=self.exclude_seen())

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
            "test": retrieval.evaluate_model(model, self.inputs, "test", evalset=self.test_set()),
            "train": {k: summary[k] for k in ("seconds", "epochs", "examples_per_second")},
            "loss": summary["loss"]}

    def load_retrieval(self) -> None:
        store.check_vocabularies(self.out, self.inputs)
        self.retrieval_model = store.load_retrieval(self.out, self.inputs, self.configs.retrieval)

    def baselines(self) -> None:
        self.report["baselines"] = baselines(self.log, self.parts, self.test_set())

    def tune_index(self) -> None:
        run = self.configs.run
        candidates = retrieval.candidate_embeddings(self.retrieval_model, self.inputs.num_items)
        queries = retrieval.query_embeddings(self.retrieval_model,
                                             self.inputs.examples["test"])[:run.tuning_queries]
        self.tuning = tune_scann(candidates, queries, k=run.tuning_k)
        self.report["index"] = {"kind": "scann", **{key: self.tuning[key] for key in (
            "params", f"recall@{run.tuning_k}_vs_exact", "latency_ms_p50",
            "exact_latency_ms_p50", "table")}}

    def train_ranking(self) -> None:
        run, model = self.configs.run, self.retrieval_model
        hard = {part: retrieval.top_candidates(model, self.inputs, part, run.hard_negative_pool,
                                               exclude_seen=False)
                for part in ("train", "validation")}
        self.test_candidates = retrieval.top_candidates(model, self.inputs, "test", run.candidates,
                                                        exclude_seen=self.exclude_seen())
        self.signals = ranking_features.signals(
            self.inputs, self.configs.ranking.use_transitions,
            retrieval.embeddings_for_ranking(model, self.inputs))
        self.ranking_model, summary = ranking.fit(self.inputs, self.configs.ranking, self.signals,
                                                  hard=hard, run_dir=self.out,
                                                  verbose=self.verbose)
        self.report["ranking"] = {
            "test": ranking.evaluate(self.ranking_model, self.inputs, self.signals, "test",
                                     hard=self.test_candidates),
            "train": {k: summary[k] for k in ("seconds", "examples_per_second")}}
        self.report["two_stage"] = {"test": ranking.two_stage_metrics(
            self.ranking_model, self.inputs, self.signals, "test", self.test_candidates, ks=KS)}

    def export(self) -> None:
        """Exports the models this run trained (the retrieval export a continued run already
        has is kept) and writes `export/models.config` listing every exported model."""
        run, users = self.configs.run, self.check_user_ids()
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
            paths["recommender"] = write_version(
                self.export_dir("recommender"),
                lambda path: compose_recommender(retrieval_path, paths["ranking"], path,
                                                 run.top_n, warmup_user_ids=list(users)))
        write_models_config(self.export_dir("models.config"),
                            {name: self.export_dir(name) for name in EXPORT_ORDER
                             if list_versions(self.export_dir(name))})

    def latest_export(self, name: str) -> str:
        versions = list_versions(self.export_dir(name))
        if not versions:
            raise store.RunFolderError(f"{self.out}: no {name} export in {self.export_dir(name)}")
        return os.path.join(self.export_dir(name), str(versions[-1]))

    def serve_and_check(self) -> None:
        """Serves the exports on free ports; checks REST, gRPC and in-process answers agree."""
        users = self.check_user_ids()
        with open(self.export_dir("models.config")) as f:
            manager = ModelManager(parse_config(f.read()), poll_seconds=0)
        server = ModelServer(manager, grpc_port=0, rest_port=0).start()
        try:
            rest = Client(url=f"http://127.0.0.1:{server.rest_port}")
            grpc = Client(grpc_target=f"127.0.0.1:{server.grpc_port}")
            served = rest.predict("retrieval", {"user_id": users})["item_ids"]
            queries = retrieval.latest_queries(self.retrieval_model, self.inputs)[self.check_users()]
            expected = self.log.item_ids[exact_top_k(
                retrieval.candidate_embeddings(self.retrieval_model, self.inputs.num_items),
                queries, served.shape[1])]
            retrieval_matches = bool(np.array_equal(_strings(served), expected))
            composed_rest = _strings(rest.predict("recommender", {"user_id": users})["item_ids"])
            composed_grpc = _strings(grpc.predict("recommender", {"user_id": users})["item_ids"])
            two_stage = _strings(Recommender(grpc).recommend(users, n=self.configs.run.top_n)
                                 ["item_ids"])
            recommender_matches = bool(np.array_equal(composed_rest, composed_grpc)
                                       and np.array_equal(composed_rest, two_stage))
            rest.close()
            grpc.close()
        finally:
            server.stop()
        self.report["serving"] = {
            "smoke_users": int(len(users)), "retrieval_matches_keras": retrieval_matches,
            "recommender_rest_grpc_recommender_agree": recommender_matches,
            "matches_in_process": retrieval_matches and recommender_matches}

    def write_report(self) -> None:
        run_report.write(self.out, self.report)


STEP_METHODS = {"train retrieval": Run.train_retrieval, "baselines": Run.baselines,
                "tune index": Run.tune_index, "train ranking": Run.train_ranking,
                "export": Run.export, "serve and check": Run.serve_and_check}


def _strings(values) -> np.ndarray:
    """[...] bytes or str -> [...] str."""
    values = np.asarray(values)
    return np.vectorize(lambda v: v.decode() if isinstance(v, bytes) else str(v))(values) \
        if values.size else values.astype(str)


def prepare_run(out: str, source: dict, configs: Configs, verbose: int = 1,
                continue_run: bool = False) -> Run:
    """Loads the log and checks everything before any training: the configs against the log,
    and for a continued run that only the ranking config changed. Raises DataError,
    ValueError or `store.RunFolderError` with a one-line message.

    Args:
        out: the run folder.
        source: {"data": a `features.load` source, "columns": role -> column name}.
        configs: the resolved configs (for a continued run, resolved from `read_run(out)`).
        continue_run: reuse the retrieval model trained in `out`.
    """
    if continue_run:
        saved_source, saved = read_run(out)
        changed = [name for name in ("data", "retrieval", "run")
                   if getattr(configs, name) != getattr(saved, name)]
        if changed or source != saved_source:
            raise store.RunFolderError(
                f"{out}: a continued run keeps the folder's data source and its data, retrieval "
                f"and run configs; these differ: {changed or ['source']}")
    log = load(source["data"], columns=source.get("columns") or {})
    configs.validate(has_ratings=log.rating is not None)
    run, notices = configs.run.for_catalogue(log.num_items)
    configs = dataclasses.replace(configs, run=run)
    for notice in notices:
        print(f"[run] note: {notice}", flush=True)
    os.makedirs(out, exist_ok=True)
    run_config.write(os.path.join(out, "config.json"), configs, source)
    result = Run(out, log, configs, source, verbose=verbose)
    for section in RETRAINED_WITH_RANKING if continue_run else ():
        result.report.pop(section, None)          # no longer describes the folder's models
    result.report["notices"] = notices
    return result


def read_run(out: str) -> tuple[dict, Configs]:
    """(source, configs) of an existing run folder; RunFolderError when it is none."""
    path = os.path.join(out, "config.json")
    if not os.path.exists(path):
        raise store.RunFolderError(f"{out}: not a run folder (no config.json); train retrieval "
                                   "into it first (scripts/train_retrieval.py)")
    return run_config.read(path)


def execute(run: Run, steps: tuple[str, ...]) -> dict:
    """Runs `steps` (a subset of PIPELINE, in its order) on a prepared run and writes the
    report; returns it. A run without "train retrieval" reloads the folder's retrieval model."""
    unknown = [name for name in steps if name not in PIPELINE]
    if unknown:
        raise ValueError(f"unknown step(s) {unknown}; known: {list(PIPELINE)}")
    if "train retrieval" not in steps:
        with run.step("load retrieval"):
            run.load_retrieval()
    for name in (name for name in PIPELINE if name in steps):
        with run.step(name):
            STEP_METHODS[name](run)
    with run.step("report"):
        run.write_report()
    return run.report
