"""features.stream: prepared shards as a training stream and as held-out batches; retrieval
trained and evaluated from them equals the in-memory path where both apply."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from test_prepare import LENGTH, _log_table
from tworec.evaluation import (MISS, baseline_ranks, baselines, eval_set,
                               prepared_baseline_ranks, prepared_baselines)
from tworec.features import DataError
from tworec.features.history import transition_counts
from tworec.features.inputs import prepare
from tworec.features.prepare import prepare_shards
from tworec.features.sources import load
from tworec.features.splits import temporal_split
from tworec.features.stream import PreparedLog, parse_block
from tworec.features.training import worker_seed
from tworec.features.vocab import FIRST
from tworec.retrieval.config import preset
from tworec.retrieval.train import evaluate_model, evaluate_prepared, fit, fit_prepared

BLOCK = 100


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny log as one Parquet file, its in-memory inputs and its prepared folder (shards
    of 1,000 rows, training blocks of 100)."""
    root = tmp_path_factory.mktemp("stream")
    pq.write_table(_log_table(), root / "log.parquet")
    prepare_shards(str(root / "log.parquet"), str(root / "prepared"), history_length=LENGTH,
                   memory_limit="256MiB", rows_per_shard=1000, block_rows=BLOCK)
    interactions = load(str(root / "log.parquet"))
    inputs = prepare(interactions, temporal_split(interactions), LENGTH)
    return inputs, PreparedLog.load(str(root / "prepared"))


def _rows(batch: dict) -> list[tuple]:
    """(user, item, *history) of every row of a batch."""
    return [(u, i, *h) for u, i, h in zip(batch["user"].numpy().tolist(),
                                          batch["item"].numpy().tolist(),
                                          batch["history"].numpy().tolist())]


def _training_rows(prepared: PreparedLog) -> list[tuple]:
    """The training rows of the Parquet shards, file by file in their order, as the blocks
    code them."""
    rows = []
    for shard in prepared.manifest["shards"]:
        table = pq.read_table(f"{prepared.folder}/{shard['path']}").to_pydict()
        rows += [(u, i - FIRST, *h) for u, i, h, part in zip(
            table["user"], table["item"], table["history"], table["split"]) if part == 0]
    return rows


def test_blocks_hold_exactly_the_training_rows_in_random_order(folders):
    _, prepared = folders
    assert len(prepared.train_files) == 4
    records = tf.data.TFRecordDataset(list(prepared.train_files))
    blocks = [parse_block(record, LENGTH) for record in records]
    assert max(len(block["user"]) for block in blocks) == BLOCK
    got = [row for block in blocks for row in _rows(block)]
    assert sorted(got) == sorted(_training_rows(prepared))
    assert len(got) == prepared.train_rows == sum(b["rows"] for b in prepared.manifest[
        "train_blocks"])
    assert all(block["item"].dtype == tf.int64 for block in blocks)
    # the shards keep users together; the blocks are a uniform sample: ~44 of the 200 users
    # among any 50 rows, where the shards' order gives a handful
    users = np.array([row[0] for row in got])
    distinct = [len(set(users[start:start + 50])) for start in range(0, len(users) - 50, 50)]
    assert np.mean(distinct) > 40
    in_shards = np.array([row[0] for row in _training_rows(prepared)])
    assert np.mean([len(set(in_shards[start:start + 50]))
                    for start in range(0, len(in_shards) - 50, 50)]) < 10


def test_training_batches_are_shuffled_training_rows_the_seed_repeats(folders):
    _, prepared = folders
    training = _training_rows(prepared)
    epoch = len(training) // 50

    def first(seed, count):
        dataset = prepared.training_batches(50, seed=seed, window_rows=300, shuffle_blocks=4)
        return [_rows(batch) for batch in dataset.take(count)]

    batches = first(3, 3 * epoch)
    assert all(len(batch) == 50 for batch in batches)
    seen = [row for batch in batches for row in batch]
    assert set(seen) <= set(training)
    assert len(set(seen)) > 0.97 * len(set(training))                  # ~3 epochs cover all
    assert batches[:5] == first(3, 5) != first(4, 5)
    for batch in batches[:epoch]:                                       # one epoch: no repeat
        assert len(set(batch)) == len(batch)
    assert len(next(iter(prepared.training_batches(50, seed=worker_seed())))["user"]) == 50
    # a batch larger than the window's rows widens the window instead of never coming
    wide = prepared.training_batches(500, window_rows=300)
    assert [len(batch["user"]) for batch in wide.take(3)] == [500] * 3


def test_every_pass_trains_each_row_once_in_an_order_of_its_own(folders):
    """A window's last rows fill a batch with the next window's, so a pass trains every row
    once whatever the batch size; and the block order changes with the pass and the seed. In
    a one-file log it alone makes passes differ, and a cluster's workers: they read the same
    windows in the same order when it followed the global seed."""
    _, prepared = folders
    one_file = dataclasses.replace(prepared, train_files=prepared.train_files[:1])
    in_file = sorted(row for record in tf.data.TFRecordDataset(one_file.train_files)
                     for row in _rows(parse_block(record, LENGTH)))
    n = len(in_file)

    def passes(seed, count: int) -> list[list[tuple]]:
        dataset = one_file.training_batches(40, seed=seed, window_rows=300, shuffle_blocks=4)
        rows = [row for batch in dataset.take(count * n // 40 + 1) for row in _rows(batch)]
        return [rows[p * n:(p + 1) * n] for p in range(count)]

    def windows(rows: list[tuple]) -> list[set]:     # 3 blocks of 100 rows: 7.5 batches
        return [set(rows[start:start + 300]) for start in range(0, n, 300)]

    first, second = passes(3, 2)
    assert sorted(first) == in_file == sorted(second)
    assert windows(first) != windows(second)
    tf.random.set_seed(0)                        # as retrieval's `_fit` does before a cluster
    try:
        workers = [passes(tf.constant(seed, tf.int64), 1)[0] for seed in (1, 2)]
    finally:
        tf.random.set_seed(None)
    assert windows(workers[0]) != windows(workers[1])


@pytest.mark.parametrize("rows_per_pass", [1 << 23, 500])
def test_heldout_batches_equal_the_in_memory_eval_sets(folders, rows_per_pass):
    inputs, prepared = folders
    for part in ("validation", "test"):
        expected = eval_set(inputs.interactions, inputs.split, part)
        got = list(prepared.heldout_batches(part, batch_rows=64, rows_per_pass=rows_per_pass))
        # pass by pass (users by index modulo the passes), each in the log's order
        passes = -(-prepared.manifest["rows"] // rows_per_pass)
        assert passes == (1 if rows_per_pass > 1e6 else 8)
        log_order = np.argsort(expected.rows)
        order = log_order[np.argsort(inputs.examples[part]["user"][log_order] % passes,
                                     kind="stable")]
        assert all(len(b["user"]) <= 64 for b in got)
        joined = {name: np.concatenate([b[name] for b in got])
                  for name in ("user", "history", "target", "known")}
        examples = inputs.examples[part]
        np.testing.assert_array_equal(joined["user"], examples["user"][order])
        np.testing.assert_array_equal(joined["history"], examples["history"][order])
        in_vocabulary = inputs.item_index[expected.targets[order]]
        np.testing.assert_array_equal(joined["target"],
                                      np.where(in_vocabulary >= FIRST, in_vocabulary - FIRST, -1))
        np.testing.assert_array_equal(joined["known"], expected.known[order])
        # the same known items, in the prepared catalogue's codes
        excluded = [set(row.indices) for b in got for row in b["excluded"]]
        codes = inputs.item_index - FIRST
        for n, row in enumerate(order):
            assert excluded[n] == set(codes[expected.history[row].indices]) - {-1}


def test_a_heavy_users_known_items_are_read_once_each(tmp_path, monkeypatch):
    """A pass held every known row of its users: a user of millions of rows cost them all."""
    users = ["heavy"] * 400 + [f"u{n % 5}" for n in range(20)]
    items = [f"i{n % 3}" for n in range(400)] + [f"i{n % 4}" for n in range(20)]
    pq.write_table(pa.table({"user_id": users, "item_id": items,
                             "timestamp": list(range(len(users)))}), tmp_path / "log.parquet")
    prepare_shards(str(tmp_path / "log.parquet"), str(tmp_path / "out"), history_length=2)
    pairs = []
    seen_matrix = PreparedLog._seen_matrix
    monkeypatch.setattr(PreparedLog, "_seen_matrix", lambda self, users, seen_users, items: (
        pairs.extend(zip(seen_users, items)), seen_matrix(self, users, seen_users, items))[1])
    batches = list(PreparedLog.load(str(tmp_path / "out")).heldout_batches("test"))
    assert sum(len(batch["user"]) for batch in batches) == 6
    assert len(pairs) == len(set(pairs)) == 3 + 5 * 4 - 5    # each user's known items


class _PreparedCodes:
    """An in-memory model seen through a prepared log's catalogue codes."""

    def __init__(self, model, inputs):
        by_index = np.argsort(inputs.item_index)                 # vocabulary index -> code
        self.model = model
        self.codes = tf.constant(by_index[-(inputs.items.size - FIRST):])

    def candidate(self, codes):
        return self.model.candidate(tf.gather(self.codes, codes))

    def query(self, features):
        return self.model.query(features)


@pytest.mark.parametrize("members", [1, 2])
def test_evaluation_of_a_prepared_log_equals_the_in_memory_evaluation(folders, members):
    inputs, prepared = folders
    assert prepared.num_items == inputs.items.size - FIRST == inputs.num_items   # all trained
    model, _ = fit(inputs, preset("tiny", epochs=1, members=members), verbose=0)
    for part in ("validation", "test"):
        expected = evaluate_model(model, inputs, part)
        got = evaluate_prepared(_PreparedCodes(model, inputs), prepared, part)
        assert got == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("length", [LENGTH, 0])
def test_baselines_of_a_prepared_log_equal_the_in_memory_baselines(tmp_path, length):
    """Row by row, on the tiny log plus two users: one whose validation item has no training
    row (so its test row's last item is out of the vocabulary), one whose test item has none
    (out of the catalogue: a miss, ranked in memory below every trained item). Whatever the
    history length: at 0 the transitions were read from the one PAD slot, so none were
    counted and the baseline was popularity."""
    table = _log_table()
    last = int(table.column("timestamp").to_numpy().max())
    a, b, c = (table.column("item_id")[n].as_py() for n in (0, 1, 2))
    fresh = {"user_id": ["fresh"] * 4 + ["fresh2"] * 3,
             "item_id": [a, b, "fresh-v", c if c not in (a, b) else "x", a, b, "fresh-t"],
             "timestamp": [last + n for n in (1, 2, 3, 4, 1, 2, 3)], "rating": [4.0] * 7}
    pq.write_table(pa.concat_tables([table, pa.table(fresh, schema=table.schema)]),
                   tmp_path / "log.parquet")
    prepare_shards(str(tmp_path / "log.parquet"), str(tmp_path / "prepared"),
                   history_length=length, memory_limit="256MiB")
    prepared = PreparedLog.load(str(tmp_path / "prepared"))
    log = load(str(tmp_path / "log.parquet"))
    parts = temporal_split(log)
    codes = prepare(log, parts, LENGTH).item_index - FIRST   # in-memory code -> prepared code
    trained = codes >= 0
    assert (~trained).sum() == 2
    expected = transition_counts(log, parts.train).toarray()
    assert expected.sum() > 100
    assert not expected[~trained].any() and not expected[:, ~trained].any()
    got = prepared.transition_counts().toarray()
    np.testing.assert_array_equal(got[np.ix_(codes[trained], codes[trained])],
                                  expected[np.ix_(trained, trained)])
    counts = np.bincount(log.item[parts.train], minlength=log.num_items)
    np.testing.assert_array_equal(prepared.item_counts[codes[trained]], counts[trained])
    for part in ("validation", "test"):
        evalset = eval_set(log, parts, part)
        memory = baseline_ranks(log, parts, evalset)
        streamed = prepared_baseline_ranks(prepared, part)
        assert streamed["ease"] is None
        outside = ~trained[evalset.targets]                       # rows in log order, as both
        assert outside.sum() == 1
        if part == "test":          # a last item out of the vocabulary, the target in it
            assert (~trained[evalset.last_item[~outside]]).sum() == 1
        for name in ("popularity", "item_transition"):
            np.testing.assert_array_equal(streamed[name][~outside], memory[name][~outside])
            assert streamed[name][outside] == MISS and memory[name][outside] >= 10
        assert prepared_baselines(prepared, part, ks=(10,))["item_transition"] == \
            pytest.approx(baselines(log, parts, evalset, ks=(10,))["item_transition"])


def test_prepared_baselines_break_ties_of_counts_as_the_in_memory_ones(tmp_path):
    """The tiny preset's shards: many items share a training count, and their in-memory codes
    (the item table's order) and prepared codes (count, then first row) order them otherwise;
    both paths break such ties by item id, so they rank every target alike (ties by code gave
    111 of 200 test rows other popularity ranks)."""
    from tworec.features.synthetic import PRESETS, write_shards
    write_shards(PRESETS["tiny"], str(tmp_path / "log"))
    prepare_shards(str(tmp_path / "log"), str(tmp_path / "prepared"), history_length=LENGTH,
                   memory_limit="256MiB")
    prepared = PreparedLog.load(str(tmp_path / "prepared"))
    log = load(str(tmp_path / "log"))
    parts = temporal_split(log)
    trained = prepare(log, parts, LENGTH).item_index >= FIRST
    counts = np.bincount(log.item[parts.train], minlength=log.num_items)[trained]
    assert len(np.unique(counts)) < len(counts) / 2                     # ties aplenty
    evalset = eval_set(log, parts, "test")
    inside = trained[evalset.targets]
    memory, streamed = baseline_ranks(log, parts, evalset), prepared_baseline_ranks(prepared)
    for name in ("popularity", "item_transition"):
        np.testing.assert_array_equal(streamed[name][inside], memory[name][inside])


@pytest.mark.parametrize("length", [2, 0])
def test_shards_prepared_without_the_previous_item_use_the_history_or_are_refused(tmp_path,
                                                                                 length):
    """Shards of an earlier version have no `previous` column: their last history slot is
    the previous item, unless they hold no history. Then they are still evaluated, popularity
    as before, but the item-transition baseline is None (not popularity), and asking for its
    counts is a one-line DataError."""
    pq.write_table(_log_table(), tmp_path / "log.parquet")
    prepare_shards(str(tmp_path / "log.parquet"), str(tmp_path / "prepared"),
                   history_length=length, memory_limit="256MiB")
    prepared = PreparedLog.load(str(tmp_path / "prepared"))
    current, ranks = prepared.transition_counts(), prepared_baseline_ranks(prepared)
    for shard in prepared.manifest["shards"]:
        path = os.path.join(prepared.folder, shard["path"])
        pq.write_table(pq.read_table(path).drop_columns(["previous"]), path)
    earlier = prepared_baseline_ranks(prepared)
    assert np.array_equal(earlier["popularity"], ranks["popularity"])
    if length:
        assert (prepared.transition_counts() != current).nnz == 0 and current.nnz
        assert np.array_equal(earlier["item_transition"], ranks["item_transition"])
        return
    assert earlier["item_transition"] is None and ranks["item_transition"] is not None
    with pytest.raises(DataError) as error:
        prepared.transition_counts()
    assert str(error.value) == (
        f"{prepared.folder}: prepared by an earlier version without history, so its shards do "
        "not hold each row's previous item; prepare the log again into a new folder")


@pytest.mark.parametrize("members", [1, 2])
def test_a_model_trains_from_the_stream(folders, members):
    inputs, prepared = folders
    config = preset("tiny", epochs=2, batch_size=64, members=members)
    model, summary = fit_prepared(prepared, config, steps_per_epoch=20, verbose=0)
    assert summary["epochs"] == 2 and summary["history"]["loss"][1] < summary["history"]["loss"][0]
    towers = getattr(model, "members", [model])
    assert len(towers) == members
    for tower in towers:
        assert tower.user_embedding.input_dim == prepared.num_users == inputs.users.size
    metrics = evaluate_prepared(model, prepared, "test", ks=(10,))
    assert 0 < metrics["recall@10"] <= 1


def test_a_batch_larger_than_the_training_rows_is_refused_before_training(folders):
    """An epoch trains on whole batches: with none, both trainers refuse in one message, also
    when the steps of an epoch are given."""
    inputs, prepared = folders
    for data, rows, train in [(inputs, len(inputs.examples["train"]["user"]), fit),
                              (prepared, prepared.train_rows, fit_prepared)]:
        config = preset("tiny", batch_size=rows + 1)
        for steps in (None, 5):
            with pytest.raises(ValueError, match=rf"^batch_size {rows + 1} is larger than the "
                                                 rf"training split \({rows} rows\)$"):
                train(data, config, steps_per_epoch=steps, verbose=0)
        preset("tiny", batch_size=rows).require_whole_batch(rows)


def test_a_held_out_item_outside_the_catalogue_is_a_miss(tmp_path):
    """A user's last row names an item no training row has: it is out of the prepared
    catalogue, so at K = the whole catalogue exactly the other rows whose item is not among
    their user's known items are hits."""
    table = _log_table()
    last = int(np.argmax(table.column("timestamp").to_numpy()))
    extra = table.slice(last, 1).to_pydict()
    extra["item_id"], extra["timestamp"] = ["only-held-out"], [extra["timestamp"][0] + 1]
    pq.write_table(pa.concat_tables([table, pa.table(extra, schema=table.schema)]),
                   tmp_path / "log.parquet")
    prepare_shards(str(tmp_path / "log.parquet"), str(tmp_path / "prepared"),
                   history_length=LENGTH)
    prepared = PreparedLog.load(str(tmp_path / "prepared"))
    rows = list(prepared.heldout_batches("test"))
    target = np.concatenate([b["target"] for b in rows])
    user = np.concatenate([b["user"] for b in rows])
    assert (target == -1).sum() == 1
    model, _ = fit_prepared(prepared, preset("tiny", epochs=1, batch_size=64),
                            steps_per_epoch=3, verbose=0)
    known_target = np.concatenate([np.asarray(b["excluded"][np.arange(len(b["target"])),
                                                          np.maximum(b["target"], 0)]).ravel()
                                   for b in rows]) > 0
    expected = np.mean((target >= 0) & ~known_target)
    metrics = evaluate_prepared(model, prepared, "test", ks=(prepared.num_items,))
    assert metrics[f"recall@{prepared.num_items}"] == pytest.approx(expected)
    assert len(user) == prepared.manifest["split"]["test"]


def test_the_prepare_module_says_progress_and_one_json_line(tmp_path):
    pq.write_table(_log_table(), tmp_path / "log.parquet")
    command = [sys.executable, "-m", "tworec.features.prepare", "--data",
               str(tmp_path / "log.parquet"), "--out", str(tmp_path / "prepared"),
               "--history-length", str(LENGTH), "--memory-limit", "256MiB"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = len(load(str(tmp_path / "log.parquet")))                  # duplicates dropped
    summary = json.loads(done.stdout)
    assert done.stderr.splitlines() == [
        f"[prepare] {tmp_path}/prepared/shards/part-00000.parquet: {rows:,} rows",
        f"[prepare] {tmp_path}/prepared/train/part-00000.tfrecord: "
        f"{summary['split']['train']:,} rows"]
    assert summary["rows"] == rows and summary["split"] == PreparedLog.load(
        str(tmp_path / "prepared")).manifest["split"]
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert "not empty; pass a new or empty folder" in again.stderr
    missing = subprocess.run(command[:4] + [str(tmp_path / "nowhere"), "--out",
                                            str(tmp_path / "other")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no such file or folder" in missing.stderr
    assert not os.path.exists(tmp_path / "other")
