"""Retrieval configs compared on validation (`pipeline.compare`, `scripts/compare.py`)."""
import dataclasses
import functools
import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from tworec.evaluation.metrics import paired_bootstrap, row_metrics
from tworec.features import load, split
from tworec.pipeline import compare as comparison
from tworec.pipeline.compare import (Arm, check_arms, compare, identical_arms, parse_arm,
                                     stopping_of, table, validation_split)
from tworec.pipeline.config import resolve

from helpers import exit_before_tensorflow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_an_arm_reads_each_value_as_its_field_type():
    arm = parse_arm("mine: members=2,temperature=0.1,l2_normalize=false,"
                    "num_hard_negatives=none,history_encoder=mean")
    assert arm == Arm("mine", {"members": 2, "temperature": 0.1, "l2_normalize": False,
                               "num_hard_negatives": None, "history_encoder": "mean"})
    assert type(arm.fields["temperature"]) is float and parse_arm("base") == Arm("base", {})
    assert parse_arm("hard:num_hard_negatives=4").fields == {"num_hard_negatives": 4}


@pytest.mark.parametrize("text, message", [
    (":members=2", "name the arm with letters"),
    ("a|b:members=2", "name the arm with letters"),
    ("a:members=2,members=3", "members is given twice"),
    ("a:temperature=nan", "temperature takes float, got 'nan'"),
    ("a:learning_rate=inf", "learning_rate takes float, got 'inf'"),
    ("a:num_hard_negatives=some", "num_hard_negatives takes int or none, got 'some'"),
    ("a:members", "is not FIELD=VALUE"),
    ("a:width=2", "'width=2' is not FIELD=VALUE of a retrieval config field; known fields: "
                  "embedding_dim, members"),
    ("a:num_negatives=5", "'num_negatives=5' is not FIELD=VALUE of a retrieval config field "
                          "(num_negatives is a ranking field: pass --stage ranking)"),
    ("a:seed=1", "every arm trains with the seeds of --seeds; leave seed out"),
    ("a:strategy=mirrored", "a comparison trains every arm in one process"),
    ("a:members=two", "members takes int, got 'two'"),
    ("a:members=none", "members takes int, got 'none'"),
    ("a:l2_normalize=yes", "l2_normalize takes bool, got 'yes'"),
    ("a:temperature=warm", "temperature takes float, got 'warm'"),
])
def test_an_arm_that_cannot_be_read_is_named_with_what_would_work(text, message):
    with pytest.raises(ValueError, match="^--arm") as error:
        parse_arm(text)
    assert message in str(error.value)
    known = str(error.value).partition("known fields: ")[2].split(", ")
    assert not {"seed", "strategy", "partitioner"} & set(known)     # fields it refuses


@pytest.mark.parametrize("arms, seeds, data, message", [
    (["a"], [0], {}, "a comparison needs two arms or more"),
    (["a", "a:members=2"], [0], {}, "arm names must differ"),
    (["a", "b"], [], {}, "--seeds must be one seed or more"),
    (["a", "b"], [1, 1], {}, "each once, each from 0 to 2**32 - 1; got [1, 1]"),
    (["a", "b"], [-1], {}, "each from 0 to 2**32 - 1; got [-1]"),
    (["a", "b"], [2 ** 32], {}, "each from 0 to 2**32 - 1"),
    (["a", "b:learning_rate=0"], [0], {}, "arm 'b': learning_rate must be a positive number"),
    (["a", "b:early_stopping_patience=-1"], [0], {}, "arm 'b': early_stopping_patience must"),
    (["a", "b"], [0], {"split": "random"}, "split 'random' holds no validation rows"),
    (["a", "b:members=0"], [0], {}, "arm 'b': members must be positive"),
    (["a", "b:history_encoder=lstm"], [0], {}, "arm 'b': history_encoder 'lstm'"),
    (["a", "b"], [0], {"split": "none"}, "split 'none' holds no validation rows"),
    (["a", "b"], [0], {"split": "latest"}, "split 'latest' is a deployment run"),
    (["a", "b"], [0], {"split": "weekly"},
     "split 'weekly': not a protocol; use temporal or global[:Q]"),
])
def test_arms_that_cannot_be_compared_are_refused_before_the_log_loads(arms, seeds, data,
                                                                      message):
    with pytest.raises(ValueError) as error:
        check_arms([parse_arm(text) for text in arms], resolve("tiny", data=data), seeds)
    assert message in str(error.value)


def test_a_setting_every_arm_shares_is_named_as_such():
    with pytest.raises(ValueError, match="^epochs must be positive"):
        check_arms([parse_arm("a"), parse_arm("b")], resolve("tiny", epochs=0), [0])


@pytest.mark.parametrize("arm, data, without_user_features, message", [
    ("b:batch_size=100000", {}, False, "arm 'b': batch_size 100000 is larger than the training"),
    ("b", {"split": "global:0.0001"}, False, "split 'global:0.0001' leaves no validation rows"),
    ("b:use_user_id=false,history_encoder=none", {}, True,
     "arm 'b': the query tower reads nothing: keep use_user_id or a history_encoder (this "
     "log has no user features)"),
])
def test_an_arm_that_does_not_fit_the_log_is_refused_before_training(arm, data,
                                                                     without_user_features,
                                                                     message):
    log = load("synthetic:tiny")
    if without_user_features:
        log = dataclasses.replace(log, user_features={})
    validation_split(log, resolve("tiny"), [parse_arm("a"), parse_arm(arm.split(":")[0])])
    with pytest.raises(ValueError) as error:
        validation_split(log, resolve("tiny", data=data), [parse_arm("a"), parse_arm(arm)])
    assert message in str(error.value)


@pytest.mark.parametrize("message, cause", [
    ("out of memory\nwhere it happened", "out of memory"),
    ("Graph execution error:\n\nDetected at node x\n  shapes differ\n", "shapes differ"),
])
def test_an_arm_that_fails_to_train_is_named_with_its_seed_and_cause_in_one_line(
        monkeypatch, message, cause):
    from tworec.retrieval import train as retrieval
    real_fit = retrieval.fit

    def fit(inputs, config, verbose):
        if config.embedding_dim == 8:
            raise RuntimeError(message)
        return real_fit(inputs, config, verbose=verbose)
    monkeypatch.setattr(retrieval, "fit", fit)
    log = load("synthetic:tiny")
    configs = resolve("tiny", epochs=1, steps=("train retrieval",))
    arms = [parse_arm("a"), parse_arm("b:embedding_dim=8")]
    with pytest.raises(ValueError) as error:
        compare(log, validation_split(log, configs, arms), configs, arms, [4], verbose=0)
    assert str(error.value) == f"arm 'b', seed 4: RuntimeError: {cause}"


def test_each_arm_scores_the_validation_rows_as_its_model_and_gains_are_paired_by_user():
    """Two identical arms give the same ranks and a gain of exactly zero; every figure is what
    the saved ranks give: each arm's mean over seeds, and the gain's bootstrap over users of the
    rows' seed means. Only validation rows are ranked. (The global protocol holds out several
    rows of a user: the bootstrap must resample users, not rows.)"""
    log = load("synthetic:tiny")
    configs = resolve("tiny", epochs=1, steps=("train retrieval",), data={"split": "global"})
    arms = [parse_arm("base"), parse_arm("same"), parse_arm("mean:history_encoder=mean")]
    seeds = [0, 3]
    partial = []
    result, ranks = compare(log, validation_split(log, configs, arms), configs, arms, seeds,
                            verbose=0, seed_done=lambda *done: partial.append(done))
    assert not result["early_stopping"] and not result["epoch_choice_differs"]
    assert result["seeds"] == seeds and result["seeds_left"] == []

    validation = split(log, "global").validation
    assert np.array_equal(ranks["users"], log.user[validation])
    assert result["validation"] == {"rows": len(validation),
                                    "users": len(np.unique(log.user[validation]))}
    for seed in seeds:
        assert np.array_equal(ranks[f"base/{seed}"], ranks[f"same/{seed}"])
    assert not np.array_equal(ranks["base/0"], ranks["base/3"])           # seeds differ
    assert result["arms"]["same"]["gain"]["ndcg@10"]["difference"] == 0
    assert result["arms"]["same"]["gain"]["ndcg@10"]["ci95"] == [0, 0]
    assert result["arms"]["base"]["gain"] is None

    def seed_means(name: str, metric: str) -> np.ndarray:                   # [m]
        return np.mean([row_metrics(ranks[f"{name}/{seed}"], 10)[metric] for seed in seeds], 0)

    for metric in ("recall@10", "ndcg@10"):
        arm = result["arms"]["mean"]
        assert arm[metric] == pytest.approx(seed_means("mean", metric).mean(), abs=1e-12)
        assert [run[metric] for run in arm["runs"]] == pytest.approx(
            [row_metrics(ranks[f"mean/{seed}"], 10)[metric].mean() for seed in seeds])
        assert [run["gain"][metric] for run in arm["runs"]] == pytest.approx(
            [row_metrics(ranks[f"mean/{seed}"], 10)[metric].mean()
             - row_metrics(ranks[f"base/{seed}"], 10)[metric].mean() for seed in seeds])
        assert arm["gain"][metric] == paired_bootstrap(
            seed_means("mean", metric), seed_means("base", metric), groups=ranks["users"])
    assert arm["gain"]["ndcg@10"]["units"] == result["validation"]["users"] < len(validation)
    assert [run["seed"] for run in arm["runs"]] == seeds and arm["fields"] == {
        "history_encoder": "mean"}
    lines = table(result).splitlines()
    notes = [line for line in lines if line.startswith("Note: ")]   # 2 seeds: t(1) is 12.7
    assert len(notes) == 1 and notes[0].startswith("Note: arm 'mean': over its 2 seeds")
    assert lines[-1].startswith("| mean | history_encoder=mean | ") and len(lines) == 7 + len(notes)

    (first, first_ranks), = partial               # after seed 0 only, of seed 0 alone
    assert first["seeds"] == [0] and first["seeds_left"] == [3]
    assert sorted(first_ranks) == ["base/0", "mean/0", "rows", "same/0", "users"]
    assert first["arms"]["mean"]["ndcg@10"] == pytest.approx(
        row_metrics(ranks["mean/0"], 10)["ndcg@10"].mean(), abs=1e-12)
    assert first["arms"]["mean"]["gain"]["ndcg@10"] == paired_bootstrap(
        row_metrics(ranks["mean/0"], 10)["ndcg@10"], row_metrics(ranks["base/0"], 10)["ndcg@10"],
        groups=ranks["users"])
    assert [run["gain"] for run in first["arms"]["mean"]["runs"]] == [
        result["arms"]["mean"]["runs"][0]["gain"]]
    assert table(first).splitlines()[1] == ("Partial: seed 3 not run yet (the comparison "
                                            "stopped, or is still running).")
    assert "Partial" not in table(result)


def test_each_run_is_the_model_a_run_trains_with_its_early_stopping_and_seen_items():
    """An arm's run equals `retrieval.fit` with the arm's config and seed (early stopping on
    validation; its curve is kept), evaluated by `evaluate_model` on validation, here with the
    users' known items ranked (--keep-seen) and the cold-start window chosen as a run does."""
    from tworec.features.inputs import prepare
    from tworec.retrieval import train as retrieval
    log = load("synthetic:tiny")
    configs = resolve("tiny", epochs=10, steps=("train retrieval",), data={"exclude_seen": False},
                      retrieval={"early_stopping_patience": 2, "learning_rate": 0.1,
                                 "batch_size": 32})     # its best epoch is not its last
    prepared = []

    def spy(*args, **kwargs):
        prepared.append(kwargs)
        return prepare(*args, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(comparison, "cold_start_window", lambda *args: {"window": 0.5})
        patch.setattr(comparison, "prepare", spy)
        arms = [parse_arm("a"), parse_arm("b:embedding_dim=8,epochs=2")]
        result, _ = compare(log, validation_split(log, configs, arms), configs, arms, [5],
                            verbose=0)
    assert prepared == [{"exclude_seen": False, "cold_start_window": 0.5}]
    assert result["cold_start_window"] == 0.5
    stopped = result["arms"]["a"]["runs"][0]          # its best epoch is not its last
    assert stopped["best_epoch"] < stopped["epochs"]
    assert result["early_stopping"] and result["epoch_choice_differs"]
    inputs = prepare(log, split(log, "temporal"), configs.data.history_length,
                     exclude_seen=False, cold_start_window=0.5)
    for name, fields in (("a", {}), ("b", {"embedding_dim": 8, "epochs": 2})):
        model, summary = retrieval.fit(inputs, dataclasses.replace(configs.retrieval, seed=5,
                                                                   **fields), verbose=0)
        expected = retrieval.evaluate_model(model, inputs, "validation", ks=(10,))
        run, = result["arms"][name]["runs"]
        assert {key: run[key] for key in expected} == expected
        assert run["val_recall@10"] == summary["history"]["val_recall@10"]
        assert run["best_epoch"] == summary["best_epoch"]


def test_ranking_arms_rerank_one_retrieval_model_per_seed_calibrated_out_of_fold():
    """Ranking arms re-rank the validation lists one retrieval model per seed serves (its own
    row, "retrieval", a miss past the served list), as a run trains and serves them; a
    calibrated ranker scores each fold of users calibrated on the other fold only (here by
    hiding the scored fold's lists), an uncalibrated one as trained; a rank past the served
    top_n is a miss."""
    from tworec.evaluation import MISS, eval_set, evaluate_ranks
    from tworec.features.inputs import EMPTY_SLOT, prepare
    from tworec.ranking import features as ranking_features
    from tworec.ranking import train as ranking
    from tworec.retrieval import train as retrieval
    log = load("synthetic:tiny")
    configs = resolve("tiny", epochs=1, steps=("train retrieval", "train ranking"),
                      run={"top_n": 5, "candidates": 20})
    arms = [parse_arm("cal", "ranking"), parse_arm("raw:calibrate=false", "ranking")]
    result, ranks = compare(log, validation_split(log, configs, arms), configs, arms, [2],
                            verbose=0)

    parts = split(log, "temporal")
    inputs = prepare(log, parts, configs.data.history_length,
                     cold_start_window=result["cold_start_window"])
    evalset = eval_set(log, parts, "validation", exclude_seen=True)
    model, _ = retrieval.fit(inputs, dataclasses.replace(configs.retrieval, seed=2), verbose=0)
    run, _ = configs.run.for_catalogue(int(inputs.catalogue.sum()))
    alone = evaluate_ranks(retrieval.catalogue_scorer(model, inputs, "validation", evalset),
                           evalset, "retrieval")
    assert (alone >= 20).any() and np.array_equal(ranks["retrieval/2"], np.where(
        alone >= run.candidates, MISS, alone))                  # past the served list: a miss
    served = retrieval.top_candidates(model, inputs, "validation", run.candidates,
                                      evalset=evalset)
    hard = {part: retrieval.top_candidates(model, inputs, part, run.hard_negative_pool)
            for part in ("train", "validation")}
    folds = comparison.calibration_folds(evalset.users)
    assert sorted(np.unique(folds)) == [0, 1] and all(
        len(np.unique(folds[evalset.users == user])) == 1 for user in evalset.users)
    targets = inputs.examples["validation"]["item"]
    for name, calibrated in (("cal", True), ("raw", False)):
        config = dataclasses.replace(configs.ranking, seed=2, calibrate=calibrated)
        signals = ranking_features.signals(inputs, config,
                                           retrieval.embeddings_for_ranking(model, inputs))
        ranker, _ = ranking.fit(inputs, config, signals, hard=hard, verbose=0)
        trained, expected = ranker.get_weights(), np.full(len(targets), -7)
        for fold in (0, 1):
            if calibrated:
                hidden = np.where((folds == fold)[:, None], EMPTY_SLOT, served)
                ranking.calibrate(ranker, inputs, signals, "validation", hidden)
            positions, _ = ranking.reranked_ranks(
                ranking.score_lists(ranker, inputs, signals, "validation", served), served,
                targets, in_order=~inputs.known_in("validation"))
            expected[folds == fold] = np.where(positions < 5, positions, MISS)[folds == fold]
            ranker.set_weights(trained)
        assert np.array_equal(ranks[f"{name}/2"], expected), name
    cal, raw = result["arms"]["cal"], result["arms"]["raw"]
    assert [fold["rows"] > 0 for fold in cal["runs"][0]["calibration"]] == [True, True]
    assert raw["runs"][0]["calibration"] is None and raw["fields"] == {"calibrate": False}
    assert result["retrieval"]["ndcg@10"] == pytest.approx(
        row_metrics(ranks["retrieval/2"], 10)["ndcg@10"].mean())
    assert cal["gain_over_retrieval"]["ndcg@10"] == paired_bootstrap(
        row_metrics(ranks["cal/2"], 10)["ndcg@10"], row_metrics(ranks["retrieval/2"], 10)[
            "ndcg@10"], groups=ranks["users"])
    lines = table(result).splitlines()
    assert lines[-3].startswith("| retrieval alone | - | ") and lines[-1].startswith(
        "| raw | calibrate=False | ") and lines[-1].count("|") == 9


def test_a_ranking_arm_reads_ranking_fields_and_is_checked_as_a_ranking_config():
    arm = parse_arm("b:model=bst,num_negatives=4,projection_dim=none", "ranking")
    assert arm == Arm("b", {"model": "bst", "num_negatives": 4, "projection_dim": None},
                      "ranking")
    for text, message in (("retrieval:model=bst", "names the row of retrieval alone"),
                          ("b:members=2", "of a ranking config field (members is a "
                                          "retrieval field: pass --stage retrieval, or "
                                          "retrieval.members=VALUE to train this arm's "
                                          "retrieval with it); known fields: model"),
                          ("b:seed=3", "leave seed out")):
        with pytest.raises(ValueError, match="^--arm") as error:
            parse_arm(text, "ranking")
        assert message in str(error.value)
    assert parse_arm("b:deep_layers=64/32", "ranking").fields == {"deep_layers": (64, 32)}
    with pytest.raises(ValueError, match="'32' is not FIELD=VALUE of a ranking config field "
                                         r"\(layer widths are joined by '/', e.g. "):
        parse_arm("b:deep_layers=64,32", "ranking")        # ',' parts FIELD=VALUE pairs
    with pytest.raises(ValueError, match="deep_layers takes integers joined by '/', e.g. "
                                         "256/128, got 'wide'"):
        parse_arm("b:deep_layers=wide", "ranking")
    configs = resolve("tiny")
    for arm, message in (("b:task=pairwise", "^arm 'b': task 'pairwise'"),
                         ("b:learning_rate=-1", "^arm 'b': learning_rate must be a positive"),
                         ("b:deep_layers=64/0", "^arm 'b': deep_layers must be positive layer"),
                         ("b:task=regression,popularity_periods=5",
                          "^arm 'b': popularity_periods 5: the ranker's task is regression")):
        with pytest.raises(ValueError, match=message):
            check_arms([parse_arm("a", "ranking"), parse_arm(arm, "ranking")], configs, [0])
    with pytest.raises(ValueError, match="^the retrieval config whose lists arm 'a' re-ranks: "
                                         "batch_size 100000 is larger than the training"):
        validation_split(load("synthetic:tiny"), resolve("tiny", retrieval={
            "batch_size": 100000}), [parse_arm("a", "ranking"), parse_arm("b", "ranking")])
    with pytest.raises(ValueError, match="^arms of one comparison change one stage's config"):
        check_arms([parse_arm("a", "ranking"), parse_arm("b")], configs, [0])
    log = dataclasses.replace(load("synthetic:tiny"), rating=None)
    with pytest.raises(ValueError, match="^arm 'b': task 'regression' needs ratings"):
        validation_split(log, configs, [parse_arm("a", "ranking"),
                                        parse_arm("b:task=regression", "ranking")])
    ranking_arms = [parse_arm("a", "ranking"), parse_arm("b:epochs=9", "ranking")]
    assert stopping_of(ranking_arms, resolve("default")) == (True, True)
    assert stopping_of(ranking_arms, resolve("tiny")) == (False, False)


def test_a_ranking_arm_reads_retrieval_fields_for_the_model_whose_lists_it_reranks():
    arm = parse_arm("b:retrieval.members=2,calibrate=false,retrieval.history_encoder=mean",
                    "ranking")
    assert arm == Arm("b", {"calibrate": False}, "ranking",
                      {"members": 2, "history_encoder": "mean"})
    assert arm.shown_fields == {"calibrate": False, "retrieval.members": 2,
                                "retrieval.history_encoder": "mean"}
    for text, stage, message in (
            ("b:retrieval.model=bst", "ranking", "'retrieval.model=bst' is not FIELD=VALUE of "
             "a retrieval config field (model is a ranking field: drop the 'retrieval.' "
             "prefix); known fields: retrieval.embedding_dim, retrieval.members, "),
            ("b:retrieval.seed=1", "ranking", "every arm trains with the seeds of --seeds; "
             "leave retrieval.seed out"),
            ("b:retrieval.members=1,retrieval.members=2", "ranking",
             "retrieval.members is given twice"),
            ("b:retrieval.members=x", "ranking", "members takes int, got 'x'"),
            ("b:retrieval.seed=1", "retrieval", "a retrieval config field (every arm trains "
             "with the seeds of --seeds; leave it out); known"),
            ("b:strategy=mirrored", "ranking", "a ranking config field (a comparison trains "
             "every arm in one process on one device, to compare configs, not devices; leave it "
             "out); known"),
            ("b:retrieval.model=bst", "retrieval", "'retrieval.model=bst' is not FIELD=VALUE of "
             "a retrieval config field (model is a ranking field: pass --stage ranking); known"),
            ("b:retrieval.members=2", "retrieval", "'retrieval.members=2' is not FIELD=VALUE of "
             "a retrieval config field (a retrieval arm names members alone; retrieval.members "
             "is for ranking arms, --stage ranking); known fields: embedding_dim, members, ")):
        with pytest.raises(ValueError, match="^--arm") as error:
            parse_arm(text, stage)
        assert message in str(error.value), str(error.value)
    configs = resolve("tiny")                                   # one member
    arms = [parse_arm(text, "ranking") for text in (
        "a", "b:retrieval.members=2", "c:retrieval.members=2,calibrate=false",
        "d:retrieval.members=1", "e:retrieval.temperature=0.1")]
    assert comparison.retrieval_rows(arms, configs) == {
        "a": "retrieval", "b": "retrieval:b", "c": "retrieval:b", "d": "retrieval",
        "e": "retrieval:e"}                                  # d's config is the first arm's
    assert comparison.arm_configs(arms[1], configs, 7).retrieval == dataclasses.replace(
        configs.retrieval, members=2, seed=7)
    with pytest.raises(ValueError, match="^arm 'b': temperature must be a positive number"):
        check_arms([arms[0], parse_arm("b:retrieval.temperature=-1", "ranking")], configs, [0])
    log = load("synthetic:tiny")
    with pytest.raises(ValueError) as refused:
        validation_split(log, configs, [
            arms[0], parse_arm("b:retrieval.batch_size=100000", "ranking")])
    rows = len(split(log, "temporal").train)
    assert str(refused.value) == (
        "the retrieval config whose lists arm 'b' re-ranks: batch_size 100000 is larger than "
        f"the training split ({rows} rows); give the arm retrieval.batch_size={rows} or less")
    default = resolve("default")
    for texts, expected in ((["a", "b:retrieval.epochs=3"], (True, True)),
                            (["a", "b:retrieval.members=1"], (True, False))):
        assert stopping_of([parse_arm(text, "ranking") for text in texts], default) == expected
    assert stopping_of(arms[:2], configs) == (False, False)     # tiny: no stage stops early


def test_ranking_arms_with_their_own_retrieval_rerank_its_lists_and_gain_over_it():
    """An arm that sets retrieval fields re-ranks the lists of a retrieval model trained with
    them (its own row, as a run of those configs serves it), and its gain over retrieval is
    over that row; arms compare their served two-stage lists."""
    from tworec.evaluation import MISS, eval_set, evaluate_ranks
    from tworec.features.inputs import prepare
    from tworec.ranking import features as ranking_features
    from tworec.ranking import train as ranking
    from tworec.retrieval import train as retrieval
    log = load("synthetic:tiny")
    configs = resolve("tiny", epochs=1, steps=("train retrieval", "train ranking"),
                      run={"top_n": 5, "candidates": 20})
    arms = [parse_arm("one", "ranking"), parse_arm("two:retrieval.members=2", "ranking"),
            parse_arm("raw:calibrate=false", "ranking")]       # the first arm's lists again
    result, ranks = compare(log, validation_split(log, configs, arms), configs, arms, [2],
                            verbose=0)
    assert sorted(ranks) == ["one/2", "raw/2", "retrieval/2", "retrieval:two/2", "rows",
                             "two/2", "users"]                      # two retrieval models
    assert len(result["retrieval"]["runs"]) == 1            # trained once, raw re-ranks it too
    assert len(result["other_retrieval"]["retrieval:two"]["runs"]) == 1

    parts = split(log, "temporal")
    inputs = prepare(log, parts, configs.data.history_length,
                     cold_start_window=result["cold_start_window"])
    evalset = eval_set(log, parts, "validation", exclude_seen=True)
    run, _ = configs.run.for_catalogue(int(inputs.catalogue.sum()))
    targets = inputs.examples["validation"]["item"]
    for name, row, members, calibrated in (("two", "retrieval:two", 2, True),
                                           ("raw", "retrieval", 1, False)):
        model, _ = retrieval.fit(inputs, dataclasses.replace(configs.retrieval, members=members,
                                                             seed=2), verbose=0)
        alone = evaluate_ranks(retrieval.catalogue_scorer(model, inputs, "validation", evalset),
                               evalset, "retrieval")
        assert np.array_equal(ranks[f"{row}/2"], np.where(alone >= 20, MISS, alone)), row
        served = retrieval.top_candidates(model, inputs, "validation", 20, evalset=evalset)
        hard = {part: retrieval.top_candidates(model, inputs, part, run.hard_negative_pool)
                for part in ("train", "validation")}
        config = dataclasses.replace(configs.ranking, seed=2, calibrate=calibrated)
        signals = ranking_features.signals(inputs, config,
                                           retrieval.embeddings_for_ranking(model, inputs))
        ranker, _ = ranking.fit(inputs, config, signals, hard=hard, verbose=0)
        scores = (comparison.cross_fitted_scores(ranker, inputs, signals, served,
                                                 evalset.users)[0] if calibrated else
                  ranking.score_lists(ranker, inputs, signals, "validation", served))
        positions, _ = ranking.reranked_ranks(scores, served, targets,
                                              in_order=~inputs.known_in("validation"))
        assert np.array_equal(ranks[f"{name}/2"], np.where(positions < 5, positions, MISS)), name
    assert not np.array_equal(ranks["retrieval:two/2"], ranks["retrieval/2"])

    two = result["arms"]["two"]
    assert two["fields"] == {"retrieval.members": 2} and two["retrieval"] == "retrieval:two"
    assert result["arms"]["one"]["retrieval"] == result["arms"]["raw"]["retrieval"] == "retrieval"
    assert result["arms"]["raw"]["gain_over_retrieval"]["ndcg@10"] == paired_bootstrap(
        row_metrics(ranks["raw/2"], 10)["ndcg@10"], row_metrics(ranks["retrieval/2"], 10)[
            "ndcg@10"], groups=ranks["users"])
    assert result["other_retrieval"]["retrieval:two"]["fields"] == {"retrieval.members": 2}
    assert result["other_retrieval"]["retrieval:two"]["ndcg@10"] == pytest.approx(
        row_metrics(ranks["retrieval:two/2"], 10)["ndcg@10"].mean())
    ndcg = {name: row_metrics(ranks[f"{name}/2"], 10)["ndcg@10"] for name in (
        "one", "two", "retrieval", "retrieval:two")}
    assert two["gain_over_retrieval"]["ndcg@10"] == paired_bootstrap(
        ndcg["two"], ndcg["retrieval:two"], groups=ranks["users"])
    assert two["gain"]["ndcg@10"] == paired_bootstrap(ndcg["two"], ndcg["one"],
                                                      groups=ranks["users"])
    lines = table(result).splitlines()
    assert lines[1].startswith("Each ranking arm re-ranks the lists of its retrieval model "
                               "per seed (retrieval alone's row for the first arm's retrieval "
                               "config, or the row named after the first arm of another; ")
    assert lines[-5].startswith("| retrieval alone | - | ")
    assert lines[-4].startswith("| retrieval alone (retrieval:two) | retrieval.members=2 | ")
    assert lines[-2].startswith("| two | retrieval.members=2 | ")
    assert lines[-2].endswith(" | {difference:+.4f} ({ci95[0]:+.4f} to {ci95[1]:+.4f}) |".format(
        **two["gain_over_retrieval"]["ndcg@10"]))


def script(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compare.py"), *args],
                          capture_output=True, text=True, timeout=timeout)


def test_the_script_prints_the_table_and_writes_it_with_the_ranks(tmp_path):
    out = tmp_path / "cmp"
    args = ["--data", "synthetic:tiny", "--preset", "tiny", "--epochs", "1", "--seeds", "0",
            "--out", str(out), "--arm", "one:members=1", "--arm", "two:members=2"]
    done = script(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0].startswith("[compare] one, seed 0: validation Recall@10")
    table_text = (out / "compare.md").read_text()
    assert done.stdout.endswith(table_text) and "| two | members=2 |" in table_text
    ran = shlex.join([os.path.join(ROOT, "scripts", "compare.py"), *args])   # as it was run
    assert table_text.splitlines()[1] == f"Command: `python {ran}`"
    saved = json.load(open(out / "compare.json"))
    assert saved["source"]["data"] == "synthetic:tiny" and saved["configs"]["retrieval"][
        "epochs"] == 1
    with np.load(out / "ranks.npz") as ranks:
        assert sorted(ranks) == ["one/0", "rows", "two/0", "users"]
        log = load("synthetic:tiny")
        assert np.array_equal(ranks["rows"], split(log, "temporal").validation)
        assert np.array_equal(ranks["users"], log.user[ranks["rows"]])
        assert saved["arms"]["two"]["ndcg@10"] == pytest.approx(
            row_metrics(ranks["two/0"], 10)["ndcg@10"].mean())
    again = script(*args)
    assert again.returncode == 2 and "already holds a comparison; pass --overwrite" in \
        again.stderr
    (out / "compare.md").write_text("older")
    assert script(*args, "--overwrite").returncode == 0
    assert (out / "compare.md").read_text() == table_text.replace(
        shlex.join(args), shlex.join([*args, "--overwrite"]))            # the same figures


def test_the_script_notes_a_log_whose_ties_are_in_id_order(tmp_path, monkeypatch, capsys):
    """The note goes to stderr, the table and compare.json, written after every seed (the
    comparison itself stubbed: what is checked is the script's wiring)."""
    import importlib.util
    from test_features import tied_pairs_log
    from tworec.features.sources import tie_order_notes
    spec = importlib.util.spec_from_file_location("compare_script",
                                                  os.path.join(ROOT, "scripts", "compare.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    notes = tie_order_notes(tied_pairs_log(tmp_path / "tied.csv", up=300))
    result = {"split": "temporal", "seeds": [0], "validation": {"rows": 1, "users": 1},
              "early_stopping": False, "epoch_choice_differs": False, "arms": {
                  "a": {"fields": {}, "runs": [{"gain": None, "seed": 0, "epochs": 1}],
                        "recall@10": 0.5, "ndcg@10": 0.25, "gain": None}}}
    tables = []

    def compared(*args, seed_done, **kwargs):
        seed_done({**result, "seeds_left": [1]}, {"rows": np.arange(1)})
        tables.append((tmp_path / "out" / "compare.md").read_text())
        return result, {"rows": np.arange(1)}

    monkeypatch.setattr(script, "compare", compared)
    monkeypatch.setattr(script.cli, "show_logs", lambda args: None)    # fd 2 left as it is
    assert script.main(["--data", str(tmp_path / "tied.csv"), "--out", str(tmp_path / "out"),
                        "--preset", "tiny", "--arm", "a", "--arm", "b:members=2", "--seeds", "0",
                        "1"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr()
    assert len(notes) == 1 and printed.err == f"note: {notes[0]}\n"
    assert f"Note: {notes[0]}" in printed.out                       # the table printed
    assert f"Note: {notes[0]}" in tables[0]                         # the partial table too
    assert f"Note: {notes[0]}" in (tmp_path / "out" / "compare.md").read_text()
    assert json.loads((tmp_path / "out" / "compare.json").read_text())["notes"] == notes


def test_a_failed_write_leaves_the_older_table_and_nothing_aside(tmp_path, monkeypatch):
    """The files are written aside, then renamed, the table last: a write that fails while
    writing leaves the folder as it was, one that fails while renaming leaves the older
    table; neither leaves a file aside."""
    write = functools.partial(comparison.write, str(tmp_path), {"seeds": [0]},
                              {"rows": np.arange(3)}, {"data": "synthetic"}, resolve("tiny"))
    (tmp_path / "compare.md").write_text("older")
    with monkeypatch.context() as patch:
        def broken(result):
            raise OSError("No space left on device")
        patch.setattr(comparison, "table", broken)
        with pytest.raises(OSError, match="No space left"):
            write()
    assert sorted(os.listdir(tmp_path)) == ["compare.md"]

    monkeypatch.setattr(comparison, "table", lambda result: "newer")
    renamed, rename = [], os.replace

    def second_rename_fails(source, target):
        if renamed:
            raise OSError("the disk went away")
        renamed.append(os.path.basename(target))
        rename(source, target)
    monkeypatch.setattr(os, "replace", second_rename_fails)
    with pytest.raises(OSError, match="the disk went away"):
        write()
    assert renamed == ["ranks.npz"] and sorted(os.listdir(tmp_path)) == ["compare.md",
                                                                         "ranks.npz"]
    assert (tmp_path / "compare.md").read_text() == "older"


def test_overwrite_removes_an_older_comparison_only_once_every_check_passed(tmp_path):
    out = tmp_path / "cmp"
    out.mkdir()
    for name in comparison.OUTPUTS:
        (out / name).write_text("older")
    done = exit_before_tensorflow([os.path.join(ROOT, "scripts", "compare.py"), "--out",
                                   str(out), "--overwrite", "--data", "synthetic:tiny", "--arm",
                                   "a", "--arm", "b:batch_size=100000"])     # refused last
    assert done.stdout.split() == ["2", "False"] and "larger than the training" in done.stderr
    assert all((out / name).read_text() == "older" for name in comparison.OUTPUTS)


def stopped_comparison(out, *args: str, stop: str) -> subprocess.CompletedProcess:
    """scripts/compare.py run into `out` with `args`, its `compare` stopped by `stop`, Python
    run with the arguments (args, seed_done, kwargs), where `real` is the real compare."""
    argv = [os.path.join(ROOT, "scripts", "compare.py"), "--data", "synthetic:tiny", "--preset",
            "tiny", "--epochs", "1", "--out", str(out), "--arm", "one", "--arm",
            "two:embedding_dim=8", *args]
    return subprocess.run([sys.executable, "-c", (
        "import runpy, sys\n"
        "from tworec.pipeline import compare as comparison\n"
        "real = comparison.compare\n"
        "def stopping(*args, seed_done, **kwargs):\n"
        f"    {stop}\n"
        "comparison.compare = stopping\n"
        f"sys.argv = {argv!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")],
        capture_output=True, text=True, timeout=300)


def test_a_comparison_that_stops_keeps_the_seeds_it_finished(tmp_path):
    """The files are written after every seed: an arm failing on a later seed leaves the
    earlier seeds' table, result and ranks, and the error says where they are; with
    --overwrite an older comparison's files go before training, so a stop before the first
    seed ends leaves none of them to be taken for its results."""
    out = tmp_path / "cmp"
    done = stopped_comparison(out, "--seeds", "0", "7", stop=(
        "def done(result, ranks):\n"
        "        seed_done(result, ranks)\n"
        "        raise ValueError(\"arm 'two', seed 7: RuntimeError: out of memory\")\n"
        "    return real(*args, seed_done=done, **kwargs)"))
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr == (f"error: arm 'two', seed 7: RuntimeError: out of memory; "
                           f"{out / 'compare.md'} holds seed 0\n")
    saved = json.load(open(out / "compare.json"))
    assert saved["seeds"] == [0] and saved["seeds_left"] == [7]
    assert "Partial: seed 7 not run yet" in (out / "compare.md").read_text()
    with np.load(out / "ranks.npz") as ranks:
        assert sorted(ranks) == ["one/0", "rows", "two/0", "users"]
        assert saved["arms"]["two"]["ndcg@10"] == pytest.approx(
            row_metrics(ranks["two/0"], 10)["ndcg@10"].mean())
    assert sorted(os.listdir(out)) == ["compare.json", "compare.md", "ranks.npz"]

    again = stopped_comparison(out, "--overwrite", stop="raise KeyboardInterrupt")
    assert again.returncode == 130, again.stderr[-3000:]
    assert again.stderr == "error: stopped; no seed finished, nothing was written\n"
    assert os.listdir(out) == []


@pytest.mark.parametrize("args, message", [
    (["--arm", "a"], "a comparison needs two arms or more"),
    (["--arm", "a", "--arm", "b:members=x"], "members takes int, got 'x'"),
    (["--arm", "a", "--arm", "b", "--split", "none"], "split 'none' holds no validation rows"),
    (["--arm", "a", "--arm", "b", "--data", "OUT/none.csv"], "no such file"),
    (["--arm", "a", "--arm", "b", "--split", "random"], "split 'random' holds no validation"),
    (["--arm", "a", "--arm", "b", "--columns", "garbage"], "'garbage' is not ROLE=COLUMN"),
    (["--arm", "a", "--arm", "b:batch_size=100000", "--data", "synthetic:tiny"],
     "arm 'b': batch_size 100000 is larger than the training split (3504 rows); give the arm "
     "batch_size=3504 or less"),
    (["--arm", "a", "--arm", "b", "--out", "OUT/a-file"], "is a file; give a folder"),
    (["--arm", "a", "--arm", "b", "--out", "OUT"], "--out OUT is a folder with other files in "
     "it (a-file); name a new or empty folder, or one holding a comparison"),
    (["--arm", "a", "--arm", "b", "--out", "OUT/a-file/below"], "--out OUT/a-file/below: "),
    (["--arm", "a", "--arm", "b", "--data", "OUT/none.csv", "--out", "OUT/new/deeper"],
     "no such file"),
    (["--arm", "a", "--arm", "b", "--epochs", "0"], "error: epochs must be positive"),
    (["--stage", "ranking", "--arm", "a", "--arm", "b:model=xgb"], "arm 'b': model 'xgb'"),
    (["--stage", "ranking", "--arm", "a", "--arm", "b:members=2"], "of a ranking config"),
    (["--stage", "ranking", "--arm", "a", "--arm", "b", "--top-k", "5"],
     "--top-n (top_n) 10 is more than the 5 candidates"),
    (["--arm", "a", "--arm", "b", "--top-k", "50"], "give them with --stage ranking"),
])
def test_script_mistakes_are_one_line_before_tensorflow_loads(tmp_path, args, message):
    (tmp_path / "a-file").write_text("not a folder")
    argv = [os.path.join(ROOT, "scripts", "compare.py"), "--out", str(tmp_path / "new"),
            *(arg.replace("OUT", str(tmp_path)) for arg in args)]
    done = exit_before_tensorflow(argv)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr[-2000:]
    assert done.stderr.startswith("error: ") and message.replace("OUT", str(tmp_path)) in \
        done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert not (tmp_path / "new").exists()                   # no folder left behind


def test_an_arm_that_trains_exactly_as_an_earlier_one_is_noted():
    configs = resolve("tiny")
    arms = [parse_arm(text) for text in (
        "a", f"same:learning_rate={configs.retrieval.learning_rate}", "two:members=2",
        "again:members=2")]
    assert identical_arms(arms, configs) == [
        "arm 'same' trains exactly as arm 'a': the configs they resolve to are equal",
        "arm 'again' trains exactly as arm 'two': the configs they resolve to are equal"]
    ranking = [parse_arm(text, "ranking") for text in ("a", "b:calibrate=false")]
    assert identical_arms(ranking, configs) == []


def test_the_table_gives_the_seeds_gains_and_warns_when_arms_choose_epochs_differently():
    gain = {"difference": 0.01, "ci95": [-0.002, 0.02]}
    runs = [{"gain": {"ndcg@10": 0.03}, "seed": 0, "epochs": 3},
            {"gain": {"ndcg@10": -0.01}, "seed": 1, "epochs": 3}]
    result = {"split": "temporal", "seeds": [0, 1], "validation": {"rows": 5, "users": 5},
              "early_stopping": True, "epoch_choice_differs": True, "arms": {
                  "base": {"fields": {}, "runs": [{"gain": None, "seed": seed, "epochs": 3}
                                                  for seed in (0, 1)],
                           "recall@10": 0.5, "ndcg@10": 0.25, "gain": None},
                  "long": {"fields": {"epochs": 9}, "runs": runs, "recall@10": 0.51,
                           "ndcg@10": 0.26, "gain": {"recall@10": gain, "ndcg@10": gain}}}}
    lines = table(result).splitlines()
    assert lines[0].endswith("A run that stops early (early_stopping_patience > 0) chose its "
                             "epoch on these rows, as a run chooses it.")
    assert lines[1] == ("Note: arms stop early after other epochs or patience, so they choose "
                        "their epoch among more or fewer looks at these rows; the arm that "
                        "looks more often is favoured.")
    # seeds' gains 0.03 and -0.01: t(1) 12.706 x 0.02828 / sqrt(2) = 0.2541 > 0.011
    assert lines[2] == ("Note: arm 'long': over its 2 seeds its mean NDCG@10 gain is uncertain "
                        "by ±0.2541 (a t interval of the seeds' own gains), more than by ±0.0110 "
                        "over the users drawn: its interval understates the gain's "
                        "uncertainty.")
    close = [{**runs[0], "gain": {"ndcg@10": value}, "seed": seed}     # 3 seeds: t(2) 4.303 x
             for seed, value in enumerate((0.009, 0.01, 0.011))]      # 0.001 / sqrt(3) = 0.0025
    steady = {**result, "arms": {**result["arms"], "long": {**result["arms"]["long"],
                                                             "runs": close}}}
    assert "understates" not in table(steady)
    assert "understates" in table({**steady, "arms": {**steady["arms"], "long": {
        **steady["arms"]["long"], "gain": {"recall@10": gain, "ndcg@10": {
            "difference": 0.01, "ci95": [0.008, 0.012]}}}}})             # +-0.002 < +-0.0025
    longer = [{**runs[0], "epochs": 5}, runs[1]]                 # the same settings, stopped
    stopped = {**steady, "epoch_choice_differs": False, "arms_stop_early": True,
               "arms": {**steady["arms"], "long": {**steady["arms"]["long"], "runs": longer}}}
    assert table(stopped).splitlines()[1] == (
        "Note: arms that stop early stopped after other numbers of epochs (seed 0: base 3, "
        "long 5), so they chose their epoch among more or fewer looks at these rows; the arm "
        "that looks more often is favoured.")
    assert "stopped after" not in table({**stopped, "arms_stop_early": False})  # rankers kept
                                                                 # their epochs: retrieval's stop
    assert table({**result, "command": "python scripts/compare.py --arm a"}).splitlines()[1] \
        == "Command: `python scripts/compare.py --arm a`"
    assert lines[-2] == "| base | - | 0.5000 | 0.2500 | - | - | - |"
    assert lines[-1] == ("| long | epochs=9 | 0.5100 | 0.2600 | +0.0100 (-0.0020 to +0.0200) | "
                         "+0.0100 (-0.0020 to +0.0200) | -0.0100 to +0.0300 |")
    assert table({**result, "early_stopping": False, "epoch_choice_differs": False}
                 ).splitlines()[0].endswith("Each run kept its last epoch (no early stopping).")
    assert "Note:" not in table({**steady, "epoch_choice_differs": False})
    assert table({**result, "notes": ["log.csv: ties"]}).splitlines()[1] == "Note: log.csv: ties"
    over = {"ndcg@10": {"difference": 0.03, "ci95": [0.01, 0.05]}}
    ranking = {**result, "stage": "ranking", "epoch_choice_differs": False,
               "retrieval": {"fields": {}, "recall@10": 0.4, "ndcg@10": 0.2}, "arms": {
                   "base": {**result["arms"]["base"], "gain_over_retrieval": over},
                   "long": {**result["arms"]["long"], "gain_over_retrieval": over, "runs": [
                       {**runs[0], "seed": 0, "calibration": [{"rows": 9}, {"rows": 0,
                                                                         "skipped": "none"}]},
                       {**runs[1], "seed": 1, "calibration": None}]}}}
    lines = table(ranking).splitlines()
    assert lines[1].startswith("Each ranking arm re-ranks the lists of the same retrieval")
    assert lines[2] == ("Note: a fold kept the trained weights, its calibration skipped "
                        "(compare.json says why): long, seed 0.")
    assert lines[3].startswith("Note: arm 'long': over its 2 seeds its mean NDCG@10 gain")
    assert lines[-3] == "| retrieval alone | - | 0.4000 | 0.2000 | - | - | - | - |"
    assert lines[-2].endswith("| - | +0.0300 (+0.0100 to +0.0500) |")


@pytest.mark.parametrize("preset, arms, expected", [
    ("tiny", ["a", "b:epochs=9"], (False, False)),                # no arm stops early
    ("default", ["a", "b:members=1"], (True, False)),
    ("default", ["a", "b:epochs=3"], (True, True)),
    ("default", ["a", "b:early_stopping_patience=0"], (True, True)),
    ("default", ["a", "b:epochs=8"], (True, False)),                # the epochs it had
])
def test_arms_that_stop_early_differently_are_told_apart_by_their_resolved_configs(
        preset, arms, expected):
    assert stopping_of([parse_arm(text) for text in arms], resolve(preset)) == expected


def test_a_ranking_arm_ranks_the_popular_list_of_unknown_users_as_retrieval_does():
    """Under `global` most validation users are unknown: both stages serve them the popular
    list, a strict order whose scores (shares) tie; a ranking arm ranks it as retrieval's row
    does, within the lists it serves."""
    from tworec.evaluation import MISS
    from tworec.features.inputs import prepare
    log = load("synthetic:tiny")
    configs = resolve("tiny", epochs=1, data={"split": "global"},
                      steps=("train retrieval", "train ranking"),
                      run={"top_n": 5, "candidates": 20})
    arms = [parse_arm("one", "ranking")]
    parts = validation_split(log, configs, arms)
    result, ranks = compare(log, parts, configs, arms, [2], verbose=0)
    unknown = ~prepare(log, parts, configs.data.history_length,
                       cold_start_window=result["cold_start_window"]).known_in("validation")
    retrieval, two_stage = ranks["retrieval/2"][unknown], ranks["one/2"][unknown]
    assert unknown.sum() > 100 and (two_stage < 5).sum() > 10
    assert np.array_equal(two_stage, np.where(retrieval < 5, retrieval, MISS))
