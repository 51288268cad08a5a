"""The run report: the paired bootstrap behind the two-stage gain, the report's text from a
hand-made report dict, and the report the tiny pipeline writes (example users, the gain over
retrieval, the protocol and the numbers' precision)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

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
    lo, hi = result["ci95"]
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0
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
