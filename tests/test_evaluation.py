"""Full-catalogue metrics and baselines against hand-computed answers."""
import numpy as np
import pytest
import scipy.sparse as sp

from tworec.features import Interactions, split
from tworec.evaluation import baselines, eval_set, evaluate, rank_metrics, target_ranks
from tworec.features.history import transition_counts


def test_rank_metrics_by_hand():
    metrics = rank_metrics(np.array([0, 3, 10, 50]), ks=(10,))
    assert metrics["recall@10"] == pytest.approx(0.5)
    assert metrics["ndcg@10"] == pytest.approx((1.0 + 1.0 / np.log2(5)) / 4)


def test_target_ranks_exclude_seen_but_not_the_target():
    scores = np.array([[0.9, 0.8, 0.7, 0.1], [0.1, 0.2, 0.3, 0.4]])
    seen = sp.csr_matrix(np.array([[1, 0, 0, 0], [0, 0, 0, 1]], dtype=np.float32))
    assert target_ranks(scores, np.array([2, 3]), seen).tolist() == [1, 0]


@pytest.fixture
def log():
    # a: x y z w; b: x y z; c: y z (two interactions: all train)
    users = np.array([0, 0, 0, 0, 1, 1, 1, 2, 2])
    items = np.array([0, 1, 2, 3, 0, 1, 2, 1, 2])
    return Interactions(user_ids=np.array(["a", "b", "c"]), item_ids=np.array(["x", "y", "z", "w"]),
                        user=users, item=items, timestamp=np.arange(9))


def test_eval_set_history(log):
    parts = split(log, "temporal")
    test = eval_set(log, parts, "test")
    assert log.item_ids[test.targets].tolist() == ["w", "z"]
    assert log.item_ids[test.last_item].tolist() == ["z", "y"]             # validation row
    assert test.seen.toarray().tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    validation = eval_set(log, parts, "validation")
    assert validation.seen.toarray().tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]


def test_transitions_and_popularity_by_hand(log):
    parts = split(log, "temporal")
    counts = transition_counts(log, parts.train).toarray()
    assert counts[0, 1] == 1 and counts[1, 2] == 1 and counts.sum() == 2   # a: x>y, c: y>z
    test = eval_set(log, parts, "test")
    results = baselines(log, parts, test, ks=(1,))
    # popularity on train rows (a: x y; b: x; c: y z): x=2, y=2, z=1, w=0.
    # a has seen x y z -> only w left: rank 0. b target z, unseen z, w: z(1) > w(0): rank 0.
    assert results["popularity"]["recall@1"] == 1.0
    # transitions: a's last item z never led anywhere -> popularity breaks the tie; b: y>z
    assert results["item_transition"]["recall@1"] == 1.0
    assert results["ease"] is not None


def test_evaluate_batches_agree(log):
    parts = split(log, "temporal")
    test = eval_set(log, parts, "test")
    rng = np.random.default_rng(0)
    table = rng.normal(size=(len(test), log.num_items))
    one = evaluate(lambda p: table[p], test, ks=(1, 2), batch_size=1)
    all_ = evaluate(lambda p: table[p], test, ks=(1, 2), batch_size=100)
    assert one == all_
