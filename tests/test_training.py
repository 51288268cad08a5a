"""The shared training helpers: which epoch's weights a model ends with and what it says, the
losses a TFRS model reports, and LazyAdam."""
import numpy as np
import pytest
import tensorflow as tf

from tworec.features.training import TFRSModel, LazyAdam, best_epoch
import tensorflow_recommenders as tfrs  # noqa: E402  (after tworec, which selects Keras 2)


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


def sparse_step(optimizer, table, rows, values):
    optimizer.apply_gradients([(tf.IndexedSlices(tf.constant(values, tf.float32),
                                                 tf.constant(rows), tf.constant(table.shape)),
                                table)])


@pytest.mark.parametrize("epsilon, adaptive", [(1e-7, False), (0.5, False), (0.5, True)])
def test_lazy_adam_on_every_row_is_adam(epsilon, adaptive):
    start = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    tables = [tf.Variable(start) for _ in range(2)]
    optimizers = [kind(0.1, epsilon=epsilon, adaptive_epsilon=adaptive)
                  for kind in (tf.keras.optimizers.Adam, LazyAdam)]
    for step in range(3):
        values = np.random.default_rng(step + 1).normal(size=(4, 3))
        for optimizer, table in zip(optimizers, tables):
            sparse_step(optimizer, table, [2, 0, 3, 1], values)
    np.testing.assert_allclose(tables[1].numpy(), tables[0].numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(tables[1].numpy(), start)


def test_lazy_adam_moves_only_the_rows_it_sees():
    """Two steps by hand: rows outside a step keep their value and their moments (Adam would
    decay them); a row twice in one gradient gets the sum."""
    start = np.arange(8, dtype=np.float32).reshape(4, 2)
    table, optimizer = tf.Variable(start), LazyAdam(0.5, beta_1=0.5, beta_2=0.75, epsilon=0.0)
    sparse_step(optimizer, table, [1, 1], [[1.0, 2.0], [3.0, -4.0]])   # row 1: g = (4, -2)
    sparse_step(optimizer, table, [3], [[2.0, 2.0]])                   # row 3 at step 2
    expected = start.copy()
    m, v = 0.5 * np.array([4.0, -2.0]), 0.25 * np.array([16.0, 4.0])  # row 1 after step 1
    expected[1] -= 0.5 * np.sqrt(1 - 0.75) / (1 - 0.5) * m / np.sqrt(v)
    m, v = 0.5 * np.array([2.0, 2.0]), 0.25 * np.array([4.0, 4.0])    # row 3, first moments
    expected[3] -= 0.5 * np.sqrt(1 - 0.75 ** 2) / (1 - 0.5 ** 2) * m / np.sqrt(v)
    np.testing.assert_allclose(table.numpy(), expected, rtol=1e-6)
    moments = [optimizer._momentums[0].numpy(), optimizer._velocities[0].numpy()]
    np.testing.assert_allclose(moments[0][[0, 1, 2]], [[0, 0], [2, -1], [0, 0]])
    np.testing.assert_allclose(moments[1][[0, 1, 2]], [[0, 0], [4, 1], [0, 0]])
    np.testing.assert_allclose(moments[0][3], m)


def test_lazy_adam_refuses_amsgrad():
    with pytest.raises(ValueError, match="amsgrad"):
        LazyAdam(0.1, amsgrad=True)


class MeanOfX(TFRSModel):
    """loss = the batch's mean of "x", plus 0 times a weight (so there is one to train)."""

    def __init__(self):
        super().__init__()
        self.w = tf.Variable(0.0)

    def compute_loss(self, inputs, training=False):
        return tf.reduce_mean(inputs["x"]) + 0.0 * self.w


def test_fit_and_evaluate_report_the_mean_loss_over_every_row(tmp_path):
    """Training batches [1, 1] and [4]: the rows' mean is 2, where TFRS's own steps report the
    last batch's 4 (and an unweighted mean of the batches would be 2.5). Validation batches
    [3, 5] and [3]: 11 / 3, with nothing of the training rows in it."""
    rows = tf.data.Dataset.from_tensor_slices({"x": [1.0, 1.0, 4.0]}).batch(2)
    validation = tf.data.Dataset.from_tensor_slices({"x": [3.0, 5.0, 3.0]}).batch(2)
    model = MeanOfX()
    model.compile(tf.keras.optimizers.SGD(0.0))
    batches = []                               # what a progress bar shows: the mean so far
    record = tf.keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batches.append(float(logs["loss"])))
    history = model.fit(rows, epochs=2, validation_data=validation, verbose=0,
                        callbacks=[record]).history
    assert batches == [1.0, 2.0, 1.0, 2.0]                     # reset every epoch
    for name, mean in (("loss", 2.0), ("total_loss", 2.0), ("val_loss", 11 / 3),
                       ("val_total_loss", 11 / 3)):
        assert history[name] == pytest.approx([mean, mean], abs=1e-6), (name, history[name])
    assert model.evaluate(validation, verbose=0, return_dict=True)["loss"] == \
        pytest.approx(11 / 3, abs=1e-6)
    checkpoint = tf.train.Checkpoint(model=model).write(str(tmp_path / "weights"))
    names = [name for name, _ in tf.train.list_variables(checkpoint)]
    assert not [name for name in names if "tracker" in name or "total" in name], names


class TinyFloat16Gradient(TFRSModel):
    """loss = 1e-4 * float16(w) * 1e-4: its gradient, 1e-8, is below float16's smallest
    number unless the loss is scaled before the float16 part of the backward pass."""

    def __init__(self):
        super().__init__()
        self.w = tf.Variable(0.0)

    def compute_loss(self, inputs, training=False):
        small = tf.cast(self.w, tf.float16) * tf.constant(1e-4, tf.float16)
        return 1e-4 * tf.cast(small, tf.float32) + 0.0 * tf.reduce_sum(inputs["x"])


def test_mixed_precision_steps_scale_the_loss():
    """Under a `LossScaleOptimizer` the step scales the loss (2^15 at first) and unscales the
    gradients: w moves by lr * 1e-8; TFRS's own step leaves it at 0."""
    model = TinyFloat16Gradient()
    model.compile(tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(1.0)))
    model.fit(tf.data.Dataset.from_tensor_slices({"x": [0.0]}).batch(1), epochs=1, verbose=0)
    assert float(model.w.numpy()) == pytest.approx(-1e-8, rel=1e-2)


class SummedFloat16(TFRSModel):
    """loss = the sum over the batch's rows of 0.01 * float16(table[item] * w): its float16
    gradients grow with the batch, as retrieval's summed loss's do."""
    summed_loss = True

    def __init__(self):
        super().__init__()
        self.table = tf.keras.layers.Embedding(10, 4, embeddings_initializer="ones")
        self.w = tf.Variable(1.0)

    def compute_loss(self, inputs, training=False):
        rows = tf.cast(self.table(inputs["item"]), tf.float16) * tf.cast(self.w, tf.float16)
        return 0.01 * tf.reduce_sum(tf.cast(rows, tf.float32))


def test_a_summed_loss_is_scaled_as_a_mean_and_takes_its_own_gradients():
    """A batch of 2048 rows: scaled by 2^15 as a sum, the float16 gradient of w (0.04 * 2048)
    overflows and the step is skipped. Scaled as a mean it does not, and the optimizer takes
    the summed loss's gradients, dense and sparse: w moves by 0.04 * 2048, and each table row
    by 0.01 * w for each of its rows (205 or 204)."""
    items = np.arange(2048) % 10
    model = SummedFloat16()
    model.compile(tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(1.0)))
    model.fit(tf.data.Dataset.from_tensor_slices({"item": items}).batch(2048), epochs=1,
              verbose=0)
    assert float(model.optimizer.loss_scale.numpy()) == 2.0 ** 15            # not skipped
    assert float(model.w.numpy()) == pytest.approx(1.0 - 0.04 * 2048, rel=1e-3)
    counts = np.bincount(items)
    np.testing.assert_allclose(model.table.embeddings.numpy(),
                               np.repeat(1.0 - 0.01 * counts, 4).reshape(10, 4), rtol=1e-3)


class EmbeddingLoss(TFRSModel):
    """A regularized embedding table and a dense layer: sparse and dense gradients."""

    def __init__(self):
        super().__init__()
        self.table = tf.keras.layers.Embedding(10, 4, embeddings_initializer="ones")
        self.dense = tf.keras.layers.Dense(1, kernel_initializer="ones",
                                           kernel_regularizer=tf.keras.regularizers.l2(0.1))

    def compute_loss(self, inputs, training=False):
        return tf.reduce_mean(tf.square(self.dense(self.table(inputs["item"])) - 3.0))


def test_without_loss_scaling_the_step_is_tfrs_own():
    """float32 training through `optimizer.minimize` ends with the same weights, bit for bit,
    as `tfrs.Model.train_step` (LazyAdam: the table's gradients stay sparse)."""
    rows = tf.data.Dataset.from_tensor_slices({"item": [1, 2, 2, 5, 7, 1]}).batch(2)
    weights, losses = [], []
    for step in (TFRSModel.train_step, tfrs.Model.train_step):
        model = EmbeddingLoss()
        model.train_step = step.__get__(model)
        model.compile(LazyAdam(0.1))
        losses.append(model.fit(rows, epochs=2, verbose=0).history["loss"])
        weights.append(model.get_weights())
    assert losses[0] != losses[1]              # each step ran: TFRS's reports the last batch's
    for ours, theirs in zip(*weights):
        np.testing.assert_array_equal(ours, theirs)
    assert not np.array_equal(weights[0][0][1], np.ones(4))           # it trained


def test_a_checkpoint_resumes_only_under_the_config_that_wrote_it(tmp_path):
    """An interrupted training's backup is kept for the same config and removed for another
    (it would resume another model's weights, optimizer and epoch)."""
    from tworec.features.training import run_callbacks
    backup = tmp_path / "checkpoints" / "ranking"
    run_callbacks(str(tmp_path), "ranking", '{"task": "binary"}')
    backup.mkdir(parents=True)                        # training interrupted
    run_callbacks(str(tmp_path), "ranking", '{"task": "binary"}')
    assert backup.is_dir()
    run_callbacks(str(tmp_path), "ranking", '{"task": "listwise"}')
    assert not backup.exists()
    assert (tmp_path / "ranking_config.json").read_text() == '{"task": "listwise"}'
