"""The ranking stage: candidate lists, both models, the tasks, two-stage metrics, export."""
import dataclasses
import re

import numpy as np
import pytest
import tensorflow as tf

from tworec.features import generate, split
from tworec.features.inputs import EMPTY_SLOT, prepare
from tworec.features.vocab import FIRST, OOV, PAD
from tworec.features.synthetic import PRESETS
from tworec.ranking.config import preset
from tworec.ranking.features import (list_examples, retrieval_scores, signals,
                                     transition_features, transition_matrix)
from tworec.ranking.sequence import SequenceTransformer
from tworec.ranking.train import (calibrate, candidate_lists, evaluate, fit, pair_auc, rerank,
                                  reranked_ranks, score_lists, two_stage_metrics)
from test_retrieval import (assert_holds_the_weights_alone, graph_op_types, load_like_tf_serving,
                            train as train_retrieval)


@pytest.fixture(scope="module")
def inputs():
    log = generate(PRESETS["tiny"], seed=0)
    return prepare(log, split(log, "temporal"), history_length=5)


@pytest.fixture(scope="module")
def titled(inputs):
    """`inputs` whose items have titles: series of four ("saga3 ..."), words of three items
    in a row ("word7") and of every ninth item ("tone4"), words more than 20 titles have
    ("the", the part number), a tenth without."""
    titles = np.array([f"The Saga{i // 4} {i % 4 + 1}: Word{i // 3} Tone{i % 9} ({1990 + i % 20})"
                       if i % 10 else "" for i in range(inputs.num_items)])
    log = dataclasses.replace(inputs.interactions,
                              item_features={**inputs.interactions.item_features, "title": titles})
    return dataclasses.replace(inputs, interactions=log)


@pytest.fixture(scope="module")
def transitions_only(inputs):
    """The signals of a ranker without retrieval: the transition counts."""
    return signals(inputs, preset("tiny"))


def test_candidate_lists_put_the_positive_first_and_never_repeat_it(inputs):
    rng = np.random.default_rng(0)
    positives = inputs.examples["train"]["item"]
    hard = rng.integers(0, inputs.num_items, (len(positives), 20))
    retrieved = np.arange(len(positives)) % 2 == 0
    hard[retrieved, 5] = positives[retrieved]          # retrieval found the positive: even rows
    retrieved = (hard == positives[:, None]).any(1)     # odd rows too, by chance
    lists = candidate_lists(inputs, "train", 6, 0.5, hard, seed=1)
    assert lists.shape == (len(positives), 7) and np.array_equal(lists[:, 0], positives)
    assert not (lists[:, 1:] == positives[:, None]).any()
    from_hard = np.array([set(row[1:4]) <= set(h) for row, h in zip(lists, hard)])
    assert from_hard[retrieved].all()                  # 3 hard negatives where it was found
    assert from_hard[~retrieved].mean() < 0.05         # random ones where it was not


@pytest.mark.parametrize("pool", [4, 5, 9])
@pytest.mark.parametrize("part", ["train", "validation"])     # a held-out positive is no own item
def test_hard_negatives_are_never_the_positive_even_when_the_pool_is_no_wider(inputs, part, pool):
    """A pool of H retrieval candidates holding the positive, with 5 hard negatives asked for:
    the positive is never one of them; what the pool lacks is drawn at random."""
    positives = inputs.examples[part]["item"]
    hard = np.random.default_rng(0).integers(0, inputs.num_items, (len(positives), pool))
    hard[:, 2] = positives                                  # retrieval found every positive
    lists = candidate_lists(inputs, part, 5, 1.0, hard, seed=0)
    assert lists.shape == (len(positives), 6)
    assert not (lists[:, 1:] == positives[:, None]).any()
    hard[:, 3:] = EMPTY_SLOT              # fewer candidates than the pool: never a negative
    lists = candidate_lists(inputs, part, 5, 1.0, hard, seed=0)
    assert (lists >= 0).all() and not (lists[:, 1:] == positives[:, None]).any()


def test_sequence_transformer_equals_the_literal_layer_on_repeated_sequences():
    """Shared-history BST attention == Keras MultiHeadAttention over [history; target] for
    every candidate, including an empty history."""
    b, n, length, d, heads = 3, 4, 5, 16, 8
    rng = np.random.default_rng(0)
    history = tf.constant(rng.normal(size=(b, length, d)), tf.float32)
    target = tf.constant(rng.normal(size=(b, n, d)), tf.float32)
    mask = tf.constant([[True] * 5, [False, False, True, True, True], [False] * 5])
    layer = SequenceTransformer(heads, d // heads, d)
    ours = layer(history, mask, target)                                         # [b, n, L+1, d]
    attention = tf.keras.layers.MultiHeadAttention(heads, d // heads)
    x = tf.concat([tf.repeat(history, n, axis=0), tf.reshape(target, [b * n, 1, d])], 1)
    full_mask = tf.concat([tf.repeat(mask, n, axis=0), tf.ones([b * n, 1], tf.bool)], 1)
    attention(x, x)
    attention.set_weights([w.numpy() for w in (
        layer.kernels["query"], layer.biases["query"], layer.kernels["key"], layer.biases["key"],
        layer.kernels["value"], layer.biases["value"], layer.output_kernel, layer.output_bias)])
    literal = tf.reshape(x + attention(x, x, attention_mask=full_mask[:, None, :]),
                         [b, n, length + 1, d])                                 # the layer's norms are 4-D
    literal = layer.norm1(literal)
    literal = layer.norm2(literal + layer.feed_forward(literal))
    np.testing.assert_allclose(ours, literal, atol=1e-5)


@pytest.mark.parametrize("kind", ["temporal", "random"])
def test_transition_features_count_followers_and_leave_training_rows_out(kind):
    """Against a plain loop over every user's time-ordered training rows. Under the random
    split a row's latest history item may be a test row's, whose transition was never counted."""
    log = generate(PRESETS["tiny"], seed=0)
    inputs = prepare(log, split(log, kind), history_length=5)
    train = inputs.split.train
    counts, own_pair = {}, {}
    order = train[log.take(train).time_order()]                # training rows in time order
    for previous, row in zip(order[:-1], order[1:]):
        if log.user[previous] == log.user[row]:
            pair = (inputs.item_index[log.item[previous]], inputs.item_index[log.item[row]])
            counts[pair] = counts.get(pair, 0) + 1
            own_pair[row] = pair
    transitions = transition_matrix(inputs)
    rng = np.random.default_rng(0)
    for part in ("train", "test"):
        examples = inputs.examples[part]
        lists = np.concatenate([examples["item"][:, None],
                                rng.integers(0, inputs.num_items, (len(examples["item"]), 3))], 1)
        features = transition_features(transitions, inputs, part, lists)
        last = examples["history"][:, -1]
        expected = np.array([[counts.get((l, inputs.item_index[c]), 0) for c in items]
                             for l, items in zip(last, lists)], np.float32)
        if part == "train":   # the row's own transition is left out where it was counted
            own = np.array([own_pair.get(row) == (l, inputs.item_index[item])
                            for row, l, item in zip(train, last, examples["item"])])
            expected -= own[:, None] & (lists == examples["item"][:, None])
            assert own.mean() > (0.9 if kind == "temporal" else 0.5)
        np.testing.assert_allclose(features, np.log1p(expected), rtol=1e-6)
        assert (features[:, 0] > 0).mean() > 0.05


def test_similarities_are_cosines_of_shared_users_kept_for_the_nearest_neighbours():
    """Five users' item sets (vocabulary indexes 2..5), by hand: items 2 and 3 share three
    users of four each (3 / 4), items 2 and 4 and items 3 and 4 two users of 4 and 3
    (2 / sqrt(12)); pairs that one user shares (with item 5) are dropped."""
    import scipy.sparse as sp
    from tworec.ranking.features import similarities
    sets = [{2, 3, 4}, {2, 3}, {2, 4, 5}, {3, 4}, {2, 3}]
    has = sp.csr_matrix([[float(i in items) for i in range(6)] for items in sets])
    together = (has.T @ has).tocsr()
    third = 2 / np.sqrt(12)
    expected = np.zeros((6, 6), np.float32)
    expected[2, 3] = expected[3, 2] = 0.75
    expected[2, 4] = expected[4, 2] = expected[3, 4] = expected[4, 3] = third
    np.testing.assert_allclose(similarities(together, neighbors=5).toarray(), expected, rtol=1e-6)
    nearest = np.zeros((6, 6), np.float32)
    nearest[2, 3] = nearest[3, 2] = 0.75
    nearest[4, 2] = third                               # a tie with item 3: the lower index
    np.testing.assert_allclose(similarities(together, neighbors=1).toarray(), nearest, rtol=1e-6)


def cooccurrence_by_loop(matrix, history: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """[m, n] the sum of matrix[h, c] over the history items h (vocabulary indexes), in order."""
    dense = matrix.toarray()
    out = np.zeros(candidates.shape, np.float32)
    for slot in range(history.shape[1]):
        out += dense[history[:, slot][:, None], candidates]
    return out


def test_cooccurrence_features_sum_similarities_out_of_the_users_fold(inputs):
    """Held-out rows read the similarities of every training row; training rows those without
    their own user's fold, so no training row sees its own user's items (its later ones and
    its positive included)."""
    from tworec.ranking.features import cooccurrence, cooccurrence_features
    signal = cooccurrence(inputs, neighbors=50, folds=3)
    assert len(signal.folds) == 3 and set(np.unique(signal.fold_of_user)) == {0, 1, 2}
    popular = np.argsort(-inputs.item_probability)[:30]
    for part in ("train", "test"):
        history = inputs.examples[part]["history"]
        lists = np.tile(popular, (len(history), 1))
        features = cooccurrence_features(signal, inputs, part, lists, chunk=7)
        candidates = inputs.item_index[lists]
        if part == "train":
            fold = signal.fold_of_user[inputs.interactions.user[inputs.split.train]]
            expected = np.zeros_like(features)
            for f, matrix in enumerate(signal.folds):
                rows = fold == f
                expected[rows] = cooccurrence_by_loop(matrix, history[rows], candidates[rows])
            assert not np.allclose(features, cooccurrence_by_loop(signal.full, history, candidates))
        else:
            expected = cooccurrence_by_loop(signal.full, history, candidates)
        np.testing.assert_array_equal(features, expected)          # the same additions
        assert (features > 0).mean() > 0.2


def test_title_words_weigh_words_by_rarity_and_leave_out_the_commonest():
    """By hand: idf log(items / items with the word), unit rows, the release year dropped, an
    empty title empty; a word of more than 2% of the titles and more than 20 left out: of
    5,000 titles, one of 101 out and one of 100 kept; of 200, one of 21 out and one of 20
    kept."""
    from tworec.ranking.features import title_words
    words = title_words(np.array(["Toy Story (1995)", "Toy Story 2 (1999)", "Heat (1995)",
                                  "Story of Heat", "", "Toy (2000)"]))
    assert words.shape == (6, 5)                        # toy, story, 2, heat, of
    cosine = (words @ words.T).toarray()
    ln2, ln3, ln6 = np.log(2), np.log(3), np.log(6)
    expected = {(0, 1): 2 * ln2 ** 2 / (np.sqrt(2) * ln2 * np.sqrt(2 * ln2 ** 2 + ln6 ** 2)),
                (0, 5): 1 / np.sqrt(2), (0, 2): 0.0,
                (2, 3): ln3 / np.sqrt(ln2 ** 2 + ln3 ** 2 + ln6 ** 2),
                (5, 5): 1.0, (4, 4): 0.0, (1, 2): 0.0}
    for (a, b), value in expected.items():
        assert cosine[a, b] == pytest.approx(value, rel=1e-6), (a, b)
    for size, cut, kept in ((5000, 101, 100), (200, 21, 20)):    # 2% of 5,000; 20 of 200
        titles = np.array([f"Film{i}" + " The" * (i < cut) + " Common" * (i < kept)
                           for i in range(size)])
        words = title_words(titles)
        assert words.shape[1] == size + 1, size         # every film word, "common", not "the"
        assert (words[:kept].getnnz(axis=1) == 2).all() and (words[kept:].getnnz(axis=1) == 1).all()


def test_title_similarities_keep_each_items_nearest_titles_by_vocabulary_row(titled,
                                                                             monkeypatch):
    """The [V, num_items] matrix against the dense cosines of the titles: each catalogue
    item's `neighbors` highest positive cosines to other items, ties to the lower code (a
    stable sort), on the row of its vocabulary index, whatever the blocks; an item out of the
    vocabulary has its column and no row. None where no two titles share a word it reads."""
    from tworec.ranking import features
    from tworec.ranking.features import title_similarities, title_words
    blocks, most_similar = [], features.most_similar

    def counted(*args):                                           # one call a block of items
        blocks.append(1)
        return most_similar(*args)
    monkeypatch.setattr(features, "most_similar", counted)
    words = title_words(titled.interactions.item_features["title"])
    dense = (words @ words.T).toarray()
    np.fill_diagonal(dense, 0.0)
    unseen = 7                                                # as if first seen after training
    item_index = titled.item_index.copy()
    item_index[unseen] = 1
    data = dataclasses.replace(titled, item_index=item_index)
    for neighbors, block, count in ((3, 1, data.num_items), (3, 40, None), (200, 1 << 24, 1)):
        blocks.clear()
        similarity = title_similarities(data, neighbors, pairs_per_block=block)
        assert len(blocks) == count if count else 1 < len(blocks) < data.num_items
        got = similarity.matrix.toarray()
        assert similarity.neighbors == neighbors and got.shape == (data.items.size, data.num_items)
        expected = np.zeros_like(got)
        for code in np.flatnonzero(item_index >= 2):
            order = np.argsort(-dense[code], kind="stable")[:neighbors]
            order = order[dense[code, order] > 0]
            expected[item_index[code], order] = dense[code, order]
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
        assert got[:, unseen].any() and not got[:2].any()
        assert 0 < (got > 0).sum(1).max() <= neighbors
    assert (dense > 0).sum(1).max() > 3                        # the 3 kept are fewer than all
    untitled = {"title": np.array([f"Item {i}" for i in range(titled.num_items)])}
    for item_features in ({}, untitled):                         # the synthetic data's titles
        assert title_similarities(dataclasses.replace(titled, interactions=dataclasses.replace(
            titled.interactions, item_features=item_features)), 3) is None


def expected_title_candidates(data, matrix, history, lists, excluded, count, latest):
    """By loop: each row's `count` codes of the highest kept similarity to one of its `latest`
    history items, not listed nor excluded nor without training rows, ties to the lower code; -1
    past the positive ones."""
    dense, seen = matrix.toarray(), excluded.toarray()
    found = np.full((len(history), count), EMPTY_SLOT)
    for row, items in enumerate(history[:, -latest:]):
        best = dense[items].max(0)
        best[lists[row][lists[row] != EMPTY_SLOT]] = 0
        best[seen[row] > 0] = 0
        best[data.item_index < FIRST] = 0
        ranked = [code for code in np.lexsort((np.arange(len(best)), -best)) if best[code] > 0]
        found[row, :len(ranked[:count])] = ranked[:count]
    return found


@pytest.mark.parametrize("count, latest, chunk", [(3, 2, 4096), (4, 1, 1), (40, 3, 5)],
                         ids=["three-of-two", "four-of-one-a-row", "more-than-there-are"])
def test_title_candidates_are_the_most_similar_items_not_listed_nor_seen(inputs, titled, count,
                                                                         latest, chunk,
                                                                         monkeypatch):
    """Against a loop over rows: what each row's list holds, what it has seen and items
    without training rows (every seventh, as if first rated later) are left out, ties go to
    the lower code, slots past the similar items stay empty; rows in chunks give the same; a
    user unknown before the part gets none, and a row without history none (alone in its
    chunk too); no titles, no candidates; the latest items are at most the history's."""
    import scipy.sparse as sp
    from tworec.ranking.features import title_candidates, with_title_candidates
    config = preset("tiny", title_neighbors=6, title_candidates=count,
                    title_candidate_history=latest)
    data = dataclasses.replace(titled, item_index=np.where(
        np.arange(titled.num_items) % 7 == 0, OOV, titled.item_index))
    given = signals(data, config).titles
    assert (given.candidates, given.candidate_history) == (count, latest)
    history = data.examples["test"]["history"].copy()
    history[0] = PAD                                     # as a user without history
    rng = np.random.default_rng(0)
    lists = rng.integers(0, data.num_items, (len(history), 8))
    lists[:, -2:] = EMPTY_SLOT
    excluded = sp.csr_matrix(rng.random((len(history), data.num_items)) < 0.1)
    found = title_candidates(given, history, lists, excluded, chunk=chunk)
    expected = expected_title_candidates(data, given.matrix, history, lists, excluded, count,
                                         latest)
    np.testing.assert_array_equal(found, expected)
    assert (found[:, 0] >= 0).mean() > 0.5 and (found[0] == EMPTY_SLOT).all()
    assert given.matrix[:, ::7].nnz and not np.isin(found, np.arange(0, data.num_items, 7)).any()
    if count == 40:
        assert (found == EMPTY_SLOT).any(1).all()
    assert (signals(dataclasses.replace(data, history_length=2), config).titles.candidate_history
            == min(latest, 2))
    assert signals(dataclasses.replace(data, history_length=0), config).titles.candidates == 0
    known = np.arange(len(history)) % 3 > 0         # every third user as if new
    monkeypatch.setattr(type(data), "known_in", lambda self, part: known)
    extended = with_title_candidates(signals(data, config), data, "test", lists, excluded)
    np.testing.assert_array_equal(extended[:, :8], lists)
    np.testing.assert_array_equal(extended[known, 8:], expected[known])
    assert (extended[~known, 8:] == EMPTY_SLOT).all()
    for off, source in ((preset("tiny", title_neighbors=6, title_candidates=0), data),
                        (preset("tiny", title_neighbors=0), data),
                        (preset("tiny", task="regression"), data), (config, inputs)):
        assert with_title_candidates(signals(source, off), source, "test", lists,
                                     excluded) is lists


def test_title_features_are_the_highest_similarity_to_a_history_item(titled):
    """Held-out lists read each candidate's highest similarity to the row's history items,
    the exact float32 of the matrix (0 without history); training lists do not read them."""
    from tworec.ranking.features import TITLE_SIGNAL, title_features
    config = preset("tiny", title_neighbors=5)
    given = signals(titled, config)
    history = titled.examples["test"]["history"]
    lists = np.tile(np.arange(titled.num_items), (len(history), 1))
    features = title_features(given.titles, titled, "test", lists)
    dense = given.titles.matrix.toarray()
    expected = np.zeros(features.shape, np.float32)
    for slot in range(history.shape[1]):
        expected = np.maximum(expected, dense[history[:, slot][:, None], lists])
    np.testing.assert_array_equal(features, expected)
    assert (features > 0).mean() > 0.02
    examples = list_examples(titled, given, "test", lists[:, :4])
    np.testing.assert_array_equal(examples[TITLE_SIGNAL], expected[:, :4])
    assert TITLE_SIGNAL not in list_examples(titled, given, "train",
                                             candidate_lists(titled, "train", 3, 0.0, seed=0))
    assert signals(titled, preset("tiny", title_neighbors=0)).titles is None
    assert signals(titled, preset("tiny", task="regression")).titles is None


def test_a_users_training_features_do_not_move_with_their_own_later_items(inputs):
    """Leakage pin: replacing the item of a user's last training row by another leaves the
    co-occurrence features of that user's earlier training rows exactly as they were."""
    import dataclasses
    from tworec.ranking.features import cooccurrence, cooccurrence_features
    log, train = inputs.interactions, inputs.split.train
    user = np.bincount(log.user[train]).argmax()
    rows = train[log.user[train] == user]
    last = rows[log.take(rows).time_order()[-1]]
    popular = np.argsort(-inputs.item_probability)
    replacement = next(i for i in popular if i not in log.item[rows])
    changed_items = log.item.copy()
    changed_items[last] = replacement
    changed = prepare(dataclasses.replace(log, item=changed_items), inputs.split,
                      history_length=5)
    earlier = (log.user[train] == user) & (train != last)
    earlier &= ~(inputs.examples["train"]["history"] == inputs.item_index[log.item[last]]).any(1)
    lists = np.tile(np.concatenate([[log.item[last], replacement], popular[:20]]), (len(train), 1))
    # Every neighbour kept: the vocabulary's order (by count) moves, and with it ties at a cut.
    before, after = (cooccurrence_features(cooccurrence(data, neighbors=10_000, folds=3), data,
                                           "train", lists) for data in (inputs, changed))
    assert earlier.sum() >= 3
    np.testing.assert_array_equal(before[earlier], after[earlier])
    assert not np.array_equal(before, after)          # other users' rows see the change


@pytest.mark.parametrize("overrides", [
    {"model": "dcn"}, {"model": "dcn", "cross_structure": "parallel", "projection_dim": 4},
    {"model": "bst"}, {"model": "dcn", "task": "binary", "rating_weight": 0.0},
    {"model": "dcn", "task": "regression"}, {"model": "dcn", "mixed_precision": True, "jit_compile": True},
    {"model": "bst", "mixed_precision": True},
])
def test_models_and_tasks_train(inputs, transitions_only, overrides):
    config = preset("tiny", epochs=1, **overrides)
    if config.task == "regression":          # no logit, so no popularity signals for it
        assert signals(inputs, config).popularity is None and transitions_only.popularity
        transitions_only = dataclasses.replace(transitions_only, popularity=None)
    model, summary = fit(inputs, config, transitions_only, verbose=0)
    assert np.isfinite(summary["history"]["loss"]).all()
    metrics = evaluate(model, inputs, transitions_only, "test")
    if overrides.get("task") == "regression":
        assert 0 <= metrics["auc"] <= 1 and 0 < metrics["rmse"] < 3
        assert model.signal_weights == {}                      # no logit, no weights in it
        assert_scores_are_predicted_ratings(model, inputs, transitions_only)
    else:
        assert 0 <= metrics["auc"] <= 1
    assert tf.keras.mixed_precision.global_policy().name == "float32"


def test_a_mixed_precision_ranker_is_evaluated_and_exported_in_float32(inputs, transitions_only,
                                                                      tmp_path):
    """Float16 layers round otherwise run eagerly (the offline scores) than traced (the
    export), here by up to 9e-4: the ranker `fit` returns computes in float32, so the export
    serves exactly the scores evaluated offline, with no float16 op in it."""
    from tworec.ranking.export import export
    model, _ = fit(inputs, preset("tiny", epochs=1, mixed_precision=True), transitions_only,
                   verbose=0)
    run, meta = load_like_tf_serving(export(model, inputs, transitions_only,
                                            str(tmp_path / "ranking")))
    lists = candidate_lists(inputs, "test", 9, 0.0, seed=0)                         # [m, 10]
    users = inputs.interactions.user_ids[inputs.interactions.user[inputs.split.test]]
    served = run("serving_default", user_id=users,
                 item_ids=inputs.interactions.item_ids[lists])["scores"]
    np.testing.assert_array_equal(served, score_lists(model, inputs, transitions_only, "test",
                                                      lists))
    assert "DT_HALF" not in str(meta.graph_def)


def assert_scores_are_predicted_ratings(model, inputs, signals) -> None:
    """Regression trains the rating head alone, so that head scores every candidate (there
    is no score head, which would stay as initialised): each slot's score is the rating
    predicted for that item alone, for the users known before test."""
    from tworec.features.batches import batches
    assert model.score_head is None
    lists = candidate_lists(inputs, "test", 3, 0.0, seed=0)                           # [m, 4]
    scores = score_lists(model, inputs, signals, "test", lists)
    known = inputs.known_in("test")
    assert known.sum() > 10
    for slot in range(lists.shape[1]):
        alone = list_examples(inputs, signals, "test", lists[:, slot:slot + 1])
        rating = np.concatenate([model.predict_rating(b).numpy() for b in batches(alone, 4096)])
        np.testing.assert_allclose(scores[known, slot], rating[known], rtol=1e-5, atol=1e-5)
    # AUC orders the held-out item against the same candidates by those same scores
    auc = evaluate(model, inputs, signals, "test", hard=lists[:, 1:])["auc"]
    positive, negative = scores[:, :1], scores[:, 1:]
    assert auc == pytest.approx(np.mean(positive > negative))
    # with the held-out item among the candidates of every other row: the same negatives, and
    # the AUC of those rows alone apart
    found = np.arange(len(lists)) % 2 == 0
    padding = np.full((len(lists), 5), EMPTY_SLOT)              # the positive past the negatives
    hard = np.concatenate([lists[:, 1:], padding,
                           np.where(found, lists[:, 0], EMPTY_SLOT)[:, None]], 1)
    metrics = evaluate(model, inputs, signals, "test", hard=hard)
    assert metrics["auc"] == auc and metrics["retrieved_rows"] == found.sum()
    assert metrics["retrieved_among"] == hard.shape[1]
    assert metrics["auc_retrieved"] == pytest.approx(np.mean(positive[found] > negative[found]))
    with pytest.raises(ValueError, match="a regression ranker has no logit to rebalance"):
        calibrate(model, inputs, signals, "test", lists)


def test_ranking_learns_and_reranks(inputs, transitions_only):
    model, summary = fit(inputs, preset("tiny", epochs=4), transitions_only, verbose=0)
    metrics = evaluate(model, inputs, transitions_only, "test")
    assert metrics["auc"] > 0.7 and metrics["rmse"] < 1.5
    rng = np.random.default_rng(0)
    targets = inputs.examples["test"]["item"]
    candidates = np.stack([np.concatenate([[t], rng.choice(np.delete(np.arange(inputs.num_items), t),
                                                           19, replace=False)]) for t in targets])
    ranked = rerank(model, inputs, transitions_only, "test", candidates, top_n=5)
    scores = score_lists(model, inputs, transitions_only, "test", candidates)
    expected = np.take_along_axis(candidates, np.argsort(-scores, 1, kind="stable")[:, :5], 1)
    assert np.array_equal(ranked, expected)
    two_stage = two_stage_metrics(model, inputs, transitions_only, "test", candidates, ks=(10,))
    assert two_stage["recall@10"] > 0.5          # random order would give 0.5
    missing = candidates.copy()
    missing[:, 0] = missing[:, 1]
    assert two_stage_metrics(model, inputs, transitions_only, "test", missing)["recall@10"] == 0.0


def test_a_reranked_target_ranks_below_every_candidate_scoring_as_high():
    """Ties count against the target, as over the full catalogue (`target_ranks`), whatever
    the candidates' order: retrieval's and the two stages' ranks pair under one rule. Users
    the models do not know are served the popular list, a strict order whose scores (shares)
    tie: their ties rank in that order, as retrieval's `popular_order` does."""
    from tworec.evaluation import MISS
    candidates = np.array([[5, 6, 7, 8]] * 5)
    scores = np.array([[1.0, 2.0, 2.0, 0.0]] * 5, np.float32)
    ranks, target_scores = reranked_ranks(scores, candidates, np.array([6, 7, 5, 8, 9]))
    assert ranks.tolist() == [1, 1, 2, 3, MISS]     # 6 is listed before 7, its tie: still 1
    assert target_scores.tolist() == [2.0, 2.0, 1.0, 0.0, -np.inf]
    popular = np.array([True, True, False, True, True])     # a strict served order: its place
    ranks, _ = reranked_ranks(scores, candidates, np.array([6, 7, 5, 8, 9]), in_order=popular)
    assert ranks.tolist() == [0, 1, 2, 3, MISS]


def test_empty_slots_score_below_their_list_as_the_export(inputs, transitions_only):
    model, _ = fit(inputs, preset("tiny", epochs=1), transitions_only, verbose=0)
    items = candidate_lists(inputs, "test", 4, 0.0, seed=3)
    items[:, -2:] = EMPTY_SLOT
    scores = score_lists(model, inputs, transitions_only, "test", items)
    assert (scores[:, -2:] < scores[:, :-2].min(1, keepdims=True)).all()
    assert np.isfinite(scores).all()
    hard = np.concatenate([items[:, :1], np.full((len(items), 3), EMPTY_SLOT)], 1)
    assert evaluate(model, inputs, transitions_only, "test", hard=hard)["auc"] is None


def test_history_length_zero_gives_the_ranker_no_history():
    """With no history asked for, the latest-item signal is that of a user without history
    (no follower counts) in every part, and the sequence model is refused."""
    log = generate(PRESETS["tiny"], seed=0)
    data = prepare(log, split(log, "temporal"), history_length=0)
    transitions = transition_matrix(data)
    for part in ("train", "validation", "test"):
        items = candidate_lists(data, part, 4, 0.0, seed=0)
        assert not transition_features(transitions, data, part, items).any(), part
    with pytest.raises(ValueError, match="model 'bst' needs history_length > 0, got 0"):
        fit(data, preset("tiny", model="bst"), signals(data, preset("tiny")), verbose=0)


def test_settings_that_cannot_work(inputs, titled, transitions_only):
    with pytest.raises(ValueError, match="model 'gbdt'"):
        fit(inputs, preset("tiny", model="gbdt"), transitions_only, verbose=0)
    with pytest.raises(ValueError, match="needs history_length > 0"):
        preset("tiny", model="bst").validate(history_length=0)
    with pytest.raises(ValueError, match="use_transitions is True but the signals lack it"):
        fit(inputs, preset("tiny"), signals(inputs, preset("tiny", use_transitions=False)),
            verbose=0)
    with pytest.raises(ValueError, match="cooccurrence_neighbors is 0 but the signals carry it"):
        fit(inputs, preset("tiny"), signals(inputs, preset("tiny", cooccurrence_neighbors=5)),
            verbose=0)
    with pytest.raises(ValueError, match="built with 5 neighbours, 5 folds, seed 0, not as"):
        fit(inputs, preset("tiny", cooccurrence_neighbors=6),
            signals(inputs, preset("tiny", cooccurrence_neighbors=5)), verbose=0)
    with pytest.raises(ValueError, match="cooccurrence_folds must be at least 2"):
        preset("tiny", cooccurrence_folds=1).validate()
    with pytest.raises(ValueError, match="popularity_periods read by a listwise ranker is 3 but "
                       "the signals lack it"):
        fit(inputs, preset("tiny", popularity_periods=3),
            signals(inputs, preset("tiny", popularity_periods=0)), verbose=0)
    with pytest.raises(ValueError, match="popularity_periods read by a regression ranker is 0 "
                       "but the signals carry it"):                  # it has no logit for them
        fit(inputs, preset("tiny", task="regression"), transitions_only, verbose=0)
    with pytest.raises(ValueError, match="popularity has 2 periods, the config 3"):
        fit(inputs, preset("tiny", popularity_periods=3),
            signals(inputs, preset("tiny", popularity_periods=2)), verbose=0)
    with pytest.raises(ValueError, match="popularity_periods must be >= 0"):
        preset("tiny", popularity_periods=-1).validate()
    with pytest.raises(ValueError, match="title similarity keeps 5 neighbours, title_neighbors "
                       "read by a listwise ranker is 50"):
        fit(titled, preset("tiny"), signals(titled, preset("tiny", title_neighbors=5)), verbose=0)
    with pytest.raises(ValueError, match="keeps 50 neighbours, title_neighbors read by a "
                       "regression ranker is 0"):                   # it has no logit for them
        fit(titled, preset("tiny", task="regression", popularity_periods=0),
            signals(titled, preset("tiny", popularity_periods=0)), verbose=0)
    with pytest.raises(ValueError, match="title_neighbors must be >= 0"):
        preset("tiny", title_neighbors=-1).validate()


@pytest.mark.parametrize("field, value, message", [
    ("epochs", 0, "epochs must be positive, got 0"),
    ("batch_size", -1, "batch_size must be positive"),
    ("embedding_dim", 0, "embedding_dim must be positive"),
    ("bst_heads", 0, "bst_heads must be positive"),
    ("cross_layers", -1, "cross_layers must be 0 or more"),
    ("early_stopping_patience", -1, "early_stopping_patience must be 0 or more"),
    ("projection_dim", 0, "projection_dim must be None or positive"),
    ("deep_layers", 64, "deep_layers must be positive layer widths, got 64"),
    ("bst_layers", (32, 0), "bst_layers must be positive layer widths, got (32, 0)"),
    ("learning_rate", float("nan"), "learning_rate must be a positive number, got nan"),
    ("learning_rate", 0.0, "learning_rate must be a positive number"),
    ("rating_weight", -0.1, "rating_weight must be 0 or a positive number"),
    ("ranking_weight", float("inf"), "ranking_weight must be 0 or a positive number"),
    ("ranking_weight", 0.0, "ranking_weight 0 leaves a listwise ranker's scores untrained"),
])
def test_a_ranking_config_that_cannot_train_names_its_field(field, value, message):
    preset("tiny", deep_layers=[8, np.int64(4)], bst_layers=(), ranking_weight=0.5).validate()
    preset("tiny", task="regression", ranking_weight=0.0).validate()
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        preset("tiny", **{field: value}).validate()


@pytest.fixture(scope="module")
def signal(inputs):
    from tworec.retrieval.config import preset as retrieval_preset
    from tworec.retrieval.train import embeddings_for_ranking
    model, _, _ = train_retrieval(inputs.interactions, inputs.split,
                                  retrieval_preset("tiny", epochs=2))
    return signals(inputs, preset("tiny"), retrieval=embeddings_for_ranking(model, inputs))


def test_retrieval_scores_are_the_dot_products_of_the_pairs(inputs, signal):
    items = candidate_lists(inputs, "test", 4, 0.0, seed=3)
    queries, embeddings = signal.retrieval_queries["test"], signal.retrieval_items
    expected = np.array([[queries[row] @ embeddings[item] for item in items[row]]
                         for row in range(len(items))])
    np.testing.assert_allclose(retrieval_scores(queries, embeddings, items, chunk=7), expected,
                               rtol=1e-5, atol=1e-6)
    examples = list_examples(inputs, signal, "test", items)
    assert set(examples) >= {"items", "retrieval_scores", "transitions", "rating", "history"}
    without = signals(inputs, preset("tiny", use_retrieval_score=False), retrieval={
        "queries": signal.retrieval_queries, "latest": signal.retrieval_latest,
        "items": signal.retrieval_items})                  # the ablation: given, not read
    assert not without.has_retrieval and "retrieval_scores" not in list_examples(
        inputs, without, "test", items)
    with pytest.raises(ValueError, match="use_retrieval_score is False but the signals carry"):
        fit(inputs, preset("tiny", use_retrieval_score=False), signal, verbose=0)


def test_retrieval_signal_feeds_the_ranker(inputs, signal):
    model, _ = fit(inputs, preset("tiny", epochs=2), signal, verbose=0)
    assert model.use_retrieval and not {"retrieval", "transitions", "retrieval_items"} & set(vars(model))
    assert evaluate(model, inputs, signal, "test")["auc"] > 0.7


@pytest.mark.parametrize("periods, titles", [(0, 0), (4, 0), (0, 50)],
                         ids=["pair-signals", "with-popularity", "with-titles"])
def test_calibration_refits_the_logit_on_served_lists_and_the_model_keeps_it(inputs, titled,
                                                                              signal, periods,
                                                                              titles):
    """`calibrate` rewrites the model so that its logits are a * logit + sum_k d_k * signal_k,
    with (a, d) the minimum of the softmax cross-entropy over the lists that hold their
    positive (checked against a plain implementation, and by moving each number a little),
    the held-out popularity and title signals included."""
    from tworec.features.batches import batches
    from tworec.ranking.features import (POPULARITY_SIGNALS, TITLE_SIGNAL, period_popularity,
                                         title_similarities)
    signal = dataclasses.replace(
        signal, popularity=period_popularity(inputs, periods) if periods else None)
    if titles:              # the same inputs, their items titled
        inputs, signal = titled, dataclasses.replace(signal,
                                                     titles=title_similarities(titled, titles))
    config = preset("tiny", epochs=1, calibrate=False, popularity_periods=periods,
                    title_neighbors=titles)
    rng = np.random.default_rng(0)
    lists = candidate_lists(inputs, "validation", 19, 0.0, seed=5)
    lists = np.take_along_axis(lists, rng.permuted(np.tile(np.arange(20), (len(lists), 1)),
                                                   axis=1), 1)
    lists[::3] = np.where(lists[::3] == inputs.examples["validation"]["item"][::3, None],
                          EMPTY_SLOT, lists[::3])          # a third of the lists miss it
    lists[:, -1] = EMPTY_SLOT
    model, summary = fit(inputs, config, signal, verbose=0, served_validation=lists)
    assert "calibration" not in summary                   # served lists, but not asked to
    examples = list_examples(inputs, signal, "validation", np.maximum(lists, 0))
    logits = lambda: np.concatenate([model(b).numpy() for b in batches(examples, 512)])  # noqa
    before = logits()
    assert [model.signal_weights[name].numpy() for name in model.held_out_signals] == \
        [0.0] * len(model.held_out_signals)                 # training leaves them alone
    names = model.logit_signals
    old = {name: float(model.signal_weights[name].numpy()) for name in names}
    signals_ = np.stack([examples[name] for name in names], -1)              # [m, C, k]
    rows = inputs.known_in("validation") & \
        (lists == inputs.examples["validation"]["item"][:, None]).any(1)
    positive = (lists == inputs.examples["validation"]["item"][:, None]).argmax(1)

    def loss(a, d):
        refit = np.where(lists != EMPTY_SLOT, a * before + signals_ @ d, -np.inf)[rows]
        top = refit.max(1)
        log_norm = top + np.log(np.exp(refit - top[:, None]).sum(1))
        return np.mean(log_norm - refit[np.arange(len(refit)), positive[rows]])

    result = calibrate(model, inputs, signal, "validation", lists)
    a = result["scale"]
    d = np.array([result["weights"][name] - a * old[name] for name in names])
    assert result["rows"] == rows.sum() > 100
    assert names == ["retrieval_scores", "transitions"] + (
        list(POPULARITY_SIGNALS) * bool(periods)) + [TITLE_SIGNAL] * bool(titles)
    np.testing.assert_allclose(logits(), a * before + signals_ @ d.astype(np.float32),
                               rtol=1e-4, atol=1e-4)
    assert result["loss_before"] == pytest.approx(loss(1.0, np.zeros(len(names))), rel=1e-6)
    assert result["loss_after"] == pytest.approx(loss(a, d), rel=1e-6)
    assert result["loss_after"] < result["loss_before"] - 1e-3
    for step in (1e-2, -1e-2):
        assert loss(max(a + step, 0.0), d) >= result["loss_after"] - 1e-7
        for k in range(len(names)):
            assert loss(a, d + step * np.eye(len(names))[k]) >= result["loss_after"] - 1e-7
    assert all(abs(result["weights"][name]) > 1e-2 for name in model.held_out_signals)
    _, summary = fit(inputs, dataclasses.replace(config, calibrate=True), signal, verbose=0,
                     served_validation=lists)
    assert summary["calibration"]["rows"] == result["rows"]
    missing = np.where(lists == inputs.examples["validation"]["item"][:, None], EMPTY_SLOT, lists)
    assert calibrate(model, inputs, signal, "validation", missing) == {
        "rows": 0, "skipped": "no served validation list holds its positive"}
    if periods or titles:                   # a ranker without signals: the same in every case
        return
    without = preset("tiny", epochs=1, use_transitions=False, popularity_periods=0,
                     title_neighbors=0)
    alone, _ = fit(inputs, without, signals(inputs, without), verbose=0)
    assert alone.logit_signals == [] and calibrate(
        alone, inputs, signals(inputs, without), "validation", lists)["weights"] == {}


@pytest.mark.parametrize("model_name, with_signal, neighbors, periods, titles",
                         [("dcn", False, 0, 0, 0), ("dcn", True, 0, 0, 0), ("bst", True, 0, 0, 0),
                          ("dcn", True, 20, 0, 0), ("dcn", False, 0, 3, 0),
                          ("dcn", True, 0, 0, 50)],
                         ids=["dcn-alone", "dcn-retrieval-signal", "bst-retrieval-signal",
                              "dcn-retrieval-cooccurrence", "dcn-popularity", "dcn-titles"])
def test_export_serves_the_keras_scores(inputs, titled, signal, transitions_only, tmp_path,
                                       model_name, with_signal, neighbors, periods, titles):
    from tworec.ranking.export import export
    from tworec.ranking.features import (TITLE_SIGNAL, cooccurrence, period_popularity,
                                         title_similarities)
    from tensorflow.python.framework import op_def_registry
    given = signal if with_signal else transitions_only
    config = preset("tiny", epochs=1, model=model_name, cooccurrence_neighbors=neighbors,
                    popularity_periods=periods, title_neighbors=titles)
    if neighbors:
        given = dataclasses.replace(given, cooccurrence=cooccurrence(inputs, neighbors, 5))
    given = dataclasses.replace(
        given, popularity=period_popularity(inputs, periods) if periods else None)
    if titles:              # the same inputs, their items titled
        inputs = titled
        given = dataclasses.replace(given, titles=title_similarities(titled, titles))
    model, _ = fit(inputs, config, given, verbose=0)
    for weight, name in zip((0.7, -0.4), model.held_out_signals):     # as calibration sets them
        model.signal_weights[name].assign(weight)
    log = inputs.interactions
    path = export(model, inputs, given, str(tmp_path / "ranking"))
    run, meta = load_like_tf_serving(path)
    scores_shape = meta.signature_def["serving_default"].outputs["scores"].tensor_shape
    assert [dim.size for dim in scores_shape.dim] == [-1, -1]
    users = log.user_ids[:3]
    last = inputs.latest[:3, -1]                                               # vocab indexes
    code_of = np.zeros(inputs.items.size, np.int64)
    code_of[inputs.item_index] = np.arange(inputs.num_items)
    # Each user's candidates: the 2 items that most often followed their latest item, 2 others.
    followers = np.argsort(-given.transitions[last].toarray(), axis=1, kind="stable")[:, :2]
    if titles:         # the items most similar to several history items: highest != sum
        similar = np.stack([given.titles.matrix[inputs.latest[:3, slot]].toarray()
                            for slot in range(inputs.latest.shape[1])])          # [L, 3, I]
        others = np.argsort(similar.max(0) - similar.sum(0), axis=1, kind="stable")[:, :2]
    else:
        others = np.arange(6).reshape(3, 2)
    codes = np.concatenate([code_of[followers], others], axis=1)                    # [3, 4]
    transitions = np.log1p(given.transitions[last[:, None], inputs.item_index[codes]].toarray())
    assert (transitions[:, :2] > 0).all()
    served = run("serving_default", user_id=users, item_ids=log.item_ids[codes])["scores"]
    features = {"user": inputs.users.remap(log.user_ids)[:3], "history": inputs.latest[:3],
                "items": codes, "transitions": transitions.astype(np.float32)}
    for name, index in inputs.user_feature_index.items():
        features[f"user_{name}"] = index[:3]
    if with_signal:
        features["retrieval_scores"] = retrieval_scores(signal.retrieval_latest[:3],
                                                        signal.retrieval_items, codes)
    if neighbors:
        features["cooccurrence"] = cooccurrence_by_loop(given.cooccurrence.full, inputs.latest[:3],
                                                        inputs.item_index[codes])
        assert (features["cooccurrence"] > 0).mean() >= 0.5
    if periods:
        table, period = given.popularity.tables["test"], given.popularity.user_period["test"]
        features["recent_popularity"] = table[-1][codes]
        features["user_time_popularity"] = table[period[:3, None], codes]
        assert len(set(period[:3])) > 1 and (features["user_time_popularity"] > 0).any()
    if titles:
        in_history = np.take_along_axis(similar, codes[None], 2)                     # [L, 3, 4]
        features[TITLE_SIGNAL] = in_history.max(0)
        assert model.held_out_signals == [TITLE_SIGNAL] and (in_history.sum(0) > in_history.max(
            0) + 0.1)[:, 2:].all()
    expected = model({k: tf.constant(v) for k, v in features.items()}).numpy()
    np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)
    unknown = run("serving_default", user_id=np.array(["nobody"]),
                  item_ids=np.array([[log.item_ids[0], log.item_ids[1], "no-such-item"]]))["scores"]
    assert unknown.shape == (1, 3) and unknown[0, 2] < unknown[0, :2].min()
    np.testing.assert_allclose(unknown[0, :2], inputs.popular["test"].share[:2])  # as served
    ops = graph_op_types(meta)
    assert all(op_def_registry.get(op) is not None for op in ops)
    assert not [op for op in ops if op.startswith("Scann")]
    assert_holds_the_weights_alone(path, model)


def test_a_pair_table_of_a_matrix_without_entries_is_built_and_answers_zero():
    """No user with two training rows gives no transitions: the export's table is still built
    (TF refuses to import no keys into it) and answers 0, as `pair_values` does."""
    import scipy.sparse as sp
    from tworec.ranking.export import pair_table
    from tworec.ranking.features import pair_keys, pair_values
    previous, candidates = np.array([[0, 2]]), np.array([[1, 2, 0]])
    keys = previous[:, :, None] * 3 + candidates[:, None, :]
    for matrix in (sp.csr_matrix((3, 3), dtype=np.float32),
                   sp.csr_matrix(np.array([[0, 2, 0], [0, 0, 0], [5, 0, 1]], np.float32))):
        served = pair_table(matrix).lookup(tf.constant(keys)).numpy()
        np.testing.assert_array_equal(served, pair_values(pair_keys(matrix), 3, previous,
                                                          candidates))
    assert served.tolist() == [[[2, 0, 0], [0, 1, 5]]]


@pytest.mark.parametrize("exclude_seen", [True, False], ids=["seen-excluded", "seen-kept"])
def test_export_adds_the_title_candidates_the_evaluation_adds(titled, tmp_path, exclude_seen):
    """The `candidates` signature appends to each test user's given list what
    `with_title_candidates` appends offline (the user's seen items left out unless the inputs
    keep them, and items without training rows), "" for a user it does not know and past the
    similar items; an id outside the catalogue is passed through; without title candidates it
    answers the given list."""
    import scipy.sparse as sp
    from tworec.ranking.export import export
    from tworec.ranking.features import with_title_candidates
    inputs = dataclasses.replace(titled, exclude_seen=exclude_seen, item_index=np.where(
        np.arange(titled.num_items) % 7 == 0, OOV, titled.item_index))   # as if rated later
    config = preset("tiny", epochs=1, title_neighbors=6, title_candidates=4,
                    title_candidate_history=2)
    given = signals(inputs, config)
    model, _ = fit(inputs, config, given, verbose=0)
    log = inputs.interactions
    users = log.user[inputs.split.test]
    rng = np.random.default_rng(1)
    lists = rng.integers(0, inputs.num_items, (len(users), 6))
    lists[:, -1] = lists[0, 0] = EMPTY_SLOT              # row 0's first: an unknown id below
    seen = inputs.seen[users]
    excluded = seen if exclude_seen else sp.csr_matrix(seen.shape)
    expected = with_title_candidates(given, inputs, "test", lists, excluded)
    assert expected.shape == (len(users), 10) and (expected[:, 6:] >= 0).mean() > 0.5
    added_seen = np.take_along_axis(seen.toarray(), np.maximum(expected[:, 6:], 0), 1) > 0
    assert (added_seen & (expected[:, 6:] >= 0)).any() != exclude_seen
    ids = np.append(log.item_ids, "")
    run, _ = load_like_tf_serving(export(model, inputs, given, str(tmp_path / "ranking")))
    given_ids = ids[lists]
    given_ids[0, 0] = "no-such-item"                     # excludes nothing, passed through
    answer = run("candidates", user_id=log.user_ids[users], item_ids=given_ids)["item_ids"]
    np.testing.assert_array_equal(answer.astype(str), np.concatenate(
        [given_ids, ids[expected[:, 6:]]], axis=1))
    unknown = run("candidates", user_id=np.array(["nobody"]), item_ids=given_ids[:1])
    np.testing.assert_array_equal(unknown["item_ids"].astype(str),
                                  [list(given_ids[0]) + [""] * 4])
    plain = preset("tiny", epochs=1, title_neighbors=6, title_candidates=0)
    model, _ = fit(inputs, plain, signals(inputs, plain), verbose=0)
    run, _ = load_like_tf_serving(export(model, inputs, signals(inputs, plain),
                                         str(tmp_path / "plain")))
    np.testing.assert_array_equal(run("candidates", user_id=log.user_ids[users],
                                      item_ids=given_ids)["item_ids"].astype(str), given_ids)


@pytest.mark.parametrize("pairs", [3, 8], ids=["long-rows-split", "rows-in-blocks"])
def test_an_export_scoring_a_few_pairs_at_a_time_answers_as_one_block(inputs, signal, tmp_path,
                                                                     monkeypatch, pairs):
    """Blocks of 3 pairs (each 4-item list cut in 3 + 1) or of 8 (2 rows a block, the last
    short) score what one block does, an unknown item still last of its whole list; an empty
    request answers [0, n]."""
    from tworec.ranking import export as ranking_export
    model, _ = fit(inputs, preset("tiny", epochs=1), signal, verbose=0)
    one, _ = load_like_tf_serving(ranking_export.export(model, inputs, signal,
                                                        str(tmp_path / "one")))
    monkeypatch.setattr(ranking_export, "PAIRS_PER_BLOCK", pairs)
    blocks, _ = load_like_tf_serving(ranking_export.export(model, inputs, signal,
                                                           str(tmp_path / "blocks")))
    log = inputs.interactions
    items = log.item_ids[np.arange(15).reshape(5, 3) % inputs.num_items].astype(object)
    items = np.concatenate([items, [["no-such-item"]] * 5], axis=1)               # [5, 4]
    users = np.array(log.user_ids[:4].tolist() + ["nobody"])
    expected = one("serving_default", user_id=users, item_ids=items)["scores"]
    np.testing.assert_allclose(blocks("serving_default", user_id=users, item_ids=items)[
        "scores"], expected, rtol=1e-6)       # other block shapes may sum in another order
    assert (expected[:, 3] < expected[:, :3].min(axis=1)).all()
    empty = blocks("serving_default", user_id=np.array([], object),
                   item_ids=np.zeros((0, 4), object))["scores"]
    assert empty.shape == (0, 4)


def _peak_growth_mib(run) -> float:
    """MiB the process's resident memory peaks above where it was, while `run()` runs."""
    import os
    import threading
    import time
    from tworec.serving.soak import rss_bytes

    def resident() -> int:
        return rss_bytes(os.getpid()) >> 20
    start, peak, done = resident(), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], resident())
            time.sleep(0.005)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run()
    finally:
        done.set()
        watcher.join()
    return max(peak[0], resident()) - start


def test_a_long_ranking_row_takes_a_blocks_memory_not_one_for_all_its_pairs(
        inputs, signal, tmp_path, capsys):
    """One row of a million item ids peaks at tens of MiB (its inputs and scores, and a block
    of PAIRS_PER_BLOCK pairs' intermediates); scored at once it took 325 MiB here (and 87 s,
    against 0.3 s), 3.6 GiB with the demo's ranker. `-s` shows the figure."""
    from tworec.ranking.export import export
    from tworec.serving.model import LoadedModel
    model, _ = fit(inputs, preset("tiny", epochs=1), signal, verbose=0)
    served = LoadedModel(export(model, inputs, signal, str(tmp_path / "ranking")))
    log = inputs.interactions
    request = {"user_id": log.user_ids[:1].astype(object),
               "item_ids": log.item_ids[np.arange(1_000_000) % inputs.num_items][None, :]
               .astype(object)}
    served.run({"user_id": request["user_id"], "item_ids": request["item_ids"][:, :10]})
    answers = {}
    growth = _peak_growth_mib(lambda: answers.update(served.run(request)))
    with capsys.disabled():
        print(f"\n1M pairs in blocks: +{growth:.0f} MiB")
    assert answers["scores"].shape == (1, 1_000_000) and growth < 96


def test_period_popularity_by_hand():
    """Two users, four items: the known rows of each held-out part in time order, cut into two
    periods of equal rows; a held-out row reads the last period and its user's latest one."""
    import dataclasses
    from tworec.features.interactions import Interactions
    from tworec.ranking.features import period_popularity, popularity_features
    i0, i1, i2, i3 = range(4)
    rows = [(0, i0, 1), (0, i1, 2), (1, i1, 3), (1, i2, 4), (0, i2, 5), (1, i3, 7), (1, i0, 8),
            (0, i3, 9)]
    user, item, time = (np.array(column) for column in zip(*rows))
    log = Interactions(user_ids=np.array(["u0", "u1"]), item_ids=np.array(["a", "b", "c", "d"]),
                       user=user.astype(np.int32), item=item.astype(np.int32),
                       timestamp=time.astype(np.int64))
    data = prepare(log, split(log, "temporal"), history_length=2)
    popularity = period_popularity(data, 2)
    share = np.log1p(data.items.size / 2).astype(np.float32)     # once in a period of 2 rows
    twice = np.log1p(2 * data.items.size / 3).astype(np.float32)  # twice in a period of 3 rows
    once = np.log1p(data.items.size / 3).astype(np.float32)
    # validation knows the training rows t1 t2 | t3 t4; test the fit rows t1 t2 t3 | t4 t5 t7
    np.testing.assert_array_equal(popularity.tables["validation"],
                                  [[share, share, 0, 0], [0, share, share, 0]])
    np.testing.assert_array_equal(popularity.tables["test"],
                                  [[once, twice, 0, 0], [0, 0, twice, once]])
    np.testing.assert_array_equal(popularity.user_period["validation"], [0, 1])
    np.testing.assert_array_equal(popularity.user_period["test"], [1, 1])
    # validation rows: u0 (t5), u1 (t7), in log order
    features = popularity_features(popularity, data, "validation", np.array([[i2, i0]] * 2))
    np.testing.assert_array_equal(features["recent_popularity"], [[share, 0], [share, 0]])
    np.testing.assert_array_equal(features["user_time_popularity"], [[0, share], [share, 0]])
    # Rewriting what a part must not know leaves its tables as they were.
    held_out = np.concatenate([data.split.validation, data.split.test])
    for part, unknown in (("validation", held_out), ("test", data.split.test)):
        changed = dataclasses.replace(log, item=log.item.copy())
        changed.item[unknown] = (changed.item[unknown] + 1) % 4
        again = period_popularity(prepare(changed, data.split, history_length=2), 2)
        np.testing.assert_array_equal(again.tables[part], popularity.tables[part])
        np.testing.assert_array_equal(again.user_period[part], popularity.user_period[part])
    examples = list_examples(data, signals(data, preset("tiny", popularity_periods=2)), "train",
                             np.array([[i0, i1]] * len(data.split.train)))
    assert "recent_popularity" not in examples                  # held-out rows only


def test_pair_auc_counts_a_tie_against_the_held_out_item():
    scores = np.array([[0.5, 0.1, 0.5, 0.9],          # beats one, ties one, loses one
                       [2.0, 1.0, 3.0, 0.0]])         # the last slot is empty
    pairs = np.array([[True, True, True], [True, True, False]])
    assert pair_auc(scores, pairs) == pytest.approx(2 / 5)
    assert pair_auc(scores, np.zeros_like(pairs)) is None
