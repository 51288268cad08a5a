"""Resumable training: a run interrupted after an epoch continues from its checkpoint."""
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
    """Stops training with an error at the end of epoch `after` (0-based)."""

    def __init__(self, after: int):
        super().__init__()
        self.after = after

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.after:
            raise RuntimeError(f"interrupted after epoch {epoch}")


@pytest.fixture(scope="module")
def log():
    return generate(PRESETS["tiny"], seed=0)


def train_retrieval(log, run_dir):
    config = retrieval_preset("tiny", epochs=4, early_stopping_patience=0)
    inputs = prepare(log, split(log, "temporal"), history_length=5)
    return retrieval_train.fit(inputs, config, run_dir=run_dir, verbose=0)[1]


def train_ranking(log, run_dir):
    config = ranking_preset("tiny", epochs=4, early_stopping_patience=0)
    inputs = prepare(log, split(log, "temporal"), history_length=5)
    return ranking_train.fit(inputs, config, signals(inputs, config),
                             run_dir=run_dir, verbose=0)[1]


@pytest.mark.parametrize("train", [train_retrieval, train_ranking])
def test_an_interrupted_run_resumes_after_its_last_finished_epoch(log, tmp_path, monkeypatch,
                                                                  train):
    callbacks = training.run_callbacks
    monkeypatch.setattr(training, "run_callbacks", lambda *args: callbacks(*args) + [Interrupt(1)])
    with pytest.raises(RuntimeError, match="interrupted after epoch 1"):
        train(log, str(tmp_path))
    monkeypatch.undo()
    resumed = train(log, str(tmp_path))
    fresh = train(log, str(tmp_path / "fresh"))
    assert resumed["epochs"] == 2 and fresh["epochs"] == 4          # epochs 3 and 4 only
    losses = resumed["history"]["loss"]
    assert np.isfinite(losses).all() and losses[0] < fresh["history"]["loss"][0]
