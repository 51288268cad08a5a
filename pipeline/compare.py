"""Configs compared on validation, the way a change is chosen (`scripts/compare.py`).

Each arm replaces some fields of one stage's config. Every arm trains once per seed on the
training rows (with early stopping on validation, as a run does) and ranks every validation row
as the run scores validation. A retrieval arm ranks the full catalogue
(`retrieval.train.catalogue_scorer`: known items excluded, users it does not know served the
popular list). Ranking arms re-rank the validation lists one retrieval model per seed serves
(retrieval alone is their reference row), or one per retrieval config when arms set retrieval
fields (`retrieval.members=1`: each config's model has its row, and the served two-stage lists
of two configs are compared); a calibrated ranker is calibrated on one half of the
validation users and scores the other (`cross_fitted_scores`), so no row is scored by a
calibration fitted on it (early stopping still chooses epochs on every validation row, as a run
does). An arm's per-row Recall@10 and NDCG@10 are averaged over its seeds, and every arm
is compared with the first by the paired bootstrap 95% interval of the gain, resampling users.
No test row is scored.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import time
import typing

import numpy as np

from tworec.console import one_line
from tworec.evaluation import EvalSet, MISS, cold_start_window, eval_set, evaluate_ranks
from tworec.evaluation.metrics import paired_bootstrap, row_metrics
from tworec.features import Interactions, Split, split
from tworec.features.inputs import ModelInputs, prepare
from tworec.pipeline.config import Configs, resolve
from tworec.ranking.config import RankingConfig
from tworec.retrieval.config import RetrievalConfig

METRICS = ("recall@10", "ndcg@10")
STAGES = {"retrieval": RetrievalConfig, "ranking": RankingConfig}
ARM_FORM = "NAME:FIELD=VALUE[,FIELD=VALUE...], e.g. three:members=3 (layers: 256/128)"
ARM_NAME = re.compile(r"[\w.-]+")
RETRIEVAL_ALONE = "retrieval"          # the reference row of ranking arms (not an arm's name)
RETRIEVED = "retrieval."               # a ranking arm's retrieval field: retrieval.members=1
CALIBRATION_FOLDS = 2                  # of validation users: calibrated on one, scored on the other
SEEDS = range(2 ** 32)                    # what `tf.keras.utils.set_random_seed` takes
OUTPUTS = ("compare.md", "compare.json", "ranks.npz")
# Fields an arm cannot change, and why.
NOT_ARMS = {"seed": "every arm trains with the seeds of --seeds",
            "strategy": "a comparison trains every arm in one process on one device, to "
                        "compare configs, not devices",
            "partitioner": "a comparison trains in one process, without parameter servers"}


@dataclasses.dataclass(frozen=True)
class Arm:
    """One side of a comparison: its name, the fields it replaces in its stage's config and,
    for a ranking arm, those it replaces in the config of the retrieval model whose lists it
    re-ranks (`retrieval`, given as `retrieval.FIELD=VALUE`)."""
    name: str
    fields: dict
    stage: str = "retrieval"
    retrieval: dict = dataclasses.field(default_factory=dict)

    @property
    def shown_fields(self) -> dict:
        """The fields it replaces as `--arm` names them (retrieval ones as `retrieval.FIELD`)."""
        return {**self.fields, **{f"{RETRIEVED}{field}": value
                                  for field, value in self.retrieval.items()}}


def parse_arm(text: str, stage: str = "retrieval") -> Arm:
    """`NAME:FIELD=VALUE,...` (or `NAME` alone: the config unchanged) -> Arm, each value read
    as its field's type in the `stage`'s config (`none` for an optional field's None); a
    ranking arm's `retrieval.FIELD=VALUE`, in the retrieval config."""
    name, _, fields = (part.strip() for part in text.partition(":"))
    if not ARM_NAME.fullmatch(name):
        raise ValueError(f"--arm {text!r}: name the arm with letters, digits, '_', '.' or "
                         f"'-'; give {ARM_FORM}")
    if stage == "ranking" and name == RETRIEVAL_ALONE:
        raise ValueError(f"--arm {text!r}: {RETRIEVAL_ALONE!r} names the row of retrieval "
                         "alone; name the arm otherwise")
    replaced, retrieval = {}, {}
    for item in filter(None, fields.split(",")):
        field, equals, value = (part.strip() for part in item.partition("="))
        own = stage == "ranking" and field.startswith(RETRIEVED)   # the arm's retrieval's
        prefix, field = (RETRIEVED, field[len(RETRIEVED):]) if own else ("", field)
        field_stage = "retrieval" if own else stage
        types = typing.get_type_hints(STAGES[field_stage])
        if not equals or field not in types:
            widths = " (layer widths are joined by '/', e.g. deep_layers=256/128)" if (
                not equals and any(typing.get_origin(kind) is tuple
                                   for kind in types.values())) else ""
            raise ValueError(f"--arm {text!r}: {item!r} is not FIELD=VALUE of a {field_stage} "
                             f"config field{widths}{_field_hint(field, field_stage, stage)}; "
                             "known fields: " + ", ".join(
                                 prefix + name for name in types if name not in NOT_ARMS))
        if field in NOT_ARMS:
            raise ValueError(f"--arm {text!r}: {NOT_ARMS[field]}; leave {prefix}{field} out")
        given = retrieval if own else replaced
        if field in given:
            raise ValueError(f"--arm {text!r}: {prefix}{field} is given twice")
        given[field] = _typed(text, field, types[field], value)
    return Arm(name, replaced, stage, retrieval)


def _field_hint(field: str, field_stage: str, stage: str) -> str:
    """Where a field unknown to `field_stage`'s config belongs, for an arm of `stage`."""
    bare = field[len(RETRIEVED):] if field.startswith(RETRIEVED) else field
    if bare in NOT_ARMS:                                    # no arm may set it, in any form
        return f" ({NOT_ARMS[bare]}; leave it out)"
    if stage == "retrieval" and bare != field:
        if bare in typing.get_type_hints(RetrievalConfig):
            return (f" (a retrieval arm names {bare} alone; {field} is for ranking arms, "
                    "--stage ranking)")
        field = bare
    other = next((name for name in STAGES if name != field_stage
                  and field in typing.get_type_hints(STAGES[name])), None)
    if other is None:
        return ""
    if other == stage:                   # retrieval.FIELD of a ranking field, on a ranking arm
        return f" ({field} is a {other} field: drop the '{RETRIEVED}' prefix)"
    if other == "retrieval":             # a retrieval field on a ranking arm
        return (f" ({field} is a retrieval field: pass --stage retrieval, or "
                f"{RETRIEVED}{field}=VALUE to train this arm's retrieval with it)")
    return f" ({field} is a {other} field: pass --stage {other})"


def _typed(arm: str, field: str, kind, value: str):
    """`value` read as `kind` (int, float, bool or str, each maybe optional, or a tuple of
    ints given as `256/128`)."""
    if typing.get_origin(kind) is tuple:
        try:
            return tuple(int(units) for units in value.split("/"))
        except ValueError:
            raise ValueError(f"--arm {arm!r}: {field} takes integers joined by '/', e.g. "
                             f"256/128, got {value!r}") from None
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
    the data config, the shared configs, the arms and the seeds; before the log loads."""
    if configs.data.split.partition(":")[0] not in ("temporal", "global"):
        why = {**dict.fromkeys(("none", "random"), " holds no validation rows to compare on"),
               "latest": " is a deployment run: its validation rows tune what it serves"}
        raise ValueError(f"split {configs.data.split!r}" + why.get(
            configs.data.split, ": not a protocol") + "; use temporal or global[:Q]")
    configs.data.validate()
    configs.retrieval.validate(history_length=configs.data.history_length)
    if arms and arms[0].stage == "ranking":
        configs.ranking.validate(history_length=configs.data.history_length)
        configs.run.validate()
    if len(arms) < 2:
        raise ValueError(f"a comparison needs two arms or more (--arm {ARM_FORM}); got "
                         f"{len(arms)}")
    names = [arm.name for arm in arms]
    if len(set(names)) < len(names):
        raise ValueError(f"arm names must differ; got {names}")
    if len({arm.stage for arm in arms}) > 1:
        raise ValueError("arms of one comparison change one stage's config; got "
                         f"{sorted({arm.stage for arm in arms})}")
    if not seeds or len(set(seeds)) < len(seeds) or not all(seed in SEEDS for seed in seeds):
        raise ValueError(f"--seeds must be one seed or more, each once, each from 0 to "
                         f"2**32 - 1; got {seeds}")
    for arm in arms:
        _checked(arm, configs)


def _checked(arm: Arm, configs: Configs, log: Interactions | None = None) -> Configs:
    """The arm's configs (seed 0), or ValueError naming the arm when they cannot work (with
    the log, when given: its user features and ratings)."""
    try:
        arm_config = arm_configs(arm, configs, 0)
        arm_config.retrieval.validate(
            history_length=configs.data.history_length,
            has_user_features=None if log is None else bool(log.user_features))
        if arm.stage == "ranking":
            arm_config.ranking.validate(has_ratings=log is None or log.rating is not None,
                                        history_length=configs.data.history_length)
    except ValueError as error:
        raise ValueError(f"arm {arm.name!r}: {error}") from None
    return arm_config


def validation_split(log: Interactions, configs: Configs, arms: list[Arm]) -> Split:
    """The log's split, checked before anything trains: it holds validation rows, and every
    arm's configs fit the log (its user features and ratings, its training rows). Raises
    ValueError (or DataError) naming what does not."""
    parts = split(log, configs.data.split)
    if not len(parts.validation):
        raise ValueError(f"split {configs.data.split!r} leaves no validation rows in this log "
                         "to compare on")
    for arm in arms:
        arm_config = _checked(arm, configs, log)
        try:
            arm_config.retrieval.require_whole_batch(len(parts.train))
        except ValueError as error:
            whose, field = ((f"arm {arm.name!r}", "batch_size") if arm.stage == "retrieval" else
                            (f"the retrieval config whose lists arm {arm.name!r} re-ranks",
                             "retrieval.batch_size"))
            raise ValueError(f"{whose}: {error}; give the arm {field}={len(parts.train)} or "
                             "less") from None
    return parts


def arm_configs(arm: Arm, configs: Configs, seed: int) -> Configs:
    """The configs an arm trains with one seed (`pipeline.config.resolve`, which refuses what
    it refuses for a run): its fields replaced in its stage's config, and the seed in every
    stage it trains."""
    stages = {"retrieval": {"seed": seed, **arm.retrieval},
              "ranking": {"seed": seed} if arm.stage == "ranking" else {}}
    stages[arm.stage].update(arm.fields)
    return resolve(base=configs, **stages)


def retrieval_rows(arms: list[Arm], configs: Configs) -> dict[str, str]:
    """Ranking arm name -> the row of the retrieval model whose lists it re-ranks:
    RETRIEVAL_ALONE for the first arm's retrieval config, `retrieval:NAME` for another, after
    the first arm NAME that trains it. Arms whose resolved retrieval configs are equal share one
    model a seed."""
    rows, named = {}, {}
    for arm in arms:
        config = arm_configs(arm, configs, 0).retrieval
        named.setdefault(config, f"{RETRIEVAL_ALONE}:{arm.name}" if named else RETRIEVAL_ALONE)
        rows[arm.name] = named[config]
    return rows


def compare(log: Interactions, parts: Split, configs: Configs, arms: list[Arm],
            seeds: list[int], verbose: int = 1,
            seed_done: typing.Callable[[dict, dict], None] | None = None
            ) -> tuple[dict, dict[str, np.ndarray]]:
    """Trains every arm with every seed and compares them on the validation rows of `parts`
    (`validation_split`).

    Args:
        seed_done: called with (result, ranks) of the seeds done so far after every seed but
            the last (e.g. to write them, so that an interrupted comparison keeps them).

    Returns:
        (result, ranks): result = {"stage", "split", "seeds": the seeds done, "seeds_left":
        those not yet done (none once it returns), "cold_start_window" (as a run chooses it),
        "validation": {"rows", "users"}, "early_stopping": whether an arm stops early,
        "epoch_choice_differs": whether arms stop early after other epochs or patience,
        "arms": {name: {"fields": the fields it replaces (a ranking arm's retrieval ones as
        "retrieval.FIELD"), "runs": [each seed's run, with
        "gain": {metric: its mean gain over the first arm's run of the same seed}], "recall@10"
        and "ndcg@10": the means over seeds, "gain": None for the first arm, else {metric:
        `paired_bootstrap` of its rows' seed means against the first arm's, users resampled}}},
        and for ranking arms "retrieval" (retrieval alone, the first arm's retrieval config:
        "fields", "runs", "recall@10", "ndcg@10"), "other_retrieval" ({"retrieval:NAME": the
        same} for the other retrieval configs of arms, `retrieval_rows`; only when there are
        some), each arm's "retrieval" (the row whose lists it re-ranks) and its
        "gain_over_retrieval" (over that row)}; ranks = {"rows": [m] the validation rows (log
        row positions), "users": [m] their user codes, "NAME/SEED": [m] each row's rank, with
        "retrieval/SEED" and "retrieval:NAME/SEED" for ranking arms}.

    Raises:
        ValueError: an arm that failed to train, naming it, the seed and the error.
    """
    window = configs.data.cold_start_window or cold_start_window(log, parts)["window"]
    inputs = prepare(log, parts, configs.data.history_length,
                     exclude_seen=configs.data.exclude_seen, cold_start_window=window)
    evalset = eval_set(log, parts, "validation", exclude_seen=inputs.exclude_seen)
    stage = arms[0].stage
    early_stopping, epoch_choice_differs = stopping_of(arms, configs)
    arms_stop_early = any(patience > 0 for _, patience in _stopping(arms, configs, stage))
    header = {"stage": stage, "split": parts.kind, "cold_start_window": window,
              "validation": {"rows": len(evalset), "users": len(np.unique(evalset.users))},
              "early_stopping": early_stopping, "epoch_choice_differs": epoch_choice_differs,
              "arms_stop_early": arms_stop_early}
    ranks = {"rows": evalset.rows, "users": evalset.users}
    retrieval_of = retrieval_rows(arms, configs) if stage == "ranking" else {}
    runs: dict[str, list[dict]] = {}
    rows: dict[str, dict[str, list]] = {}                  # name -> metric -> [seeds][m]
    for done, seed in enumerate(seeds, 1):
        seed_runs = {"retrieval": _retrieval_runs, "ranking": _ranking_runs}[stage](
            arms, seed, configs, inputs, evalset)
        for name, run, found in seed_runs:
            ranks[f"{name}/{seed}"] = found
            metrics = row_metrics(found, 10)
            for metric in METRICS:
                rows.setdefault(name, {}).setdefault(metric, []).append(metrics[metric])
            run = {"seed": seed, **{metric: float(metrics[metric].mean())
                                    for metric in METRICS}, **run}
            runs.setdefault(name, []).append(run)
            if verbose:
                print(f"[compare] {name}, seed {seed}: validation Recall@10 "
                      f"{run['recall@10']:.4f} / NDCG@10 {run['ndcg@10']:.4f} (epoch "
                      f"{run['best_epoch']} of {run['epochs']}, {run['seconds']:.0f} s)",
                      flush=True)
        if done == len(seeds) or seed_done is not None:
            result = {**header, "seeds": list(seeds[:done]), "seeds_left": list(seeds[done:]),
                      **_summaries(arms, runs, rows, evalset.users, retrieval_of)}
            if done < len(seeds):
                seed_done(result, dict(ranks))
    return result, ranks


def _summaries(arms: list[Arm], runs: dict[str, list[dict]], rows: dict[str, dict[str, list]],
               users: np.ndarray, retrieval_of: dict[str, str]) -> dict:
    """The result's "arms" (and for ranking arms "retrieval", and "other_retrieval" when
    some arms re-rank another retrieval model's lists: `retrieval_of`, arm -> its retrieval
    row) from each row's runs and its per-row figures of every seed done (`rows`: name ->
    metric -> [seeds][m])."""
    means = {name: {metric: np.mean(values, axis=0) for metric, values in metrics.items()}
             for name, metrics in rows.items()}                   # name -> metric -> [m]

    def summary(name: str, reference: str | None) -> dict:
        """A row's means over seeds, and its gain over `reference`'s rows."""
        return {"runs": [dict(run) for run in runs[name]],
                **{metric: float(means[name][metric].mean()) for metric in METRICS},
                "gain": None if reference is None else {
                    metric: paired_bootstrap(means[name][metric], means[reference][metric],
                                             groups=users) for metric in METRICS}}

    first, ranking = arms[0].name, arms[0].stage == "ranking"
    result = {"arms": {}}
    for arm in arms:
        result["arms"][arm.name] = {"fields": arm.shown_fields,
                                    **summary(arm.name, None if arm.name == first else first)}
        for run, reference in zip(result["arms"][arm.name]["runs"], runs[first]):
            run["gain"] = None if arm.name == first else {
                metric: run[metric] - reference[metric] for metric in METRICS}
        if ranking:
            result["arms"][arm.name]["retrieval"] = retrieval_of[arm.name]
            result["arms"][arm.name]["gain_over_retrieval"] = summary(
                arm.name, retrieval_of[arm.name])["gain"]
    if ranking:
        alone = {}
        for arm in arms:                          # each retrieval row, with its first arm's fields
            row = retrieval_of[arm.name]
            if row not in alone:
                alone[row] = {"fields": {f"{RETRIEVED}{field}": value
                                         for field, value in arm.retrieval.items()},
                              **{key: value for key, value in summary(row, None).items()
                                 if key != "gain"}}
        result["retrieval"] = alone.pop(RETRIEVAL_ALONE)
        if alone:
            result["other_retrieval"] = alone
    return result


def identical_arms(arms: list[Arm], configs: Configs) -> list[str]:
    """A note for each arm that trains exactly as an earlier one (its fields change nothing:
    the preset's values), so that a gain of zero is not read as a finding."""
    notes, seen = [], {}
    for arm in arms:
        trained = json.dumps(arm_configs(arm, configs, 0).to_dict(), sort_keys=True)
        if trained in seen:
            notes.append(f"arm {arm.name!r} trains exactly as arm {seen[trained]!r}: the "
                         "configs they resolve to are equal")
        seen.setdefault(trained, arm.name)
    return notes


def stopping_of(arms: list[Arm], configs: Configs) -> tuple[bool, bool]:
    """(whether an arm stops early, whether arms stop early after other epochs or patience:
    then they choose their epoch among more or fewer looks at the rows they are compared on)."""
    stages = ["retrieval"] + (["ranking"] if arms and arms[0].stage == "ranking" else [])
    early_stopping = differs = False               # a ranking arm's retrieval chooses its epoch too
    for stage in stages:
        stopping = _stopping(arms, configs, stage)
        stops = any(patience > 0 for _, patience in stopping)
        early_stopping |= stops
        differs |= len(stopping) > 1 and stops
    return early_stopping, differs


def _stopping(arms: list[Arm], configs: Configs, stage: str) -> set[tuple[int, int]]:
    """The (epochs, early-stopping patience) pairs of the arms' `stage` configs."""
    return {(config.epochs, config.early_stopping_patience) for config in
            (getattr(arm_configs(arm, configs, 0), stage) for arm in arms)}


@contextlib.contextmanager
def _failing_as(name: str, seed: int):
    """Any error inside as one ValueError line naming the arm (or retrieval alone) and seed."""
    try:
        yield
    except Exception as error:                 # one line, as a failed step of a run
        raise ValueError(f"{name}, seed {seed}: {one_line(error)}") from error


def _retrieval_run(config: RetrievalConfig, inputs: ModelInputs, evalset: EvalSet):
    """Trains retrieval and ranks the validation rows over the catalogue as a run scores them.

    Returns:
        (model, {"epochs", "best_epoch", "val_recall@10": early stopping's figure of every
        epoch}, [m] each validation row's rank).
    """
    from tworec.retrieval import train as retrieval            # TensorFlow from here
    model, summary = retrieval.fit(inputs, config, verbose=0)
    found = evaluate_ranks(retrieval.catalogue_scorer(model, inputs, "validation", evalset),
                           evalset, "retrieval")
    return model, {"epochs": summary["epochs"], "best_epoch": summary["best_epoch"],
                   "val_recall@10": summary["history"]["val_recall@10"]}, found


def _retrieval_runs(arms: list[Arm], seed: int, configs: Configs, inputs: ModelInputs,
                    evalset: EvalSet):
    """Yields (arm name, {"epochs", "best_epoch", "val_recall@10", "seconds"}, [m] ranks) of
    every retrieval arm trained with `seed`."""
    for arm in arms:
        start = time.perf_counter()
        with _failing_as(f"arm {arm.name!r}", seed):
            _, run, found = _retrieval_run(arm_configs(arm, configs, seed).retrieval, inputs,
                                           evalset)
        yield arm.name, {**run, "seconds": round(time.perf_counter() - start, 1)}, found


def _ranking_runs(arms: list[Arm], seed: int, configs: Configs, inputs: ModelInputs,
                  evalset: EvalSet):
    """Yields every ranking arm's (name, {"epochs", "best_epoch", "seconds", and a ranker's
    "calibration": each fold's}, [m] ranks) with `seed`, each retrieval row's (`retrieval_rows`:
    retrieval alone's first) just before the first arm that re-ranks its lists: a retrieval
    model serves the lists its arms re-rank (with the arm's title candidates added), and gives
    the hard negatives, as in a run; a re-ranked row's rank past the served top_n is a miss."""
    from tworec.ranking import features as ranking_features        # TensorFlow from here
    from tworec.ranking import train as ranking
    from tworec.retrieval import train as retrieval
    run_config, _ = configs.run.for_catalogue(int(inputs.catalogue.sum()))
    retrieval_of, lists = retrieval_rows(arms, configs), {}
    for at, arm in enumerate(arms):
        row = retrieval_of[arm.name]
        if row not in lists:
            start = time.perf_counter()
            with _failing_as(row, seed):
                model, run, found = _retrieval_run(arm_configs(arm, configs, seed).retrieval,
                                                   inputs, evalset)
                lists[row] = (
                    {part: retrieval.top_candidates(model, inputs, part,
                                                    run_config.hard_negative_pool)
                     for part in ("train", "validation")},
                    retrieval.top_candidates(model, inputs, "validation",                # [m, C]
                                             run_config.candidates, evalset=evalset),
                    retrieval.embeddings_for_ranking(model, inputs))
            yield row, {**run, "seconds": round(time.perf_counter() - start, 1)}, \
                np.where(found >= run_config.candidates, MISS, found)   # as the export serves it
        hard, served, embeddings = lists[row]
        if all(retrieval_of[later.name] != row for later in arms[at + 1:]):
            del lists[row]                           # no later arm re-ranks its lists
        start = time.perf_counter()
        config = arm_configs(arm, configs, seed).ranking
        with _failing_as(f"arm {arm.name!r}", seed):
            signals = ranking_features.signals(inputs, config, embeddings)
            ranker, summary = ranking.fit(inputs, config, signals, hard=hard, verbose=0)
            reordered = ranking_features.with_title_candidates(                  # [m, C + E]
                signals, inputs, "validation", served, evalset.excluded)
            scores, calibration = (cross_fitted_scores(ranker, inputs, signals, reordered,
                                                       evalset.users)
                                   if ranking.calibrates(config) else
                                   (ranking.score_lists(ranker, inputs, signals, "validation",
                                                        reordered), None))
            positions, _ = ranking.reranked_ranks(scores, reordered,
                                                  inputs.examples["validation"]["item"],
                                                  in_order=~inputs.known_in("validation"))
        yield arm.name, {"epochs": summary["epochs"], "best_epoch": summary["best_epoch"],
                         "calibration": calibration,
                         "seconds": round(time.perf_counter() - start, 1)}, \
            np.where(positions >= run_config.top_n, MISS, positions)


def calibration_folds(users: np.ndarray, folds: int = CALIBRATION_FOLDS) -> np.ndarray:
    """[m] each row's fold, 0 .. folds - 1, by its user (`users` [m]: a user's rows share a
    fold), from a fixed shuffle of the users: the same folds for every arm and seed."""
    unique, row_user = np.unique(users, return_inverse=True)
    return np.random.default_rng(0).permutation(len(unique))[row_user] % folds


def cross_fitted_scores(model, inputs: ModelInputs, signals, candidates: np.ndarray,
                        users: np.ndarray) -> tuple[np.ndarray, list[dict]]:
    """[m, C] the validation lists' scores, each fold's rows scored by the ranker calibrated
    on the other folds' rows (`ranking.train.calibrate` with `fit_rows`): a run calibrates on
    every validation row and is scored on test, so validation is scored out of fold. The
    ranker's trained weights are restored after each fold.

    Args:
        model: a trained ranker (not calibrated). candidates: [m, C] the served lists.
        users: [m] each validation row's user.

    Returns:
        (scores, [each fold's calibration, as `calibrate` returns it]).
    """
    from tworec.ranking import train as ranking
    folds = calibration_folds(users)
    trained = model.get_weights()
    scores = np.zeros(candidates.shape, np.float32)
    calibrations = []
    for fold in range(CALIBRATION_FOLDS):
        scored = folds == fold
        calibrations.append(ranking.calibrate(model, inputs, signals, "validation", candidates,
                                              fit_rows=~scored))
        scores[scored] = ranking.score_lists(model, inputs, signals, "validation",
                                             candidates)[scored]
        model.set_weights(trained)
    return scores, calibrations


def table(result: dict) -> str:
    """The comparison as Markdown: each arm's means over seeds, its gain over the first arm
    with the 95% interval, and the least and most of its seeds' own gains; for ranking arms,
    retrieval alone's rows first and each arm's gain over the one whose lists it re-ranks."""
    names = list(result["arms"])
    ranking = result.get("stage") == "ranking"
    lines = [f"Validation ({result['split']}, {result['validation']['rows']} rows of "
             f"{result['validation']['users']} users), mean over seeds "
             f"{', '.join(map(str, result['seeds']))}; gains over {names[0]!r}, paired "
             "bootstrap 95% over users (not over seeds: 'NDCG@10 gain, seeds' gives the least "
             "and most of the seeds' own gains). " + (
                 "A run that stops early (early_stopping_patience > 0) chose its epoch on "
                 "these rows, as a run chooses it." if result["early_stopping"] else
                 "Each run kept its last epoch (no early stopping).")]
    others = result.get("other_retrieval", {})
    if ranking:
        lines.append(("Each ranking arm re-ranks the lists of the same retrieval model per seed "
                      "(retrieval alone's row)" if not others else
                      "Each ranking arm re-ranks the lists of its retrieval model per seed "
                      "(retrieval alone's row for the first arm's retrieval config, or the "
                      "row named after the first arm of another; its gain over retrieval is "
                      "over that row)")
                     + ", as the served two-stage list; a calibrated ranker is calibrated on "
                     "half of the users and scores the other half.")
    if result.get("command"):
        lines.append(f"Command: `{result['command']}`")
    lines += [f"Note: {note}" for note in result.get("notes", [])]
    if result.get("seeds_left"):
        lines.append(f"Partial: {seeds_named(result['seeds_left'])} not run yet (the "
                     "comparison stopped, or is still running).")
    skipped = [f"{name}, seed {run['seed']}" for name, arm in result["arms"].items()
               for run in arm["runs"] if any("skipped" in fold
                                             for fold in run.get("calibration") or [])]
    if skipped:
        lines.append(f"Note: a fold kept the trained weights, its calibration skipped "
                     f"(compare.json says why): {'; '.join(skipped)}.")
    stopped = (_other_epochs(result) if result.get("arms_stop_early", result["early_stopping"])
               else "")
    if result["epoch_choice_differs"]:
        lines.append("Note: arms stop early after other epochs or patience, so they choose "
                     "their epoch among more or fewer looks at these rows; the arm that looks "
                     "more often is favoured.")
    elif stopped:
        lines.append(f"Note: arms that stop early stopped after other numbers of epochs "
                     f"({stopped}), so they chose their epoch among more or fewer looks at "
                     "these rows; the arm that looks more often is favoured.")
    lines += [f"Note: {note}" for note in _seed_uncertainty_notes(result)]
    columns = ["arm", "fields", "Recall@10", "NDCG@10", "Recall@10 gain", "NDCG@10 gain",
               "NDCG@10 gain, seeds"] + (["NDCG@10 gain over retrieval"] if ranking else [])
    lines += ["", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]

    def interval(gain: dict | None) -> str:
        return "-" if gain is None else "{difference:+.4f} ({ci95[0]:+.4f} to " \
            "{ci95[1]:+.4f})".format(**gain)

    def shown(fields: dict) -> str:
        return ", ".join(f"{key}={value}" for key, value in fields.items()) or "-"

    if ranking:
        for row, alone in {"retrieval alone": result["retrieval"],
                           **{f"retrieval alone ({row})": alone
                              for row, alone in others.items()}}.items():
            lines.append(f"| {row} | {shown(alone['fields'])} | "
                         f"{alone['recall@10']:.4f} | {alone['ndcg@10']:.4f} | - | - | - | - |")
    for name, arm in result["arms"].items():
        fields = shown(arm["fields"])
        gains = [interval(arm["gain"] and arm["gain"][metric]) for metric in METRICS]
        seeds = [run["gain"]["ndcg@10"] for run in arm["runs"] if run["gain"]]
        spread = f"{min(seeds):+.4f} to {max(seeds):+.4f}" if seeds else "-"
        over = [interval(arm["gain_over_retrieval"]["ndcg@10"])] if ranking else []
        lines.append("| " + " | ".join([name, fields, f"{arm['recall@10']:.4f}",
                                        f"{arm['ndcg@10']:.4f}", *gains, spread, *over]) + " |")
    return "\n".join(lines) + "\n"


def _other_epochs(result: dict) -> str:
    """'seed 0: a 3, slow 6' for the seeds whose arms trained other numbers of epochs, or ''."""
    epochs: dict[int, dict[str, int]] = {}
    for name, arm in result["arms"].items():
        for run in arm["runs"]:
            epochs.setdefault(run["seed"], {})[name] = run["epochs"]
    return "; ".join(f"seed {seed}: " + ", ".join(f"{name} {count}" for name, count in
                                                  by_arm.items())
                     for seed, by_arm in epochs.items() if len(set(by_arm.values())) > 1)


def _seed_uncertainty_notes(result: dict) -> list[str]:
    """A note for each arm whose mean NDCG@10 gain is more uncertain over its seeds (the 95%
    t interval of the seeds' own gains, half-width t(k-1) s / sqrt(k)) than over the users
    drawn (its bootstrap interval's half-width): that interval then understates it."""
    from scipy import stats
    notes = []
    for name, arm in result["arms"].items():
        seeds = np.array([run["gain"]["ndcg@10"] for run in arm["runs"] if run["gain"]])
        if len(seeds) < 2:
            continue
        over_seeds = stats.t.ppf(0.975, len(seeds) - 1) * seeds.std(ddof=1) / np.sqrt(len(seeds))
        low, high = arm["gain"]["ndcg@10"]["ci95"]
        if over_seeds > (high - low) / 2:
            notes.append(f"arm {name!r}: over its {len(seeds)} seeds its mean NDCG@10 gain is "
                         f"uncertain by ±{over_seeds:.4f} (a t interval of the seeds' own "
                         f"gains), more than by ±{(high - low) / 2:.4f} over the users drawn: "
                         "its interval understates the gain's uncertainty.")
    return notes


def seeds_named(seeds: list[int]) -> str:
    """'seed 3' or 'seeds 0, 1'."""
    return f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"


def write(out: str, result: dict, ranks: dict[str, np.ndarray], source: dict,
          configs: Configs) -> None:
    """Writes OUTPUTS into the folder `out`: the ranks, the result with the source and the
    configs, and the table. All three are written aside first, then renamed over the old ones,
    the table last: a stopped write leaves whole files that hold at least the seeds the table
    names, and a failed one leaves no file aside."""
    contents = {"ranks.npz": lambda f: np.savez(f, **ranks),
                "compare.json": lambda f: f.write(json.dumps(
                    {"source": source, "configs": configs.to_dict(), **result},
                    indent=2).encode()),
                "compare.md": lambda f: f.write(table(result).encode())}
    aside = {name: os.path.join(out, name + ".partial") for name in contents}
    try:
        for name, save in contents.items():
            with open(aside[name], "wb") as f:
                save(f)
        for name in contents:
            os.replace(aside[name], os.path.join(out, name))
    finally:
        for path in aside.values():
            if os.path.exists(path):
                os.remove(path)
