"""The shared training helper: which epoch's weights a model ends with, and what it says."""
import numpy as np
import pytest
import tensorflow as tf

from tworec.features.training import best_epoch


class PlantedScore(tf.keras.callbacks.Callback):
    """Writes a chosen `val_score` into each epoch's logs, before early stopping reads them."""

    def __init__(self, scores):
        super().__init__()
        self.scores = scores

    def on_epoch_end(self, epoch, logs=None):
        logs["val_score"] = self.scores[epoch]


def fit(scores, epochs, patience=2):
    model = tf.keras.Sequential([tf.keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    callbacks = [PlantedScore(scores),
                 tf.keras.callbacks.EarlyStopping("val_score", mode="max", patience=patience,
                                                  restore_best_weights=True)]
    model.fit(np.zeros((4, 2)), np.zeros(4), epochs=epochs, verbose=0, callbacks=callbacks)
    return callbacks


@pytest.mark.parametrize("scores, epochs, patience, best, said", [
    ([0.1, 0.5, 0.4, 0.3, 0.2, 0.1], 6, 2,
     2, "[s] early stopping after epoch 4: no val_score gain for 2 epochs; the weights of epoch 2 "
        "(val_score 0.5000) are kept\n"),
    ([0.1, 0.2, 0.5, 0.4, 0.3], 5, 2,
     3, "[s] no val_score gain after epoch 3; the weights of epoch 3 (val_score 0.5000) "
        "are kept\n"),
    # not stopped, yet Keras restores the best weights when training ends
    ([0.1, 0.5, 0.4, 0.3], 4, 3,
     2, "[s] no val_score gain after epoch 2; the weights of epoch 2 (val_score 0.5000) "
        "are kept\n"),
    ([0.1, 0.2, 0.3, 0.4], 4, 2, 4, ""),
])
def test_best_epoch_is_the_one_whose_weights_are_kept(scores, epochs, patience, best, said,
                                                       capsys):
    callbacks = fit(scores, epochs, patience)
    assert best_epoch(callbacks, epochs, "s", verbose=1) == best
    assert capsys.readouterr().out == said
    assert callbacks[1].best_epoch + 1 == best
