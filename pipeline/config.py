"""The configs of one run: the data config both stages read, each stage's model config, and the
run config of the flow that joins them. Resolved from a named preset, validated together
before anything trains, and written to (and read back from) RUN/config.json."""
from __future__ import annotations

import dataclasses
import json
import os

from tworec.features.inputs import DATA_PRESETS, DataConfig
from tworec.ranking.config import MODELS, PRESETS as RANKING_PRESETS, TASKS, RankingConfig
from tworec.retrieval.config import (ENCODERS, OPTIMIZERS, PRESETS as RETRIEVAL_PRESETS,
                                     STRATEGIES, RetrievalConfig)

PRESETS = sorted(DATA_PRESETS)
__all__ = ["Configs", "RunConfig", "resolve", "read", "write", "PRESETS", "RETRIEVAL_PRESETS",
           "ENCODERS", "OPTIMIZERS", "STRATEGIES", "MODELS", "TASKS", "PIPELINE",
           "RETRIEVAL_ONLY", "RANKING_ONLY"]

# Settings added after run folders were first written, with the value every earlier run had.
EARLIER_RUNS = {"retrieval": {"members": 1},
                "ranking": {"title_neighbors": 0, "title_candidates": 0}}

# The steps in the order they run; an entry point runs a subset.
PIPELINE = ("train retrieval", "baselines", "tune index", "train ranking", "export",
            "serve and check")
RETRIEVAL_ONLY = ("train retrieval", "baselines", "tune index", "export")
# Ranking alone evaluates the baselines again: its report compares two-stage with them, with
# intervals (a continued run's figures equal the folder's).
RANKING_ONLY = ("baselines", "train ranking", "export", "serve and check")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The flow's own numbers, shared by every step that needs them."""

    candidates: int = 100                 # retrieval's top-k: what the ranker re-orders and
                                          # what the retrieval export returns
    hard_negative_pool: int = 50          # retrieval's top items per training row, the pool of
                                          # the ranker's hard negatives
    top_n: int = 10                       # items the composed recommender returns
    tuning_queries: int = 200             # validation queries the ScaNN tuning measures
    tuning_k: int = 10                    # ScaNN is tuned for recall@tuning_k against exact
    checked_users: int = 2000             # test users the served check asks for (a seeded
                                          # sample beyond)
    warmup_users: int = 8                 # users of the exports' warmup requests

    def validate(self) -> None:
        """Raises ValueError naming the first setting that cannot work."""
        flags = {"candidates": "--top-k (candidates)", "top_n": "--top-n (top_n)"}
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"{flags.get(field.name, field.name)} must be positive, got "
                                 f"{getattr(self, field.name)}")
        if self.top_n > self.candidates:
            raise ValueError(f"--top-n (top_n) {self.top_n} is more than the {self.candidates} "
                             f"candidates the recommender re-ranks (--top-k, candidates): give "
                             f"--top-n at most {self.candidates} or --top-k at least {self.top_n}")

    def for_catalogue(self, num_items: int) -> tuple[RunConfig, list[str]]:
        """The config with every item count clamped to a catalogue of `num_items` (the items
        of the fit rows, what the exports serve), and a notice for each count it lowered."""
        clamped, notices = {}, []
        for name in ("candidates", "hard_negative_pool", "tuning_k", "top_n"):
            value = getattr(self, name)
            if value > num_items:
                clamped[name] = num_items
                flag = {"candidates": " (--top-k)", "top_n": " (--top-n)"}.get(name, "")
                notices.append(f"{name}{flag} {value} lowered to the catalogue size, "
                               f"{num_items} (the items the exports know)")
        return dataclasses.replace(self, **clamped), notices


@dataclasses.dataclass(frozen=True)
class Configs:
    """Everything that decides a run."""

    data: DataConfig
    retrieval: RetrievalConfig
    ranking: RankingConfig
    run: RunConfig = RunConfig()

    def validate(self, has_ratings: bool | None = None,
                 has_user_features: bool | None = None) -> None:
        """Raises ValueError (or DataError) naming the first setting that cannot work (with
        what the log holds, when given)."""
        self.data.validate()
        self.retrieval.validate(history_length=self.data.history_length,
                                has_user_features=has_user_features)
        self.ranking.validate(has_ratings=True if has_ratings is None else has_ratings,
                              history_length=self.data.history_length)
        self.run.validate()

    def to_dict(self) -> dict:
        return {field.name: dataclasses.asdict(getattr(self, field.name))
                for field in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, values: dict) -> Configs:
        """The inverse of `to_dict` (tuples, which JSON stores as lists, restored); a setting
        that a run folder of an earlier tworec lacks takes the value it had then
        (`EARLIER_RUNS`), not today's default."""
        types = {"data": DataConfig, "retrieval": RetrievalConfig, "ranking": RankingConfig,
                 "run": RunConfig}
        return cls(**{name: kind(**{key: tuple(value) if isinstance(value, list) else value
                                    for key, value in {**EARLIER_RUNS.get(name, {}),
                                                       **values[name]}.items()})
                      for name, kind in types.items()})


def resolve(preset: str = "default", *, base: Configs | None = None, epochs: int | None = None,
            steps: tuple[str, ...] = PIPELINE, data: dict | None = None,
            retrieval: dict | None = None, ranking: dict | None = None,
            run: dict | None = None) -> Configs:
    """The configs of a named preset (or of `base`, e.g. a run folder's own) with fields
    replaced; `epochs` sets the epochs of the stages that `steps` (of PIPELINE) train, and
    leaves the others' as they are (a later run that trains them reads them).

    Raises:
        ValueError: an unknown preset or field, or popularity periods or title neighbours
            given to a regression ranker, which reads none.
    """
    if base is None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; known: {PRESETS}")
        base = Configs(DATA_PRESETS[preset], RETRIEVAL_PRESETS[preset], RANKING_PRESETS[preset])
    def trained(stage: str) -> dict:
        """The epochs `stage` takes from `epochs`: none unless `steps` train it."""
        return {} if epochs is None or f"train {stage}" not in steps else {"epochs": epochs}

    try:
        configs = Configs(
            data=dataclasses.replace(base.data, **(data or {})),
            retrieval=dataclasses.replace(base.retrieval,
                                          **{**trained("retrieval"), **(retrieval or {})}),
            ranking=dataclasses.replace(base.ranking, **{**trained("ranking"), **(ranking or {})}),
            run=dataclasses.replace(base.run, **(run or {})))
    except TypeError as error:                   # an unknown field name
        raise ValueError(f"config: {error}") from None
    for field, flag, what in (("popularity_periods", "--popularity-periods", "popularity periods"),
                              ("title_neighbors", "--title-neighbors", "title similarity"),
                              ("title_candidates", "--title-candidates", "title candidates")):
        given = (ranking or {}).get(field)
        if given is not None and given > 0 and configs.ranking.task == "regression":
            raise ValueError(f"{field} {given}: the ranker's task is regression (--task, an "
                             f"arm's task, or the run folder's config), which reads no {what}; "
                             f"leave it out ({flag}, or an arm's {field}), or use task listwise "
                             "or binary")
    return configs


def write(path: str, configs: Configs, source: dict) -> None:
    """Writes RUN/config.json: the data source (`source`, `columns`) and the resolved configs;
    whole or not at all (a stopped write leaves the previous file)."""
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"source": source, **configs.to_dict()}, f, indent=2)
        os.replace(path + ".tmp", path)
    finally:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")


def read(path: str) -> tuple[dict, Configs]:
    """(source, configs) from a RUN/config.json written by `write`."""
    with open(path) as f:
        values = json.load(f)
    return values["source"], Configs.from_dict(values)
