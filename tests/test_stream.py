"""features.stream: prepared shards as a training stream and as held-out batches; retrieval
trained and evaluated from them equals the in-memory path where both apply."""
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from test_prepare import LENGTH, _log_table
from tworec.evaluation import eval_set
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


def test_blocks_hold_exactly_the_training_rows_in_order(folders):
    _, prepared = folders
    assert len(prepared.train_files) == 4
    records = tf.data.TFRecordDataset(list(prepared.train_files))
    blocks = [parse_block(record, LENGTH) for record in records]
    assert max(len(block["user"]) for block in blocks) == BLOCK
    got = [row for block in blocks for row in _rows(block)]
    assert got == _training_rows(prepared)
    assert len(got) == prepared.train_rows == sum(b["rows"] for b in prepared.manifest[
        "train_blocks"])
    assert all(block["item"].dtype == tf.int64 for block in blocks)


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
    position = {row: n for n, row in enumerate(training)}
    spread = [max(position[r] for r in batch) - min(position[r] for r in batch)
              for batch in batches[:10]]
    assert min(spread) > 2 * BLOCK                                      # rows from many blocks
    assert len(next(iter(prepared.training_batches(50, seed=worker_seed())))["user"]) == 50


def test_heldout_batches_equal_the_in_memory_eval_sets(folders):
    inputs, prepared = folders
    for part in ("validation", "test"):
        expected = eval_set(inputs.interactions, inputs.split, part)
        order = np.argsort(expected.rows)
        got = list(prepared.heldout_batches(part, batch_rows=64))
        assert [len(b["user"]) for b in got[:-1]] == [64] * (len(got) - 1)
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


def test_evaluation_of_a_prepared_log_equals_the_in_memory_evaluation(folders):
    inputs, prepared = folders
    assert prepared.num_items == inputs.items.size - FIRST == inputs.num_items   # all trained
    model, _ = fit(inputs, preset("tiny", epochs=1), verbose=0)
    for part in ("validation", "test"):
        expected = evaluate_model(model, inputs, part)
        got = evaluate_prepared(_PreparedCodes(model, inputs), prepared, part)
        assert got == pytest.approx(expected, abs=1e-9)


def test_a_model_trains_from_the_stream(folders):
    _, prepared = folders
    config = preset("tiny", epochs=2, batch_size=64)
    model, summary = fit_prepared(prepared, config, steps_per_epoch=20, verbose=0)
    assert summary["epochs"] == 2 and summary["history"]["loss"][1] < summary["history"]["loss"][0]
    assert model.user_embedding.input_dim == prepared.num_users == inputs_users(prepared)
    metrics = evaluate_prepared(model, prepared, "test", ks=(10,))
    assert 0 < metrics["recall@10"] <= 1


def inputs_users(prepared: PreparedLog) -> int:
    return len(pq.read_table(f"{prepared.folder}/users.parquet")) + FIRST


def test_the_prepare_module_says_progress_and_one_json_line(tmp_path):
    pq.write_table(_log_table(), tmp_path / "log.parquet")
    command = [sys.executable, "-m", "tworec.features.prepare", "--data",
               str(tmp_path / "log.parquet"), "--out", str(tmp_path / "prepared"),
               "--history-length", str(LENGTH), "--memory-limit", "256MiB"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = len(load(str(tmp_path / "log.parquet")))                  # duplicates dropped
    assert done.stderr.splitlines() == [
        f"[prepare] {tmp_path}/prepared/shards/part-00000.parquet: {rows:,} rows"]
    summary = json.loads(done.stdout)
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
