"""What both stages' training shares: distribution strategy, optimizer, precision policy, the
run-folder callbacks and the run summary. Each stage's `fit` builds its model and its batches,
then calls `train`."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import tensorflow as tf

OPTIMIZERS = {"adam": tf.keras.optimizers.Adam, "adagrad": tf.keras.optimizers.Adagrad,
              "sgd": tf.keras.optimizers.SGD}


def make_strategy(name: str) -> tf.distribute.Strategy:
    """`default`, `mirrored` (all local devices) or `multi_worker` (reads TF_CONFIG)."""
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multi_worker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "default":
        return tf.distribute.get_strategy()
    raise ValueError(f"unknown strategy {name!r}; use default, mirrored or multi_worker")


def make_optimizer(name: str, learning_rate: float, mixed_precision: bool = False):
    """A Keras optimizer by name, wrapped for loss scaling under mixed precision."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; use one of {sorted(OPTIMIZERS)}")
    optimizer = OPTIMIZERS[name](learning_rate=learning_rate)
    if mixed_precision:
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
    return optimizer


@contextlib.contextmanager
def float32_policy():
    """Builds the layers created inside it in float32 whatever the global Keras policy."""
    previous = tf.keras.mixed_precision.global_policy()
    tf.keras.mixed_precision.set_global_policy("float32")
    try:
        yield
    finally:
        tf.keras.mixed_precision.set_global_policy(previous)


@contextlib.contextmanager
def mixed_precision(enabled: bool):
    """Layers built inside compute in float16 (weights stay float32) when enabled."""
    if not enabled:
        yield
        return
    with float32_policy():
        tf.keras.mixed_precision.set_global_policy("mixed_float16")
        yield


def run_callbacks(run_dir: str | None, stage: str, config_json: str) -> list:
    """Writes RUN/STAGE_config.json and returns the callbacks every stage's training uses in a
    run folder: TensorBoard logs and resumable checkpoints (`BackupAndRestore`)."""
    if not run_dir:
        return []
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"{stage}_config.json"), "w") as f:
        f.write(config_json)
    return [tf.keras.callbacks.TensorBoard(os.path.join(run_dir, "tensorboard", stage)),
            tf.keras.callbacks.BackupAndRestore(os.path.join(run_dir, "checkpoints", stage))]


class EpochLog(tf.keras.callbacks.Callback):
    """One labelled line per epoch, for output that is not a terminal:
    `[retrieval] epoch 3/8: loss 3.2104, val_recall@10 0.5120 (12.1 s)`."""

    def __init__(self, stage: str, epochs: int):
        super().__init__()
        self.stage, self.epochs = stage, epochs

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        shown = ", ".join(f"{name} {value:.4f}" for name, value in (logs or {}).items()
                          if "regularization" not in name)
        print(f"[{self.stage}] epoch {epoch + 1}/{self.epochs}: {shown} "
              f"({time.perf_counter() - self.start:.1f} s)", flush=True)


def best_epoch(callbacks: list, epochs: int, stage: str, verbose: int) -> int:
    """The epoch (1-based) whose weights the model ends with: early stopping's best when it
    stopped the run (announced when verbose), else the last."""
    for callback in callbacks:
        if isinstance(callback, tf.keras.callbacks.EarlyStopping) and callback.stopped_epoch:
            best = callback.best_epoch + 1
            if verbose:
                stopped = callback.stopped_epoch + 1
                why = (f"early stopping after epoch {stopped}: no {callback.monitor} gain for "
                       f"{callback.patience} epochs" if stopped < epochs else
                       f"no {callback.monitor} gain in the last {callback.patience} epochs")
                print(f"[{stage}] {why}; the weights of epoch {best} ({callback.monitor} "
                      f"{callback.best:.4f}) are kept", flush=True)
            return best
    return epochs


def train(model: tf.keras.Model, dataset: tf.data.Dataset, *, stage: str, config,
          steps_per_epoch: int, examples_per_epoch: int, callbacks: list = (),
          validation: tf.data.Dataset | None = None, run_dir: str | None = None,
          verbose: int = 1) -> dict:
    """Runs `model.fit` for `config.epochs` and returns the run summary, also written to
    RUN/STAGE_train.json: per-epoch logs (`history`), `seconds`, `epochs`, `best_epoch` and
    `examples_per_second`. With `verbose`, a terminal gets Keras's progress bar and any other
    output one line per epoch."""
    callbacks = list(callbacks) + run_callbacks(run_dir, stage, config.to_json())
    keras_verbose = verbose
    if verbose and not sys.stdout.isatty():
        callbacks.append(EpochLog(stage, config.epochs))
        keras_verbose = 0
    start = time.perf_counter()
    history = model.fit(dataset, epochs=config.epochs, steps_per_epoch=steps_per_epoch,
                        validation_data=validation, callbacks=callbacks, verbose=keras_verbose)
    seconds = time.perf_counter() - start
    epochs = len(history.history.get("loss", []))
    summary = {"seconds": seconds, "epochs": epochs,
               "best_epoch": best_epoch(callbacks, config.epochs, stage, verbose),
               "examples_per_second": epochs * examples_per_epoch / max(seconds, 1e-9),
               "history": {k: [float(v) for v in vs] for k, vs in history.history.items()}}
    if run_dir:
        with open(os.path.join(run_dir, f"{stage}_train.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary
