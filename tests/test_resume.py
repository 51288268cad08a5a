"""Resumable training: a run interrupted mid-epoch resumes into the uninterrupted run."""
import os

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


@pytest.fixture(scope="module")
def log():
    return generate(PRESETS["tiny"], seed=0)


def train_retrieval(log, run_dir):
    """Stops early at epoch 3 of 8 on this log, keeping epoch 2's weights."""
    config = retrieval_preset("tiny", epochs=8, early_stopping_patience=1)
    inputs = prepare(log, split(log, "temporal"), history_length=5)
    return retrieval_train.fit(inputs, config, run_dir=run_dir, verbose=0)


def train_ranking(log, run_dir):
    """Stops early at epoch 4 of 8 on this log, keeping epoch 3's weights."""
    config = ranking_preset("tiny", epochs=8, early_stopping_patience=1)
    inputs = prepare(log, split(log, "temporal"), history_length=5)
    return ranking_train.fit(inputs, config, signals(inputs, config), run_dir=run_dir,
                             verbose=0)


@pytest.mark.parametrize("train, stage, after", [(train_retrieval, "retrieval", 1),
                                                 (train_ranking, "ranking", 2)])
def test_an_interrupted_run_resumes_into_the_uninterrupted_one(log, tmp_path, monkeypatch,
                                                               train, stage, after):
    """Interrupted after its best epoch so far, the resumed training reads the batches the
    uninterrupted one reads next and keeps its early stopping's best value, wait and weights:
    it stops at the same epoch with the same weights, bit for bit, and its summary counts
    every epoch. Without any of these it would train on: the best would restart at the
    first resumed epoch, which is worse."""
    fresh_model, fresh = train(log, str(tmp_path / "fresh"))
    assert fresh["best_epoch"] == after + 1 < fresh["epochs"] == after + 2 < 8
    callbacks = training.run_callbacks
    monkeypatch.setattr(training, "run_callbacks",
                        lambda *args: callbacks(*args) + [Interrupt(after)])
    with pytest.raises(RuntimeError, match=f"interrupted after epoch {after}"):
        train(log, str(tmp_path / "run"))
    monkeypatch.undo()
    assert (tmp_path / "run" / "checkpoints" / stage / "state").is_dir()
    resumed_model, resumed = train(log, str(tmp_path / "run"))
    assert {key: resumed[key] for key in ("epochs", "best_epoch", "history")} == {
        key: fresh[key] for key in ("epochs", "best_epoch", "history")}
    for resumed_weights, fresh_weights in zip(resumed_model.get_weights(),
                                              fresh_model.get_weights(), strict=True):
        np.testing.assert_array_equal(resumed_weights, fresh_weights)
    assert not os.listdir(tmp_path / "run" / "checkpoints" / stage)      # removed once done
