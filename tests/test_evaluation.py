"""Full-catalogue metrics and baselines against hand-computed answers."""
import numpy as np
import pytest
import scipy.sparse as sp

from tworec.features import Interactions, split
from tworec.evaluation import (MISS, baselines, eval_set, evaluate, rank_metrics,
                               target_ranks, top_k_rows)
from tworec.evaluation.baselines import ease_scorer
from tworec.features.history import transition_counts


def test_rank_metrics_by_hand():
    metrics = rank_metrics(np.array([0, 3, 10, 50]), ks=(10,))
    assert metrics["recall@10"] == pytest.approx(0.5)
    assert metrics["ndcg@10"] == pytest.approx((1.0 + 1.0 / np.log2(5)) / 4)


def test_target_ranks_exclude_seen_items_and_a_seen_target_is_a_miss():
    scores = np.array([[0.9, 0.8, 0.7, 0.1], [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]])
    seen = sp.csr_matrix(np.array([[1, 0, 0, 0], [0, 0, 0, 1], [0, 1, 0, 0]], dtype=np.float32))
    ranks = target_ranks(scores, np.array([2, 2, 1]), seen)
    assert ranks[:2].tolist() == [1, 0]
    # a seen target misses even at a K beyond the catalogue (4 items): it is never served
    assert rank_metrics(ranks, ks=(10,)) == {"recall@10": pytest.approx(2 / 3),
                                             "ndcg@10": pytest.approx((1 / np.log2(3) + 1) / 3)}
    assert target_ranks(scores[:0], np.zeros(0, np.int64), seen[:0]).tolist() == []  # no rows


def test_ties_count_against_the_target():
    """A constant scorer ranks every target last, not first; a target tied with 5 others at
    K=3 is a miss."""
    none = sp.csr_matrix((2, 8), dtype=np.float32)
    assert target_ranks(np.zeros((2, 8)), np.array([0, 7]), none).tolist() == [7, 7]
    assert rank_metrics(target_ranks(np.ones((2, 8)), np.array([0, 3]), none), ks=(3,)) == \
        {"recall@3": 0.0, "ndcg@3": 0.0}
    tied = np.array([[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.1, 0.2]])            # target 2, tied with 5
    ranks = target_ranks(tied, np.array([2]), sp.csr_matrix((1, 8), dtype=np.float32))
    assert ranks.tolist() == [5] and rank_metrics(ranks, ks=(3,))["recall@3"] == 0.0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_score_is_an_error_naming_the_model(bad):
    scores = np.zeros((3, 4))
    scores[1, 2] = bad
    with pytest.raises(ValueError, match=r"retrieval: 1 of 3 scored rows hold NaN or infinite"):
        target_ranks(scores, np.array([0, 0, 0]), sp.csr_matrix((3, 4)), name="retrieval")


def test_top_k_rows_is_tf_top_k():
    import tensorflow as tf
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 4, (50, 30)).astype(np.float32)                 # many ties
    expected = tf.math.top_k(scores, k=7).indices.numpy()
    assert np.array_equal(top_k_rows(scores, 7), expected)


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
    assert test.history.toarray().tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert test.known.tolist() == [True, True]
    validation = eval_set(log, parts, "validation")
    assert validation.history.toarray().tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    assert eval_set(log, parts, "test", exclude_seen=False).excluded.nnz == 0


def test_the_catalogue_is_the_items_of_the_rows_known_before_a_part(log):
    """a: x y | z | w; b: x | y | z; c: y z (train | validation | test): w appears in a test
    row alone, so no export of the fit rows serves it and a's test row is a miss at every K;
    under `none` every item is served. d's validation row adds v, which training lacks: the
    test part serves it (the models score it by the out-of-vocabulary id), validation not."""
    from tworec.features.inputs import prepare
    inputs = prepare(log, split(log, "temporal"), 2)
    assert inputs.catalogue.tolist() == [True, True, True, False]
    assert inputs.untrained_items == 0 and prepare(log, split(log, "none"), 2).catalogue.all()
    parts = split(log, "temporal")
    test = eval_set(log, parts, "test")
    assert test.catalogue.tolist() == [True, True, True, False]
    scores = np.tile([0.1, 0.2, 0.3, 0.9], (2, 1))                 # w would rank first
    assert target_ranks(scores, test.targets, test.excluded, catalogue=test.catalogue
                        ).tolist() == [MISS, 0]
    assert evaluate(lambda positions: scores[positions], test, ks=(1,))["recall@1"] == 0.5
    added = Interactions(user_ids=np.array(["a", "b", "c", "d"]),
                         item_ids=np.array(["x", "y", "z", "w", "v"]),
                         user=np.append(log.user, [3, 3, 3]), item=np.append(log.item, [0, 4, 1]),
                         timestamp=np.arange(12))
    parts = split(added, "temporal")
    assert prepare(added, parts, 2).untrained_items == 1
    assert eval_set(added, parts, "test").catalogue.tolist() == [True] * 3 + [False, True]
    assert eval_set(added, parts, "validation").catalogue.tolist() == [True] * 3 + [False] * 2


def test_repeated_targets_are_rows_whose_item_their_user_already_had(log):
    """a: x y z w, then x again; b: x y z, then w twice. The test rows (a's x, b's second w)
    repeat an item known before them: a's from training, b's from validation, which the test
    part knows too. The validation rows (a's w, b's first w) repeat nothing of training."""
    from tworec.evaluation.sets import repeated_targets
    again = Interactions(user_ids=log.user_ids, item_ids=log.item_ids,
                         user=np.append(log.user, [0, 1, 1]), item=np.append(log.item, [0, 3, 3]),
                         timestamp=np.arange(12))
    parts = split(again, "temporal")
    assert parts.test.tolist() == [9, 11] and parts.validation.tolist() == [3, 10]
    assert repeated_targets(again, parts, "test").tolist() == [True, True]
    assert repeated_targets(again, parts, "validation").tolist() == [False, False]
    parts = split(log, "temporal")      # a's w, b's z: z is known, to a and c, not to b
    assert repeated_targets(log, parts, "test").tolist() == [False, False]
    assert repeated_targets(log, parts, "validation").tolist() == [False, False]
    assert repeated_targets(log, split(log, "none"), "test").tolist() == []


def test_transitions_and_popularity_by_hand(log):
    parts = split(log, "temporal")
    counts = transition_counts(log, parts.train).toarray()
    assert counts[0, 1] == 1 and counts[1, 2] == 1 and counts.sum() == 2   # a: x>y, c: y>z
    test = eval_set(log, parts, "test")
    results = baselines(log, parts, test, ks=(1,))
    # popularity on train rows (a: x y; b: x; c: y z): x=2, y=2, z=1, w=0. a's w is in no
    # fit row, outside the catalogue: a miss. b target z, unseen z only (w is not served).
    assert results["popularity"]["recall@1"] == 0.5
    # transitions: b's last item y led to z
    assert results["item_transition"]["recall@1"] == 0.5
    assert results["ease"] is not None


def test_baselines_of_counts_rank_ties_as_served_not_against_the_target(log):
    """a: x y | z | w; b: x | w | z; c: y | z | x (train | validation | test). Training counts
    x 2, y 2, z 0, w 0: popularity lists x y w z (ties by item id, not by code: x y z w),
    which ranks a's w third and c's x first; counting ties against them gave 4th and 2nd.
    Item transitions (no training transition leaves z or w) fall back on that order."""
    from tworec.evaluation import baseline_ranks
    ordered = Interactions(user_ids=log.user_ids, item_ids=log.item_ids,
                           user=np.array([0, 0, 0, 0, 1, 1, 1, 2, 2, 2]),
                           item=np.array([0, 1, 2, 3, 0, 3, 2, 1, 2, 0]), timestamp=np.arange(10))
    parts = split(ordered, "temporal")
    assert parts.test.tolist() == [3, 6, 9]
    everything = baseline_ranks(ordered, parts,
                                eval_set(ordered, parts, "test", exclude_seen=False))
    assert everything["popularity"].tolist() == [2, 3, 0]
    assert everything["item_transition"].tolist() == [2, 3, 0]
    unseen = baseline_ranks(ordered, parts, eval_set(ordered, parts, "test"))
    assert unseen["popularity"].tolist() == unseen["item_transition"].tolist() == [0, 1, 0]


def test_popular_now_ranks_by_the_list_users_never_seen_get(log):
    """Fit rows (a: x y z; b: x y; c: y z); the latest two are c's y and z, which lead (y
    first: 3 rows in all against 2), then x by its count in all; w, in no fit row, is never
    served. b's held-out z is second without exclusions, first once b's x and y are
    excluded; a's w is a miss."""
    from tworec.evaluation import baseline_ranks
    from tworec.features.inputs import popular_items
    parts = split(log, "temporal")
    popular = popular_items(log, parts.fit, 2 / 7)
    assert log.item_ids[popular.order].tolist() == ["y", "z", "x", "w"] and popular.size == 3
    everything = eval_set(log, parts, "test", exclude_seen=False)
    assert baseline_ranks(log, parts, everything, popular)["popular_now"].tolist() == [MISS, 1]
    unseen = eval_set(log, parts, "test")
    assert baseline_ranks(log, parts, unseen, popular)["popular_now"].tolist() == [MISS, 0]
    assert "popular_now" not in baseline_ranks(log, parts, unseen)


def test_evaluate_batches_agree(log):
    parts = split(log, "temporal")
    test = eval_set(log, parts, "test")
    rng = np.random.default_rng(0)
    table = rng.normal(size=(len(test), log.num_items))
    one = evaluate(lambda p: table[p], test, ks=(1, 2), batch_size=1)
    all_ = evaluate(lambda p: table[p], test, ks=(1, 2), batch_size=100)
    assert one == all_


def test_ease_matches_its_closed_form():
    """B = I - P / diag(P), P = (X'X + lambda I)^-1 over items seen in training, diagonal zero;
    a user's scores are their known items times B."""
    rng = np.random.default_rng(1)
    users, items = rng.integers(0, 12, 80), rng.integers(0, 9, 80)
    log = Interactions(user_ids=np.array([f"u{i}" for i in range(12)]),
                       item_ids=np.array([f"i{i}" for i in range(10)]),          # i9 never used
                       user=users, item=items, timestamp=np.arange(80))
    parts = split(log, "random")
    test = eval_set(log, parts, "test")
    x = np.zeros((12, 10))
    x[users[parts.train], items[parts.train]] = 1
    used = np.flatnonzero(x.sum(0))
    p = np.linalg.inv(x[:, used].T @ x[:, used] + 5.0 * np.eye(len(used)))
    b = np.eye(len(used)) - p / np.diag(p)
    np.fill_diagonal(b, 0.0)
    scores = ease_scorer(log, parts.train, test, regularisation=5.0)(np.arange(len(test)))
    known = np.zeros((12, 10))
    known[users[parts.fit], items[parts.fit]] = 1
    np.testing.assert_allclose(scores[:, used], known[test.users][:, used] @ b, atol=1e-5)
    assert (scores[:, 9] < -1e8).all()


def test_ease_scores_users_without_history_by_popularity():
    """A held-out row whose user has no known rows (the exports serve them the popular
    items) is ranked by EASE as by the popularity baseline, not by a tie over every item."""
    from tworec.evaluation.baselines import baseline_ranks
    from tworec.features.synthetic import PRESETS, generate
    log = generate(PRESETS["tiny"], seed=0)
    parts = split(log, "global:0.8")
    test = eval_set(log, parts, "test")
    new = test.history.getnnz(axis=1) == 0
    assert new.sum() > 10 and (~new).sum() > 10
    ranks = baseline_ranks(log, parts, test)
    np.testing.assert_array_equal(ranks["ease"][new], ranks["popularity"][new])
    assert not np.array_equal(ranks["ease"][~new], ranks["popularity"][~new])


def test_random_protocol_baselines_use_the_training_rows_as_history():
    """Several held-out rows per user, each scored from the user's training rows: EASE and
    transitions see them (an empty history gave every EASE score 0 and Recall@10 = 1.0)."""
    from tworec.features.synthetic import PRESETS, generate
    log = generate(PRESETS["tiny"], seed=0)
    parts = split(log, "random")
    test = eval_set(log, parts, "test")
    assert np.bincount(test.users).max() > 1 and test.history.nnz > 0
    assert (test.last_item >= 0).mean() > 0.9
    results = baselines(log, parts, test, ks=(10,))
    for name, metrics in results.items():
        assert 0 < metrics["recall@10"] < 0.9, (name, metrics)


def test_the_global_protocol_keeps_post_cut_rows_out_of_every_fitted_statistic():
    """Rewrite every held-out row: nothing fitted changes (vocabularies, popularity and logQ,
    histories, the exports' state, transition counts, baselines on validation)."""
    import dataclasses
    from tworec.features.inputs import prepare
    from tworec.features.synthetic import PRESETS, generate
    from tworec.ranking.features import transition_matrix
    log = generate(PRESETS["tiny"], seed=0)
    parts = split(log, "global:0.8")
    assert log.timestamp[parts.test].min() > log.timestamp[parts.fit].max()
    assert log.timestamp[parts.validation].min() > log.timestamp[parts.train].max()
    item = log.item.copy()
    item[parts.test] = (item[parts.test] + 7) % log.num_items
    changed = dataclasses.replace(log, item=item)
    before, after = prepare(log, parts, 5), prepare(changed, parts, 5)
    assert np.array_equal(before.items.ids, after.items.ids)
    assert np.array_equal(before.users.ids, after.users.ids)
    assert np.array_equal(before.item_probability, after.item_probability)
    assert np.array_equal(before.latest, after.latest) and (before.seen != after.seen).nnz == 0
    for part in ("train", "validation", "test"):
        assert np.array_equal(before.examples[part]["history"], after.examples[part]["history"])
    assert (transition_matrix(before) != transition_matrix(after)).nnz == 0
    validation = eval_set(log, parts, "validation")
    assert baselines(log, parts, validation) == baselines(changed, parts, validation)
    test, test_changed = eval_set(log, parts, "test"), eval_set(changed, parts, "test")
    assert (test.history != test_changed.history).nnz == 0
    assert np.array_equal(test.last_item, test_changed.last_item)
    assert not np.array_equal(test.targets, test_changed.targets)


def test_split_none_trains_on_every_row():
    from tworec.features.synthetic import PRESETS, generate
    log = generate(PRESETS["tiny"], seed=0)
    parts = split(log, "none")
    assert len(parts.train) == len(log) and not len(parts.validation) and not len(parts.test)
    for bad in ("global:1.5", "global:x", "weekly"):
        with pytest.raises(Exception, match="split"):
            split(log, bad)


def cold_start_log(cold_items: np.ndarray, known: int = 30):
    """Training: item 0 in the first 60 rows, item 1 in the last 40 (all of user u0). Then one
    validation row per user never seen, taking `cold_items`, and `known` rows of u0 (item 0)."""
    from tworec.features.splits import Split
    cold = len(cold_items)
    users = np.concatenate([np.zeros(100), 1 + np.arange(cold), np.zeros(known)]).astype(np.int64)
    items = np.concatenate([np.zeros(60), np.ones(40), cold_items, np.zeros(known)])
    log = Interactions(user_ids=np.array([f"u{n}" for n in range(cold + 1)]),
                       item_ids=np.array(["x", "y", "z"]), user=users,
                       item=items.astype(np.int64), timestamp=np.arange(len(users)))
    rows = np.arange(len(users))
    return log, Split("global", rows[:100], rows[100:], np.zeros(0, np.int64))


def test_the_cold_start_window_is_chosen_on_the_validation_rows_of_users_never_seen():
    """Item 1 comes first in every window up to the latest half of the training rows, second
    when all rows count. 100 cold rows taking item 1 gain 1 - 1 / log2(3) each in every shorter
    window (a tie: the larger window wins); the known user's rows do not count. With one cold
    row fewer, or the 100 rows from 19 users, nothing is chosen; with 51 rows taking item 1
    and 49 item 0 the gain is not above zero: all rows. Rows taking z, outside the catalogue of
    the training rows, are misses in every window."""
    from tworec.evaluation import cold_start_window
    from tworec.features.inputs import COLD_START_WINDOWS
    log, parts = cold_start_log(np.ones(100))
    choice = cold_start_window(log, parts)
    table, gain = choice["validation"], 1 - 1 / np.log2(3)
    assert (choice["window"], choice["rows"], choice["users"]) == (0.5, 100, 100)
    assert set(table) == set(COLD_START_WINDOWS)
    assert table[1.0] == {"ndcg@10": pytest.approx(1 / np.log2(3)), "ci95": None}
    for shorter in COLD_START_WINDOWS[1:]:
        assert table[shorter]["ndcg@10"] == pytest.approx(1.0)
        assert table[shorter]["ci95"] == pytest.approx([gain, gain])
    log, parts = cold_start_log(np.ones(99))
    assert cold_start_window(log, parts) == {"window": 1.0, "rows": 99, "users": 99,
                                             "validation": {}}
    log, parts = cold_start_log(np.ones(100))
    log.user[100:200] = 1 + np.arange(100) % 19
    assert cold_start_window(log, parts) == {"window": 1.0, "rows": 100, "users": 19,
                                             "validation": {}}
    log, parts = cold_start_log(np.repeat([1, 0], [51, 49]))
    choice = cold_start_window(log, parts)
    table = choice["validation"]
    assert table[0.5]["ndcg@10"] > table[1.0]["ndcg@10"] and table[0.5]["ci95"][0] < 0
    assert choice["window"] == 1.0
    log, parts = cold_start_log(np.full(100, 2))       # z, of no training row: never served
    assert {row["ndcg@10"] for row in cold_start_window(log, parts)["validation"].values()} == {0}
