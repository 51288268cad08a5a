"""Retrieval configs compared on validation, the way a change is chosen (`scripts/compare.py`).

Each arm replaces some fields of the retrieval config. Every arm trains once per seed on the
training rows (with early stopping on validation, as a run does) and ranks every validation row
over the full catalogue as the run scores validation (`retrieval.train.catalogue_scorer`: known
items excluded, users it does not know served the popular list). An arm's per-row Recall@10
and NDCG@10 are averaged over its seeds, and every arm is compared with the first by the paired
bootstrap 95% interval of the gain, resampling users. No test row is scored.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
import typing

import numpy as np

from tworec.console import one_line
from tworec.evaluation import EvalSet, cold_start_window, eval_set, evaluate_ranks
from tworec.evaluation.metrics import paired_bootstrap, row_metrics
from tworec.features import Interactions, Split, split
from tworec.features.inputs import ModelInputs, prepare
from tworec.pipeline.config import Configs
from tworec.retrieval.config import RetrievalConfig

METRICS = ("recall@10", "ndcg@10")
ARM_FORM = "NAME:FIELD=VALUE[,FIELD=VALUE...], e.g. three:members=3"
ARM_NAME = re.compile(r"[\w.-]+")
SEEDS = range(2 ** 32)                    # what `tf.keras.utils.set_random_seed` takes
OUTPUTS = ("compare.md", "compare.json", "ranks.npz")
# Fields an arm cannot change, and why.
NOT_ARMS = {"seed": "every arm trains with the seeds of --seeds",
            "strategy": "a comparison trains every arm in one process on one device (two "
                        "mirrored models of other shapes collide in one process, and the other "
                        "strategies need other processes)",
            "partitioner": "a comparison trains in one process, without parameter servers"}


@dataclasses.dataclass(frozen=True)
class Arm:
    """One side of a comparison: its name and the retrieval config fields it replaces."""
    name: str
    retrieval: dict


def parse_arm(text: str) -> Arm:
    """`NAME:FIELD=VALUE,...` (or `NAME` alone: the config unchanged) -> Arm, each value read
    as its `RetrievalConfig` field's type (`none` for an optional field's None)."""
    name, _, fields = (part.strip() for part in text.partition(":"))
    if not ARM_NAME.fullmatch(name):
        raise ValueError(f"--arm {text!r}: name the arm with letters, digits, '_', '.' or "
                         f"'-'; give {ARM_FORM}")
    types = typing.get_type_hints(RetrievalConfig)
    replaced = {}
    for item in filter(None, fields.split(",")):
        field, equals, value = (part.strip() for part in item.partition("="))
        if not equals or field not in types:
            raise ValueError(f"--arm {text!r}: {item!r} is not FIELD=VALUE of a retrieval "
                             f"config field; known fields: {', '.join(types)}")
        if field in NOT_ARMS:
            raise ValueError(f"--arm {text!r}: {NOT_ARMS[field]}; leave {field} out")
        if field in replaced:
            raise ValueError(f"--arm {text!r}: {field} is given twice")
        replaced[field] = _typed(text, field, types[field], value)
    return Arm(name, replaced)


def _typed(arm: str, field: str, kind, value: str):
    """`value` read as `kind` (int, float, bool or str, each maybe optional)."""
    kinds = typing.get_args(kind) or (kind,)
    if type(None) in kinds and value.lower() == "none":
        return None
    base = kinds[0]
    if base is bool and value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        typed = base(value) if base in (int, float, str) else None
    except ValueError:
        typed = None
    if typed is None or (base is float and not math.isfinite(typed)):
        names = " or ".join(getattr(k, "__name__", str(k)).replace("NoneType", "none")
                            for k in kinds)
        raise ValueError(f"--arm {arm!r}: {field} takes {names}, got {value!r}")
    return typed


def check_arms(arms: list[Arm], configs: Configs, seeds: list[int]) -> None:
    """Raises ValueError (or DataError) naming the first setting that cannot be compared:
    the data config, the shared retrieval config, the arms and the seeds; before the log
    loads."""
    configs.data.validate()
    if configs.data.split in ("none", "random"):
        raise ValueError(f"split {configs.data.split!r} holds no validation rows to compare "
                         "on; use temporal or global[:Q]")
    configs.retrieval.validate(history_length=configs.data.history_length)
    if len(arms) < 2:
        raise ValueError(f"a comparison needs two arms or more (--arm {ARM_FORM}); got "
                         f"{len(arms)}")
    names = [arm.name for arm in arms]
    if len(set(names)) < len(names):
        raise ValueError(f"arm names must differ; got {names}")
    if not seeds or len(set(seeds)) < len(seeds) or not all(seed in SEEDS for seed in seeds):
        raise ValueError(f"--seeds must be one seed or more, each once, each from 0 to "
                         f"2**32 - 1; got {seeds}")
    for arm in arms:
        try:
            arm_configs(arm, configs, seeds[0]).retrieval.validate(
                history_length=configs.data.history_length)
        except ValueError as error:
            raise ValueError(f"arm {arm.name!r}: {error}") from None


def validation_split(log: Interactions, configs: Configs, arms: list[Arm]) -> Split:
    """The log's split, checked before anything trains: it holds validation rows, and every
    arm's config fits the log (its user features, its training rows). Raises ValueError (or
    DataError) naming what does not."""
    parts = split(log, configs.data.split)
    if not len(parts.validation):
        raise ValueError(f"split {configs.data.split!r} leaves no validation rows in this log "
                         "to compare on")
    for arm in arms:
        config = arm_configs(arm, configs, 0).retrieval
        try:
            config.validate(history_length=configs.data.history_length,
                            has_user_features=bool(log.user_features))
        except ValueError as error:
            raise ValueError(f"arm {arm.name!r}: {error}") from None
        if config.batch_size > len(parts.train):
            raise ValueError(f"arm {arm.name!r}: batch_size {config.batch_size} is larger than "
                             f"the training split ({len(parts.train)} rows)")
    return parts


def arm_configs(arm: Arm, configs: Configs, seed: int) -> Configs:
    """The configs an arm trains with one seed."""
    return dataclasses.replace(configs, retrieval=dataclasses.replace(
        configs.retrieval, **arm.retrieval, seed=seed))


def compare(log: Interactions, parts: Split, configs: Configs, arms: list[Arm],
            seeds: list[int], verbose: int = 1) -> tuple[dict, dict[str, np.ndarray]]:
    """Trains every arm with every seed and compares them on the validation rows of `parts`
    (`validation_split`).

    Returns:
        (result, ranks): result = {"split", "seeds", "cold_start_window" (as a run chooses it),
        "validation": {"rows", "users"}, "early_stopping": whether an arm stops early,
        "epoch_choice_differs": whether arms stop early after other epochs or patience,
        "arms": {name: {"retrieval": the fields it replaces, "runs": [`_run`'s, with "gain":
        {metric: this seed's mean gain over the first arm's run of the same seed}],
        "recall@10" and "ndcg@10": the means over seeds, "gain": None for the first arm, else
        {metric: `paired_bootstrap` of its rows' seed means against the first arm's, users
        resampled}}}}; ranks = {"rows": [m] the validation rows (log row positions),
        "users": [m] their user codes, "NAME/SEED": [m] each row's rank}.

    Raises:
        ValueError: an arm that failed to train, naming it, the seed and the error.
    """
    window = configs.data.cold_start_window or cold_start_window(log, parts)["window"]
    inputs = prepare(log, parts, configs.data.history_length,
                     exclude_seen=configs.data.exclude_seen, cold_start_window=window)
    evalset = eval_set(log, parts, "validation", exclude_seen=inputs.exclude_seen)
    early_stopping, epoch_choice_differs = stopping_of(arms, configs)
    ranks = {"rows": evalset.rows, "users": evalset.users}
    result = {"split": parts.kind, "seeds": list(seeds), "cold_start_window": window,
              "validation": {"rows": len(evalset), "users": len(np.unique(evalset.users))},
              "early_stopping": early_stopping, "epoch_choice_differs": epoch_choice_differs,
              "arms": {}}
    reference = None                  # the first arm's metric -> [seeds][m] row metrics
    for arm in arms:
        runs, rows = [], {metric: [] for metric in METRICS}          # metric -> [seeds][m]
        for position, seed in enumerate(seeds):
            run, ranks[f"{arm.name}/{seed}"] = _run(arm, seed, configs, inputs, evalset)
            for metric, values in row_metrics(ranks[f"{arm.name}/{seed}"], 10).items():
                rows[metric].append(values)
            run["gain"] = None if reference is None else {
                metric: run[metric] - float(reference[metric][position].mean())
                for metric in METRICS}
            runs.append(run)
            if verbose:
                print(f"[compare] {arm.name}, seed {seed}: validation Recall@10 "
                      f"{run['recall@10']:.4f} / NDCG@10 {run['ndcg@10']:.4f} (epoch "
                      f"{run['best_epoch']} of {run['epochs']}, {run['seconds']:.0f} s)",
                      flush=True)
        means = {metric: np.mean(rows[metric], axis=0) for metric in METRICS}        # [m]
        result["arms"][arm.name] = {
            "retrieval": arm.retrieval, "runs": runs,
            **{metric: float(means[metric].mean()) for metric in METRICS},
            "gain": None if reference is None else {
                metric: paired_bootstrap(means[metric], np.mean(reference[metric], axis=0),
                                         groups=evalset.users)
                for metric in METRICS}}
        if reference is None:
            reference = rows
    return result, ranks


def stopping_of(arms: list[Arm], configs: Configs) -> tuple[bool, bool]:
    """(whether an arm stops early, whether arms stop early after other epochs or patience:
    then they choose their epoch among more or fewer looks at the rows they are compared on)."""
    stopping = {(config.epochs, config.early_stopping_patience)
                for config in (arm_configs(arm, configs, 0).retrieval for arm in arms)}
    early_stopping = any(patience > 0 for _, patience in stopping)
    return early_stopping, early_stopping and len(stopping) > 1


def _run(arm: Arm, seed: int, configs: Configs, inputs: ModelInputs,
         evalset: EvalSet) -> tuple[dict, np.ndarray]:
    """Trains an arm with a seed and ranks the validation rows as a run scores them.

    Returns:
        ({"seed", "recall@10", "ndcg@10", "epochs", "best_epoch", "val_recall@10": early
        stopping's figure of every epoch, "seconds"}, [m] each validation row's rank).
    """
    from tworec.retrieval import train as retrieval            # TensorFlow from here
    start = time.perf_counter()
    try:
        model, summary = retrieval.fit(inputs, arm_configs(arm, configs, seed).retrieval,
                                       verbose=0)
        found = evaluate_ranks(retrieval.catalogue_scorer(model, inputs, "validation", evalset),
                               evalset, "retrieval")
    except Exception as error:                 # one line, as a failed step of a run
        raise ValueError(f"arm {arm.name!r}, seed {seed}: {one_line(error)}") from error
    return {"seed": seed, **{metric: float(values.mean())
                             for metric, values in row_metrics(found, 10).items()},
            "epochs": summary["epochs"], "best_epoch": summary["best_epoch"],
            "val_recall@10": summary["history"]["val_recall@10"],
            "seconds": round(time.perf_counter() - start, 1)}, found


def table(result: dict) -> str:
    """The comparison as Markdown: each arm's means over seeds, its gain over the first arm
    with the 95% interval, and the least and most of its seeds' own gains."""
    names = list(result["arms"])
    lines = [f"Validation ({result['split']}, {result['validation']['rows']} rows of "
             f"{result['validation']['users']} users), mean over seeds "
             f"{', '.join(map(str, result['seeds']))}; gains over {names[0]!r}, paired "
             "bootstrap 95% over users (not over seeds: the last column gives the least and "
             "most of the seeds' own NDCG@10 gains). " + (
                 "A run that stops early (early_stopping_patience > 0) chose its epoch on "
                 "these rows, as a run chooses it." if result["early_stopping"] else
                 "Each run kept its last epoch (no early stopping).")]
    if result["epoch_choice_differs"]:
        lines.append("Note: arms stop early after other epochs or patience, so they choose "
                     "their epoch among more or fewer looks at these rows; the arm that looks "
                     "more often is favoured.")
    lines += ["", "| arm | fields | Recall@10 | NDCG@10 | Recall@10 gain | NDCG@10 gain | "
              "NDCG@10 gain, seeds |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, arm in result["arms"].items():
        fields = ", ".join(f"{key}={value}" for key, value in arm["retrieval"].items()) or "-"
        gains = ["-" if arm["gain"] is None else "{difference:+.4f} ({ci95[0]:+.4f} to "
                 "{ci95[1]:+.4f})".format(**arm["gain"][metric]) for metric in METRICS]
        seeds = [run["gain"]["ndcg@10"] for run in arm["runs"] if run["gain"]]
        spread = f"{min(seeds):+.4f} to {max(seeds):+.4f}" if seeds else "-"
        lines.append(f"| {name} | {fields} | {arm['recall@10']:.4f} | {arm['ndcg@10']:.4f} | "
                     f"{gains[0]} | {gains[1]} | {spread} |")
    return "\n".join(lines) + "\n"


def write(out: str, result: dict, ranks: dict[str, np.ndarray], source: dict,
          configs: Configs) -> None:
    """Writes OUTPUTS into the folder `out`: the table, the result with the source and the
    configs, and the ranks."""
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump({"source": source, "configs": configs.to_dict(), **result}, f, indent=2)
    with open(os.path.join(out, "compare.md"), "w") as f:
        f.write(table(result))
    np.savez(os.path.join(out, "ranks.npz"), **ranks)
