"""Resumable training: a run interrupted mid-epoch resumes into the uninterrupted run."""
import json
import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tworec.features import generate, split, training
from tworec.features.inputs import prepare
from tworec.features.synthetic import PRESETS
from tworec.ranking import train as ranking_train
from tworec.ranking.config import preset as ranking_preset
from tworec.ranking.features import signals
from tworec.retrieval import train as retrieval_train
from tworec.retrieval.config import preset as retrieval_preset


class Interrupt(tf.keras.callbacks.Callback):
    """Stops training with an error in the first step after epoch `after` (0-based), as a
    process killed mid-epoch: that step has trained, but no checkpoint holds it."""

    def __init__(self, after: int):
        super().__init__()
        self.after = after

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == self.after + 1:
            raise RuntimeError(f"interrupted after epoch {self.after}")


class InterruptAtEpochEnd(tf.keras.callbacks.Callback):
    """Stops training with an error at the end of epoch `at` (0-based), once the callbacks
    before it have run."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.at:
            raise RuntimeError(f"interrupted at the end of epoch {epoch}")


@pytest.fixture(scope="module")
def log():
    return generate(PRESETS["tiny"], seed=0)


def train_retrieval(log, run_dir, epochs=8, patience=1, members=1):
    """With patience 1, stops early at epoch 3 of 8 on this log, keeping epoch 2's weights;
    with patience 2, at epoch 8 of 10, keeping epoch 6's (no gain at epoch 7 or 8). Two
    members, patience 1: at epoch 5 of 8, keeping epoch 4's."""
    config = retrieval_preset("tiny", epochs=epochs, early_stopping_patience=patience,
                              members=members)
    inputs = prepare(log, split(log, "temporal"), history_length=5)
    return retrieval_train.fit(inputs, config, run_dir=run_dir, verbose=0)


def train_retrieval_members(log, run_dir, epochs=8, patience=1):
    return train_retrieval(log, run_dir, epochs, patience, members=2)


def train_ranking(log, run_dir, epochs=8, patience=1):
    """Stops early at epoch 4 of 8 on this log, keeping epoch 3's weights."""
    config = ranking_preset("tiny", epochs=epochs, early_stopping_patience=patience)
    inputs = prepare(log, split(log, "temporal"), history_length=5)
    return ranking_train.fit(inputs, config, signals(inputs, config), run_dir=run_dir,
                             verbose=0)


@pytest.fixture(scope="module")
def uninterrupted(log, tmp_path_factory):
    """(model, summary) of an uninterrupted training, once per (train, epochs, patience)."""
    runs = {}

    def run(train, epochs, patience):
        if (train, epochs, patience) not in runs:
            runs[train, epochs, patience] = train(log, str(tmp_path_factory.mktemp("fresh")),
                                                  epochs, patience)
        return runs[train, epochs, patience]
    return run


# (train, its stage, epochs, patience, how it is interrupted, after which epoch (0-based),
#  and what the uninterrupted run's best and last epochs (1-based) are)
CASES = {
    # after its best epoch so far: the best value and weights must carry over
    "mid-epoch": (train_retrieval, "retrieval", 8, 1, "mid-epoch", 1, 2, 3),
    "ranking mid-epoch": (train_ranking, "ranking", 8, 1, "mid-epoch", 2, 3, 4),
    "retrieval members mid-epoch": (train_retrieval_members, "retrieval", 8, 1, "mid-epoch", 3,
                                    4, 5),
    # after an epoch without gain: its wait (1) must carry over, or training would go on
    "waiting": (train_retrieval, "retrieval", 10, 2, "mid-epoch", 6, 6, 8),
    # stopped after epoch 2's state was written, before its checkpoint, then again mid-epoch
    # 3: the lost epoch's best weights must not be read
    "before its checkpoint": (train_retrieval, "retrieval", 8, 1, "before checkpoint", 1, 2, 3),
    # stopped after early stopping's last epoch: resumed, it must not train on
    "after the last epoch": (train_retrieval, "retrieval", 8, 1, "at the end", 2, 2, 3),
    # stopped after the last of its epochs: resumed, it must not fail for want of epochs
    "after the epoch count": (train_retrieval, "retrieval", 3, 5, "at the end", 2, 2, 3),
}


@pytest.mark.parametrize("case", CASES)
def test_an_interrupted_run_resumes_into_the_uninterrupted_one(log, tmp_path, monkeypatch,
                                                               uninterrupted, case):
    """The resumed training reads the batches the uninterrupted one reads next and carries
    its early stopping's best value, epoch, wait and weights: it stops at the same epoch with
    the same weights, bit for bit, and its summary counts every epoch and its seconds."""
    train, stage, epochs, patience, how, after, best, last = CASES[case]
    fresh_model, fresh = uninterrupted(train, epochs, patience)
    assert (fresh["best_epoch"], fresh["epochs"]) == (best, last)
    run, callbacks = tmp_path / "run", training.run_callbacks
    state = run / "checkpoints" / stage / "state"
    if how == "before checkpoint":
        backup = tf.keras.callbacks.BackupAndRestore._backup

        def lost(self, epoch, batch=0):
            if epoch == after:
                raise RuntimeError(f"interrupted before the checkpoint of epoch {epoch}")
            backup(self, epoch, batch)
        monkeypatch.setattr(tf.keras.callbacks.BackupAndRestore, "_backup", lost)
        with pytest.raises(RuntimeError, match="interrupted"):
            train(log, str(run), epochs, patience)
        monkeypatch.undo()
        # The lost epoch's best weights, as another device would have trained them; the
        # resumed training repeats that epoch, and is interrupted again after it.
        lost_weights = state / f"best_weights_0_epoch_{after + 1}.npz"
        np.savez(lost_weights, *[w + 1 for w in np.load(lost_weights).values()])
    interrupt = InterruptAtEpochEnd(after) if how == "at the end" else Interrupt(after)
    monkeypatch.setattr(training, "run_callbacks", lambda *args: callbacks(*args) + [interrupt])
    with pytest.raises(RuntimeError, match="interrupted"):
        train(log, str(run), epochs, patience)
    monkeypatch.undo()
    done = max(int(name[len("after_epoch_"):-len(".json")]) for name in os.listdir(state)
               if name.startswith("after_epoch_"))
    saved = json.loads((state / f"after_epoch_{done}.json").read_text())
    if case == "waiting":
        assert saved["early_stopping"][0]["wait"] == 1
    resumed_model, resumed = train(log, str(run), epochs, patience)
    assert {key: resumed[key] for key in ("epochs", "best_epoch", "history")} == {
        key: fresh[key] for key in ("epochs", "best_epoch", "history")}
    assert resumed["seconds"] > saved["seconds"] > 0
    for resumed_weights, fresh_weights in zip(resumed_model.get_weights(),
                                              fresh_model.get_weights(), strict=True):
        np.testing.assert_array_equal(resumed_weights, fresh_weights)
    assert not os.listdir(run / "checkpoints" / stage)                  # removed once done


def test_a_checkpoint_without_its_state_is_refused_before_training(log, tmp_path,
                                                                   monkeypatch):
    """A checkpoint an older tworec wrote has no early stopping state to resume with."""
    callbacks = training.run_callbacks
    monkeypatch.setattr(training, "run_callbacks", lambda *args: callbacks(*args) + [Interrupt(0)])
    with pytest.raises(RuntimeError, match="interrupted"):
        train_retrieval(log, str(tmp_path))
    monkeypatch.undo()
    shutil.rmtree(tmp_path / "checkpoints" / "retrieval" / "state")
    with pytest.raises(ValueError, match="holds a checkpoint without the state resuming needs"):
        train_retrieval(log, str(tmp_path))
