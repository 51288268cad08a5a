"""Retrieval configs compared on validation, the way a change is chosen (`scripts/compare.py`).

Each arm replaces some fields of the retrieval config. Every arm trains once per seed on the
training rows (with early stopping on validation, as a run does) and ranks every validation row
over the full catalogue as the export serves it (`retrieval.train.catalogue_scorer`: known
items excluded, users it does not know served the popular list). An arm's per-row Recall@10
and NDCG@10 are averaged over its seeds, and every arm is compared with the first by the paired
bootstrap 95% interval of the gain, resampling users. Test rows are never scored.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from tworec.evaluation import cold_start_window, eval_set, evaluate_ranks
from tworec.evaluation.metrics import paired_bootstrap, row_metrics
from tworec.features import Interactions, split
from tworec.features.inputs import prepare
from tworec.pipeline.config import Configs
from tworec.retrieval.config import RetrievalConfig

METRICS = ("recall@10", "ndcg@10")
ARM_FORM = "NAME:FIELD=VALUE[,FIELD=VALUE...], e.g. three:members=3"


@dataclasses.dataclass(frozen=True)
class Arm:
    """One side of a comparison: its name and the retrieval config fields it replaces."""
    name: str
    retrieval: dict


def parse_arm(text: str) -> Arm:
    """`NAME:FIELD=VALUE,...` (or `NAME` alone: the config unchanged) -> Arm, each value read
    as its `RetrievalConfig` field's type (`none` for an optional field's None)."""
    name, _, fields = text.partition(":")
    if not name.strip():
        raise ValueError(f"--arm {text!r} has no name; give {ARM_FORM}")
    types = {field.name: field.type for field in dataclasses.fields(RetrievalConfig)}
    replaced = {}
    for item in filter(None, fields.split(",")):
        field, equals, value = (part.strip() for part in item.partition("="))
        if not equals or field not in types:
            raise ValueError(f"--arm {text!r}: {item!r} is not FIELD=VALUE of a retrieval "
                             f"config field; known fields: {', '.join(types)}")
        if field == "seed":
            raise ValueError(f"--arm {text!r}: every arm trains with the seeds of --seeds; "
                             "leave seed out")
        replaced[field] = _typed(text, field, types[field], value)
    return Arm(name.strip(), replaced)


def _typed(arm: str, field: str, kind: str, value: str):
    """`value` read as `kind` ('int', 'float', 'bool', 'str', each maybe '| None')."""
    if "None" in kind and value.lower() == "none":
        return None
    base = kind.split("|")[0].strip()
    if base == "bool" and value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return {"int": int, "float": float, "str": str}[base](value)
    except (KeyError, ValueError):
        raise ValueError(f"--arm {arm!r}: {field} takes {kind.replace('|', 'or')}, got "
                         f"{value!r}") from None


def check_arms(arms: list[Arm], configs: Configs, seeds: list[int]) -> None:
    """Raises ValueError (or DataError) naming the first setting that cannot be compared:
    the arms, the seeds, the data config and each arm's retrieval config; before the log
    loads."""
    configs.data.validate()
    if configs.data.split == "none":
        raise ValueError("split 'none' holds no validation rows to compare on; use temporal, "
                         "random or global")
    if len(arms) < 2:
        raise ValueError(f"a comparison needs two arms or more (--arm {ARM_FORM}); got "
                         f"{len(arms)}")
    names = [arm.name for arm in arms]
    if len(set(names)) < len(names):
        raise ValueError(f"arm names must differ; got {names}")
    if not seeds or len(set(seeds)) < len(seeds):
        raise ValueError(f"--seeds must be one seed or more, each once; got {seeds}")
    for arm in arms:
        try:
            arm_configs(arm, configs, seeds[0]).retrieval.validate(
                history_length=configs.data.history_length)
        except ValueError as error:
            raise ValueError(f"arm {arm.name!r}: {error}") from None


def arm_configs(arm: Arm, configs: Configs, seed: int) -> Configs:
    """The configs an arm trains with one seed."""
    return dataclasses.replace(configs, retrieval=dataclasses.replace(
        configs.retrieval, **arm.retrieval, seed=seed))


def compare(log: Interactions, configs: Configs, arms: list[Arm], seeds: list[int],
            verbose: int = 1) -> tuple[dict, dict[str, np.ndarray]]:
    """Trains every arm with every seed and compares them on the validation rows.

    Returns:
        (result, ranks): result = {"split", "seeds", "validation": {"rows", "users"}, "arms":
        {name: {"retrieval": the fields it replaces, "runs": [{"seed", "recall@10",
        "ndcg@10", "epochs", "best_epoch", "seconds"}], "recall@10" and "ndcg@10": the means
        over seeds, "gain": None for the first arm, else {metric: `paired_bootstrap` of its
        rows' seed means against the first arm's, users resampled}}}}; ranks = {"users": [m]
        the validation rows' user codes, "NAME/SEED": [m] each row's rank}.
    """
    from tworec.retrieval import train as retrieval            # TensorFlow from here

    parts = split(log, configs.data.split)
    if not len(parts.validation):
        raise ValueError(f"split {configs.data.split!r} holds no validation rows to compare "
                         "on; use temporal, random or global")
    window = configs.data.cold_start_window or cold_start_window(log, parts)["window"]
    inputs = prepare(log, parts, configs.data.history_length,
                     exclude_seen=configs.data.exclude_seen, cold_start_window=window)
    evalset = eval_set(log, parts, "validation", exclude_seen=inputs.exclude_seen)
    ranks = {"users": evalset.users}
    result = {"split": parts.kind, "seeds": list(seeds),
              "validation": {"rows": len(evalset), "users": len(np.unique(evalset.users))},
              "arms": {}}
    first = None                                 # the first arm's [seeds, m] row metrics
    for arm in arms:
        runs, rows = [], {metric: [] for metric in METRICS}          # metric -> [seeds][m]
        for seed in seeds:
            start = time.perf_counter()
            config = arm_configs(arm, configs, seed).retrieval
            model, summary = retrieval.fit(inputs, config, verbose=0)
            found = evaluate_ranks(retrieval.catalogue_scorer(model, inputs, "validation",
                                                              evalset), evalset, "retrieval")
            ranks[f"{arm.name}/{seed}"] = found
            for metric, values in row_metrics(found, 10).items():
                rows[metric].append(values)
            run = {"seed": seed, **{metric: float(np.mean(rows[metric][-1])) for metric in METRICS},
                   "epochs": summary["epochs"], "best_epoch": summary["best_epoch"],
                   "seconds": round(time.perf_counter() - start, 1)}
            runs.append(run)
            if verbose:
                print(f"[compare] {arm.name}, seed {seed}: validation Recall@10 "
                      f"{run['recall@10']:.4f} / NDCG@10 {run['ndcg@10']:.4f} (epoch "
                      f"{run['best_epoch']} of {run['epochs']}, {run['seconds']:.0f} s)",
                      flush=True)
        means = {metric: np.mean(rows[metric], axis=0) for metric in METRICS}        # [m]
        first = first or means
        result["arms"][arm.name] = {
            "retrieval": arm.retrieval, "runs": runs,
            **{metric: float(means[metric].mean()) for metric in METRICS},
            "gain": None if means is first else {
                metric: paired_bootstrap(means[metric], first[metric], groups=evalset.users)
                for metric in METRICS}}
    return result, ranks


def table(result: dict) -> str:
    """The comparison as a Markdown table: each arm's means over seeds and its gain over the
    first arm with the 95% interval."""
    names = list(result["arms"])
    lines = [f"Validation ({result['split']}, {result['validation']['rows']} rows of "
             f"{result['validation']['users']} users), mean over seeds "
             f"{', '.join(map(str, result['seeds']))}; gains over {names[0]!r}, paired "
             "bootstrap 95% over users.", "",
             "| arm | fields | Recall@10 | NDCG@10 | Recall@10 gain | NDCG@10 gain |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, arm in result["arms"].items():
        fields = ", ".join(f"{key}={value}" for key, value in arm["retrieval"].items()) or "-"
        gains = ["-" if arm["gain"] is None else
                 "{difference:+.4f} ({ci95[0]:+.4f} to {ci95[1]:+.4f})".format(**arm["gain"][metric])
                 for metric in METRICS]
        lines.append(f"| {name} | {fields} | {arm['recall@10']:.4f} | {arm['ndcg@10']:.4f} | "
                     f"{gains[0]} | {gains[1]} |")
    return "\n".join(lines) + "\n"
