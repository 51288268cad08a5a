"""features.prepare: DuckDB's out-of-core preparation equals the in-memory path exactly."""
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tworec.features.inputs import prepare
from tworec.features.prepare import SPLIT_CODES, prepare_shards
from tworec.features.sources import load
from tworec.features.splits import temporal_split
from tworec.features.synthetic import PRESETS, generate

LENGTH = 5


def _log_table(seed: int = 0) -> pa.Table:
    """The tiny synthetic log as a Parquet table, with what the SQL must get right: timestamps
    coarsened into ties, rows shuffled out of time order, a few exactly repeated rows and some
    users with fewer than 3 rows."""
    log = generate(PRESETS["tiny"], seed=seed)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(log))
    users = log.user_ids[log.user][order]
    items = log.item_ids[log.item][order]
    timestamps = log.timestamp[order] // 86_400                     # many ties within a day
    ratings = log.rating[order]
    repeats = rng.choice(len(order), 30, replace=False)              # duplicates, dropped on load
    short = np.array(["short-a", "short-a", "short-b"])              # users of 2 and 1 rows
    return pa.table({
        "user_id": np.concatenate([users, users[repeats], short]),
        "item_id": np.concatenate([items, items[repeats], items[:3]]),
        "timestamp": np.concatenate([timestamps, timestamps[repeats], timestamps[:3]]),
        "rating": np.concatenate([ratings, ratings[repeats], ratings[:3]]).astype(np.float32)})


def _prepared(folder: str) -> dict[str, np.ndarray]:
    table = pq.read_table(os.path.join(folder, "shards"))
    table = table.sort_by("row")
    history = table.column("history").combine_chunks()
    return {"row": table.column("row").to_numpy(), "user": table.column("user").to_numpy(),
            "item": table.column("item").to_numpy(),
            "history": history.flatten().to_numpy().reshape(len(table), history.type.list_size),
            "timestamp": table.column("timestamp").to_numpy(),
            "rating": table.column("rating").to_numpy(), "split": table.column("split").to_numpy()}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """One log written as one Parquet file and as 3 shards, both prepared."""
    root = tmp_path_factory.mktemp("prepare")
    table = _log_table()
    pq.write_table(table, root / "log.parquet")
    (root / "shards").mkdir()
    cuts = [0, 1000, 2500, len(table)]
    for part, (start, stop) in enumerate(zip(cuts[:-1], cuts[1:])):
        pq.write_table(table.slice(start, stop - start), root / "shards" / f"part-{part}.parquet")
    one = prepare_shards(str(root / "log.parquet"), str(root / "one"), history_length=LENGTH,
                         memory_limit="256MiB")
    three = prepare_shards(str(root / "shards"), str(root / "three"), history_length=LENGTH,
                           memory_limit="256MiB")
    return root, one, three


def test_split_vocabularies_histories_counts_equal_the_in_memory_path(logs):
    root, manifest, _ = logs
    interactions = load(str(root / "log.parquet"))
    split = temporal_split(interactions)
    inputs = prepare(interactions, split, LENGTH)
    assert interactions.dropped == {"duplicate_row": 30}
    got = _prepared(str(root / "one"))
    assert len(got["row"]) == len(interactions)
    # the rows kept are the in-memory rows in the same order; split labels per row
    expected_split = np.zeros(len(interactions), np.int8)
    for part, code in SPLIT_CODES.items():
        expected_split[getattr(split, part)] = code
    np.testing.assert_array_equal(got["split"], expected_split)
    np.testing.assert_array_equal(got["timestamp"], interactions.timestamp)
    np.testing.assert_array_equal(got["rating"], interactions.rating)
    for part, code in SPLIT_CODES.items():
        rows = got["split"] == code
        examples = inputs.examples[part]
        np.testing.assert_array_equal(got["user"][rows], examples["user"])
        np.testing.assert_array_equal(got["item"][rows], inputs.item_index[examples["item"]])
        np.testing.assert_array_equal(got["history"][rows], examples["history"])
    for name, vocabulary in (("users", inputs.users), ("items", inputs.items)):
        table = pq.read_table(root / "one" / f"{name}.parquet")
        np.testing.assert_array_equal(table.column("id").to_numpy().astype(str), vocabulary.ids)
        np.testing.assert_array_equal(table.column("index").to_numpy(),
                                      np.arange(len(vocabulary)) + 2)
    items = pq.read_table(root / "one" / "items.parquet")
    counts = np.bincount(interactions.item[split.train], minlength=interactions.num_items)
    codes = {item_id: code for code, item_id in enumerate(interactions.item_ids)}
    np.testing.assert_array_equal(
        items.column("count").to_numpy(),
        counts[[codes[i] for i in items.column("id").to_numpy().astype(str)]])
    assert manifest["split"] == split.sizes()
    assert manifest["short_users"] == split.short_users == 2
    assert manifest == json.loads((root / "one" / "manifest.json").read_text())


def test_three_shards_prepare_as_one_file(logs):
    root, one, three = logs
    first, second = _prepared(str(root / "one")), _prepared(str(root / "three"))
    for name in first:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
    for name in ("users.parquet", "items.parquet"):
        assert pq.read_table(root / "one" / name).equals(pq.read_table(root / "three" / name))
    assert {k: v for k, v in one.items() if k not in ("source", "seconds", "rows_per_second")} \
        == {k: v for k, v in three.items() if k not in ("source", "seconds", "rows_per_second")}


def test_duckdb_runs_under_the_memory_limit_given(logs):
    _, one, _ = logs
    assert one["duckdb"]["memory_limit"] == "256.0 MiB"
