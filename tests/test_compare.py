"""Retrieval configs compared on validation (`pipeline.compare`, `scripts/compare.py`)."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tworec.evaluation.metrics import paired_bootstrap, row_metrics
from tworec.features import load, split
from tworec.pipeline.compare import Arm, check_arms, compare, parse_arm, table
from tworec.pipeline.config import resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_an_arm_reads_each_value_as_its_field_type():
    arm = parse_arm("mine: members=2,temperature=0.1,l2_normalize=false,"
                    "num_hard_negatives=none,history_encoder=mean")
    assert arm == Arm("mine", {"members": 2, "temperature": 0.1, "l2_normalize": False,
                               "num_hard_negatives": None, "history_encoder": "mean"})
    assert type(arm.retrieval["temperature"]) is float and parse_arm("base") == Arm("base", {})
    assert parse_arm("hard:num_hard_negatives=4").retrieval == {"num_hard_negatives": 4}


@pytest.mark.parametrize("text, message", [
    (":members=2", "has no name"),
    ("a:members", "is not FIELD=VALUE"),
    ("a:width=2", "'width=2' is not FIELD=VALUE of a retrieval config field; known fields: "
                  "embedding_dim, members"),
    ("a:seed=1", "every arm trains with the seeds of --seeds"),
    ("a:members=two", "members takes int, got 'two'"),
    ("a:members=none", "members takes int, got 'none'"),
    ("a:l2_normalize=yes", "l2_normalize takes bool, got 'yes'"),
    ("a:temperature=warm", "temperature takes float, got 'warm'"),
])
def test_an_arm_that_cannot_be_read_is_named_with_what_would_work(text, message):
    with pytest.raises(ValueError, match="^--arm") as error:
        parse_arm(text)
    assert message in str(error.value)


@pytest.mark.parametrize("arms, seeds, data, message", [
    (["a"], [0], {}, "a comparison needs two arms or more"),
    (["a", "a:members=2"], [0], {}, "arm names must differ"),
    (["a", "b"], [], {}, "--seeds must be one seed or more"),
    (["a", "b"], [1, 1], {}, "each once; got [1, 1]"),
    (["a", "b:members=0"], [0], {}, "arm 'b': members must be positive"),
    (["a", "b:history_encoder=lstm"], [0], {}, "arm 'b': history_encoder 'lstm'"),
    (["a", "b"], [0], {"split": "none"}, "split 'none' holds no validation rows"),
    (["a", "b"], [0], {"split": "weekly"}, "split 'weekly'"),
])
def test_arms_that_cannot_be_compared_are_refused_before_the_log_loads(arms, seeds, data,
                                                                      message):
    with pytest.raises(ValueError) as error:
        check_arms([parse_arm(text) for text in arms], resolve("tiny", data=data), seeds)
    assert message in str(error.value)


def test_each_arm_scores_the_validation_rows_as_its_model_and_gains_are_paired_by_user():
    """Two identical arms give the same ranks and a gain of exactly zero; every figure is what
    the saved ranks give: each arm's mean over seeds, and the gain's bootstrap over users of the
    rows' seed means. Only validation rows are ranked. (The global protocol holds out several
    rows of a user: the bootstrap must resample users, not rows.)"""
    log = load("synthetic:tiny")
    configs = resolve("tiny", epochs=1, steps=("train retrieval",), data={"split": "global"})
    arms = [parse_arm("base"), parse_arm("same"), parse_arm("mean:history_encoder=mean")]
    seeds = [0, 3]
    result, ranks = compare(log, configs, arms, seeds, verbose=0)

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
        assert arm["gain"][metric] == paired_bootstrap(
            seed_means("mean", metric), seed_means("base", metric), groups=ranks["users"])
    assert arm["gain"]["ndcg@10"]["units"] == result["validation"]["users"] < len(validation)
    assert [run["seed"] for run in arm["runs"]] == seeds and arm["retrieval"] == {
        "history_encoder": "mean"}
    lines = table(result).splitlines()
    assert lines[-1].startswith("| mean | history_encoder=mean | ") and len(lines) == 7


def test_each_run_is_the_model_retrieval_fit_trains_scored_as_the_export_serves():
    """An arm's run equals `retrieval.fit` with the arm's config and seed, evaluated by
    `evaluate_model` on validation (the early-stopping callback's own figure)."""
    from tworec.features.inputs import prepare
    from tworec.retrieval import train as retrieval
    log = load("synthetic:tiny")
    configs = resolve("tiny", epochs=2, steps=("train retrieval",),
                      data={"cold_start_window": 1.0})
    result, _ = compare(log, configs, [parse_arm("a"), parse_arm("b:embedding_dim=8")], [5],
                        verbose=0)
    inputs = prepare(log, split(log, "temporal"), configs.data.history_length,
                     cold_start_window=1.0)
    for name, fields in (("a", {}), ("b", {"embedding_dim": 8})):
        model, _ = retrieval.fit(inputs, dataclasses.replace(configs.retrieval, seed=5,
                                                             **fields), verbose=0)
        expected = retrieval.evaluate_model(model, inputs, "validation", ks=(10,))
        run, = result["arms"][name]["runs"]
        assert {key: run[key] for key in expected} == expected


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
    saved = json.load(open(out / "compare.json"))
    assert saved["source"]["data"] == "synthetic:tiny" and saved["configs"]["retrieval"][
        "epochs"] == 1
    with np.load(out / "ranks.npz") as ranks:
        assert sorted(ranks) == ["one/0", "two/0", "users"]
        assert saved["arms"]["two"]["ndcg@10"] == pytest.approx(
            row_metrics(ranks["two/0"], 10)["ndcg@10"].mean())
    again = script(*args)
    assert again.returncode == 2 and "already holds a comparison; pass --overwrite" in \
        again.stderr


@pytest.mark.parametrize("args, message", [
    (["--arm", "a"], "a comparison needs two arms or more"),
    (["--arm", "a", "--arm", "b:members=x"], "members takes int, got 'x'"),
    (["--arm", "a", "--arm", "b", "--split", "none"], "split 'none' holds no validation rows"),
    (["--arm", "a", "--arm", "b", "--data", "OUT/none.csv"], "no such file"),
])
def test_script_mistakes_are_one_line_before_tensorflow_loads(tmp_path, args, message):
    argv = [os.path.join(ROOT, "scripts", "compare.py"), "--out", str(tmp_path / "new"),
            *(arg.replace("OUT", str(tmp_path)) for arg in args)]
    done = subprocess.run([sys.executable, "-c", (
        "import runpy, sys\n"
        f"sys.argv = {argv!r}\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as exit:\n    code = exit.code\n"
        "print(code, 'tensorflow' in sys.modules)")], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr[-2000:]
    assert done.stderr.startswith("error: ") and message in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
