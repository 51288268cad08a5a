"""What both stages' training shares: distribution strategy, optimizer, precision policy, the
run-folder callbacks and the run summary. Each stage's `fit` builds its model and its batches,
then calls `train`.

    python -m tworec.features.training

serves the ps or worker task that TF_CONFIG names, for a chief training with
`strategy="parameter_server"`."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import time
from typing import Callable

import numpy as np
import tensorflow as tf
import tensorflow_recommenders as tfrs

from tworec.console import exit_without_finalizing

LOSSES = ("loss", "regularization_loss", "total_loss")


class TFRSModel(tfrs.Model):
    """`tfrs.Model` with two of its training steps' faults mended; both stages' models build on
    it.

    Losses: `fit` and `evaluate` report `LOSSES` as means over the batches so far. TFRS's own
    steps report the last batch's (tensorflow/recommenders#585): the per-epoch training loss,
    and early stopping on a validation loss, would read one batch. A loss that is a batch mean
    (ranking's) is weighted by the rows, as Keras reports a compiled loss: the mean over the
    rows. A loss summed over the batch (`summed_loss`: retrieval's in-batch softmax, where
    under a synchronous strategy each replica's loss is its rows' share of the global batch's)
    is reported as the mean over the batches of the global batch's sum, the replicas' shares
    added: on any number of replicas the number one device reports for the same batches. The
    trackers are reset by Keras with the other metrics (every epoch, and before `evaluate`)
    and held outside the model's checkpoints and SavedModels.

    Loss scaling: the step goes through `optimizer.minimize` (a summed loss through its
    `compute_gradients` and `apply_gradients`, `_loss_scale_rows`), as Keras's own does, so
    that a `LossScaleOptimizer` (mixed precision) scales the loss and unscales the gradients.
    TFRS's step calls `apply_gradients` on unscaled gradients, which float16 loses below its
    smallest subnormal, about 6e-8.
    """

    summed_loss = False     # `compute_loss` sums over the global batch (class docstring)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        object.__setattr__(self, "loss_trackers",          # not tracked as model state
                           {name: tf.keras.metrics.Mean(name) for name in LOSSES})

    @property
    def metrics(self) -> list:
        return super().metrics + list(self.loss_trackers.values())

    def train_step(self, inputs):
        rows = self._loss_scale_rows(inputs)
        with tf.GradientTape() as tape:
            losses = self._batch_losses(inputs, training=True)
            loss = losses["total_loss"] if rows is None else losses["total_loss"] / rows
        if rows is None:
            self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
        else:                       # the summed loss's own gradients, scaled as a mean's
            gradients = self.optimizer.compute_gradients(loss, self.trainable_variables, tape)
            self.optimizer.apply_gradients([(_times(gradient, rows), variable)
                                            for gradient, variable in gradients])
        return self._logs(inputs, losses)

    def _loss_scale_rows(self, inputs) -> tf.Tensor | None:
        """The replica's rows when a `LossScaleOptimizer` scales a loss summed over them
        (`summed_loss`: a replica's share of the global batch's), else None. Its float16
        gradients grow with the rows, and from the default scale (2^15) they overflowed: each
        such step is skipped and the scale halved, the first 12 to 16 steps at batch 512 to
        4096. `train_step` scales the loss over these rows, as a mean, and multiplies the
        unscaled gradients back: the optimizer takes the summed loss's gradients, while the
        float16 ones keep about a mean's size, whatever the batch and the number of replicas
        (not quite: a table row only one replica's rows touch gets up to the replica count
        times one device's float16 gradient, so a mirrored step can overflow where one device's
        does not; seen with the mean history encoder, a scale of 2048 against 4096)."""
        if not (self.summed_loss
                and isinstance(self.optimizer, tf.keras.mixed_precision.LossScaleOptimizer)):
            return None
        return tf.cast(tf.shape(tf.nest.flatten(inputs)[0])[0], tf.float32)

    def test_step(self, inputs):
        return self._logs(inputs, self._batch_losses(inputs, training=False))

    def _batch_losses(self, inputs, training: bool) -> dict:
        """`LOSSES` of one batch, as `tfrs.Model`'s steps compute them."""
        loss = self.compute_loss(inputs, training=training)
        regularization_loss = tf.reduce_sum([tf.reduce_sum(extra) for extra in self.losses])
        return {"loss": loss, "regularization_loss": regularization_loss,
                "total_loss": loss + regularization_loss}

    def _logs(self, inputs, losses: dict) -> dict:
        """The logs of a step: the other metrics' results, and each of `LOSSES` as its mean so
        far; `inputs` batch first."""
        weight, scale = tf.cast(tf.shape(tf.nest.flatten(inputs)[0])[0], tf.float32), 1.0
        if self.summed_loss:      # each batch once, as the sum of its replicas' shares
            context = tf.distribute.get_replica_context()
            replicas = context.num_replicas_in_sync if context is not None else 1
            weight, scale = 1.0 / replicas, float(replicas)
        logs = {metric.name: metric.result() for metric in super().metrics}
        for name, tracker in self.loss_trackers.items():
            tracker.update_state(losses[name] * scale, sample_weight=weight)
            logs[name] = tracker.result()
        return logs


def _times(gradient, factor: tf.Tensor):
    """A gradient (dense or `tf.IndexedSlices`, or None) times a float32 scalar."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return None if gradient is None else gradient * factor


class LazyAdam(tf.keras.optimizers.Adam):
    """Adam whose sparse gradients (embedding lookups) update only the rows they touch: those
    rows' moments and values, as TF Addons' `LazyAdam` (no longer maintained) did. Keras's
    Adam decays both moments and moves every row of a table at every step, which for a table
    of 1M rows costs memory and time of the whole table (and its two moments) per step; this
    costs them for the batch's rows. It is another algorithm: a row's moments stay as they
    are while the row is out of the batches, and the bias correction counts the global step.
    Dense gradients take Adam's update unchanged, and a sparse gradient over every row equals
    Adam's step exactly. The moments are updated by adding to them, as Adam does, so that
    parameter-server workers updating a row at once both count."""

    def __init__(self, *args, name: str = "LazyAdam", **kwargs):
        super().__init__(*args, name=name, **kwargs)
        if self.amsgrad:
            raise ValueError("LazyAdam does not support amsgrad; use Keras's Adam for it")

    def update_step(self, gradient, variable):
        if not isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable)
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        correction = tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
        epsilon = self.epsilon * (tf.sqrt(1 - tf.pow(beta_2, step)) if self.adaptive_epsilon
                                  else 1.0)
        slot = self._index_dict[self._var_key(variable)]
        m, v = self._momentums[slot], self._velocities[slot]
        rows, values = gradient.indices, gradient.values           # unique rows (deduplicated)
        m_rows, v_rows = tf.gather(m, rows), tf.gather(v, rows)
        m_change = (1 - beta_1) * (values - m_rows)                 # m <- b1 m + (1 - b1) g
        v_change = (1 - beta_2) * (tf.square(values) - v_rows)
        m.scatter_add(tf.IndexedSlices(m_change, rows))
        v.scatter_add(tf.IndexedSlices(v_change, rows))
        m_rows, v_rows = m_rows + m_change, v_rows + v_change
        learning_rate = tf.cast(self.learning_rate, dtype) * correction
        variable.scatter_sub(tf.IndexedSlices(
            learning_rate * m_rows / (tf.sqrt(v_rows) + epsilon), rows))


OPTIMIZERS = {"adam": tf.keras.optimizers.Adam, "lazy_adam": LazyAdam,
              "adagrad": tf.keras.optimizers.Adagrad, "sgd": tf.keras.optimizers.SGD}


def make_strategy(name: str, partitioner: str = "min_size",
                  jit_compile: bool = False) -> tf.distribute.Strategy:
    """`default`, `mirrored` (all local devices), `multi_worker` or `parameter_server` (both
    read TF_CONFIG; the parameter-server strategy splits variables across the ps tasks with
    `variable_partitioner(partitioner, num_ps)`). `jit_compile` (XLA) is refused with
    `mirrored` over several CPU devices, where XLA's step, run on one device, cannot reach the
    other replicas' variables ("Trying to access resource ... located in device CPU:1 from
    device CPU:0", keras-team/keras#19005; one CPU device trains, GPUs are not refused), and
    with `multi_worker` on workers without a GPU, whose XLA has no kernel for the candidates'
    all-gather ("unsupported operations ... on XLA_CPU_JIT: CollectiveGatherV2");
    `RetrievalConfig.validate` refuses it with `parameter_server`."""
    if name == "mirrored":
        strategy = _mirrored_strategy()
        cpus = [d for d in strategy.extended.worker_devices if ":CPU:" in d.upper()]
        if jit_compile and len(cpus) > 1:
            raise ValueError(f"jit_compile with strategy 'mirrored' over {len(cpus)} CPU "
                             "devices: XLA cannot reach the other replicas' variables; use "
                             "jit_compile on one device, or strategy 'mirrored' without it")
        return strategy
    if name == "multi_worker":
        if jit_compile and not tf.config.list_physical_devices("GPU"):
            raise ValueError("jit_compile with strategy 'multi_worker' on workers without a "
                             "GPU: XLA on CPUs cannot compile the all-gather of the workers' "
                             "candidates; use strategy 'multi_worker' without it")
        return tf.distribute.MultiWorkerMirroredStrategy()
    if name == "parameter_server":
        os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")   # a lost task fails its RPCs
        resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
        num_ps = len(resolver.cluster_spec().as_dict().get("ps", []))
        if resolver.task_type != "chief" or not num_ps:
            raise ValueError("strategy 'parameter_server' runs on the chief of a TF_CONFIG "
                             "cluster with ps tasks; ps and worker tasks run "
                             "`python -m tworec.features.training` instead")
        return tf.distribute.ParameterServerStrategy(
            resolver, variable_partitioner=variable_partitioner(partitioner, num_ps))
    if name == "default":
        return tf.distribute.get_strategy()
    raise ValueError(f"unknown strategy {name!r}; use default, mirrored, multi_worker or "
                     "parameter_server")


@functools.cache
def _mirrored_strategy() -> tf.distribute.MirroredStrategy:
    """One MirroredStrategy a process: each new one numbers its collectives from the start
    again, and a second model of another shape in the same process would then meet the first
    one's collective instances ("Shape mismatch in the collective instance 100")."""
    return tf.distribute.MirroredStrategy()


def variable_partitioner(spec: str, num_ps: int):
    """How the parameter-server strategy splits a variable along its first axis:
    `min_size` (shards of at least 256 KiB, at most one per ps: large embedding tables are
    split, small dense layers are not), `min_size:BYTES` (another minimum) or `fixed:N` (every
    variable with at least N rows in N shards)."""
    kind, _, value = spec.partition(":")
    partitioners = tf.distribute.experimental.partitioners
    if kind == "min_size" and (not value or value.isdigit() and int(value) > 0):
        return partitioners.MinSizePartitioner(min_shard_bytes=int(value or 256 << 10),
                                               max_shards=num_ps)
    if kind == "fixed" and value.isdigit() and int(value) > 0:
        return partitioners.FixedShardsPartitioner(int(value))
    raise ValueError(f"partitioner {spec!r}: use min_size, min_size:BYTES or fixed:N")


def worker_seed() -> tf.Tensor:
    """A scalar int64 seed drawn when the op runs, so different on every worker that runs the
    same function (seed and seed2 0 ask the kernel for a random seed; `tf.random.uniform`
    would derive the same op seed on every worker from the global seed)."""
    low, high = tf.constant(0, tf.int64), tf.constant(2**62, tf.int64)
    return tf.raw_ops.RandomUniformInt(shape=tf.constant([], tf.int32), minval=low, maxval=high,
                                       seed=0, seed2=0)


def serve_task() -> None:
    """Runs this process's ps or worker task of the TF_CONFIG cluster until Ctrl-C (exit 130)
    or SIGTERM; the chief's training program sends them its variables and steps."""
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type not in ("ps", "worker"):
        raise SystemExit(f"TF_CONFIG task type {resolver.task_type!r}: this entry point serves "
                         "ps and worker tasks; the chief runs the training command")
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id,
                                  protocol=resolver.rpc_layer or "grpc", start=True)
    try:                   # from the line on: Ctrl-C may come as soon as it is read
        print(f"serving /job:{resolver.task_type}/task:{resolver.task_id} at {server.target}",
              flush=True)
        while True:        # not server.join(): Ctrl-C raises only while the main thread runs Python
            time.sleep(0.5)
    except KeyboardInterrupt:
        exit_without_finalizing(130)     # the server's C++ threads are never joined


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


class Float32Twin:
    """What a model trained under mixed precision is validated, evaluated, exported and
    served as: a twin built under the float32 policy holding its weights (float32 already).
    Float16 layers round differently run eagerly, as the evaluation runs them, and traced into
    the graph of a SavedModel (a ranker's scores by up to 1e-3); float32 layers give the same
    answer both ways, so mixed precision stays a setting of training's speed alone.

    Called with the trained model, it returns the twin holding the model's weights as they
    are then (the model itself when it computes in float32). The twin is built on the first
    call: by `build` under the float32 policy, its weights created by the loss of one batch
    of `dataset` (the training batches), as training created the model's."""

    def __init__(self, build: Callable[[], TFRSModel], dataset: tf.data.Dataset):
        self.build, self.dataset, self.twin = build, dataset, None

    def __call__(self, model: TFRSModel) -> TFRSModel:
        if model.compute_dtype == "float32":
            return model
        if self.twin is None:
            with float32_policy():
                twin = self.build()
            twin.compute_loss(next(iter(self.dataset)))
            self.twin = twin
        self.twin.set_weights(model.get_weights())
        return self.twin


class Float32Validation(tf.keras.callbacks.Callback):
    """Keras's validation, by the model's float32 twin (`Float32Twin`), for a model trained
    under mixed precision: after every epoch, `val_NAME` for each of `evaluate`'s logs on
    `validation`, before the callbacks after it (early stopping) read them. (TensorBoard then
    logs the epoch's `val_` values, not Keras's per-evaluation series.)"""

    def __init__(self, validation: tf.data.Dataset, float32: Float32Twin):
        super().__init__()
        self.validation, self.float32 = validation, float32

    def on_epoch_end(self, epoch, logs=None):
        results = self.float32(self.model).evaluate(self.validation, verbose=0, return_dict=True)
        logs.update({f"val_{name}": value for name, value in results.items()})


def run_callbacks(run_dir: str | None, stage: str, config_json: str,
                  early_stopping: list = ()) -> list:
    """Writes RUN/STAGE_config.json and returns the callbacks every stage's training uses in a
    run folder: TensorBoard logs and resumable checkpoints (`ResumableTraining`, carrying the
    state of `early_stopping`). An interrupted training's checkpoint resumes only under the
    config that wrote it: one left by another config (the folder's STAGE_config.json differs)
    is removed first."""
    if not run_dir:
        return []
    os.makedirs(run_dir, exist_ok=True)
    written, backup = (os.path.join(run_dir, f"{stage}_config.json"),
                       os.path.join(run_dir, "checkpoints", stage))
    if os.path.isdir(backup) and os.path.exists(written):
        with open(written) as f:
            if f.read() != config_json:
                shutil.rmtree(backup, ignore_errors=True)   # workers may race
    with open(written, "w") as f:
        f.write(config_json)
    return [tf.keras.callbacks.TensorBoard(os.path.join(run_dir, "tensorboard", stage)),
            ResumableTraining(backup, early_stopping)]


class ResumableTraining(tf.keras.callbacks.BackupAndRestore):
    """Keras's `BackupAndRestore`, which checkpoints the weights, the optimizer and the epoch
    after every epoch and restores them when the training is run again, and also what it
    leaves out, so that a resumed training ends where the uninterrupted one would: the logs
    of every epoch (`history`), the seconds of those an earlier process ran
    (`seconds_before`), and each `EarlyStopping`'s state (its best value, epoch and weights,
    its wait). `train` starts the batches where those epochs left
    them (`finished_epochs`).

    That state is written to BACKUP/state before each checkpoint, a file per epoch, so the
    checkpoint's epoch always has its state, whenever the training stops; a state written
    after the checkpoint's epoch (stopped before its checkpoint) is removed when training
    resumes. The last epoch, where early stopping or the epoch count ends the training, is not
    checkpointed: stopped after it, the training resumes before it and repeats it, where a
    checkpoint would resume into epochs the training never runs. Place it after the
    `EarlyStopping` callbacks it carries: it reads their state once they have updated it."""

    EPOCH_KEY = "ckpt_saved_epoch/.ATTRIBUTES/VARIABLE_VALUE"   # WorkerTrainingState's

    def __init__(self, backup_dir: str, early_stopping: list = ()):
        super().__init__(backup_dir)
        self.early_stopping = list(early_stopping)
        self.state_dir = os.path.join(backup_dir, "state")
        self.history, self.seconds_before = {}, 0.0
        self.started = None          # when `train` began setting up (else when `fit` begins)

    def finished_epochs(self) -> int:
        """Epochs the checkpoint in the backup folder holds; 0 when there is none.

        Raises:
            ValueError: the checkpoint has no state (an older tworec wrote it).
        """
        latest = tf.train.latest_checkpoint(os.path.join(self.backup_dir, "chief"))
        if latest is None:
            return 0
        done = int(tf.train.load_checkpoint(latest).get_tensor(self.EPOCH_KEY)) + 1
        if not os.path.exists(self.state_file(done)):
            raise ValueError(f"{self.backup_dir} holds a checkpoint without the state resuming "
                             "needs (an older tworec wrote it); remove it to start over")
        return done

    def state_file(self, epochs: int) -> str:
        """BACKUP/state/after_epoch_N.json: the state after `epochs` epochs."""
        return os.path.join(self.state_dir, f"after_epoch_{epochs}.json")

    def files_of(self, epochs: int) -> set[str]:
        """The names of the files the state after `epochs` epochs holds (its JSON and the
        best weights it names); none when it was not written."""
        if not os.path.exists(self.state_file(epochs)):
            return set()
        with open(self.state_file(epochs)) as f:
            weights = {saved["best_weights"] for saved in json.load(f)["early_stopping"]}
        return {os.path.basename(self.state_file(epochs))} | (weights - {None})

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)               # restores weights, optimizer and epoch
        self.start = self.started or time.perf_counter()
        done = self.finished_epochs()
        state = {"history": {}, "seconds": 0.0, "early_stopping": []}
        if done:
            with open(self.state_file(done)) as f:
                state = json.load(f)
        self.keep_only(done)                       # not a lost epoch's state
        self.history, self.seconds_before = state["history"], state["seconds"]
        for callback, saved in zip(self.early_stopping, state["early_stopping"]):
            callback.wait, callback.best, callback.best_epoch = (
                saved["wait"], saved["best"], saved["best_epoch"])
            if saved["best_weights"]:
                with np.load(os.path.join(self.state_dir, saved["best_weights"])) as weights:
                    callback.best_weights = [weights[f"arr_{i}"] for i in range(len(weights))]

    def on_epoch_end(self, epoch, logs=None):
        for name, value in (logs or {}).items():
            self.history.setdefault(name, []).append(float(value))
        if self.model.stop_training or epoch + 1 >= self.params["epochs"]:
            return                                  # the last epoch (class docstring)
        if self.model.distribute_strategy.extended.should_checkpoint:
            self.write_state(epoch + 1)
        super().on_epoch_end(epoch, logs)           # the checkpoint, once its state is written

    def write_state(self, epochs: int) -> None:
        """Writes the state after `epochs` epochs, and removes all but the previous epoch's
        (the checkpoint's until the new one is written)."""
        os.makedirs(self.state_dir, exist_ok=True)
        saved = []
        for i, callback in enumerate(self.early_stopping):
            best_weights = None
            if callback.best_weights is not None:
                best_weights = f"best_weights_{i}_epoch_{callback.best_epoch + 1}.npz"
                path = os.path.join(self.state_dir, best_weights)
                if not os.path.exists(path):         # else written at that best epoch
                    np.savez(path + ".tmp.npz", *callback.best_weights)
                    os.replace(path + ".tmp.npz", path)
            saved.append({"wait": callback.wait, "best": float(callback.best),
                          "best_epoch": callback.best_epoch, "best_weights": best_weights})
        state = {"history": self.history, "early_stopping": saved,
                 "seconds": self.seconds_before + time.perf_counter() - self.start}
        with open(self.state_file(epochs) + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(self.state_file(epochs) + ".tmp", self.state_file(epochs))
        self.keep_only(epochs, epochs - 1)

    def keep_only(self, *epochs: int) -> None:
        """Removes, on the chief, every state file but those of the states after `epochs`."""
        if not (self.model.distribute_strategy.extended.should_checkpoint
                and os.path.isdir(self.state_dir)):
            return
        kept = set().union(*(self.files_of(n) for n in epochs))
        for name in set(os.listdir(self.state_dir)) - kept:
            os.remove(os.path.join(self.state_dir, name))

    def on_train_end(self, logs=None):
        super().on_train_end(logs)                  # removes the checkpoint
        if self.model.distribute_strategy.extended.should_checkpoint:
            shutil.rmtree(self.state_dir, ignore_errors=True)


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
    """The epoch (1-based) whose weights the model ends with: with an `EarlyStopping` that
    restores the best weights, its best epoch (Keras restores them when training ends,
    stopped early or not; announced when verbose and not the last), else the last."""
    for callback in callbacks:
        if not (isinstance(callback, tf.keras.callbacks.EarlyStopping)
                and callback.restore_best_weights and callback.best_weights is not None):
            continue
        best, stopped = callback.best_epoch + 1, callback.stopped_epoch + 1
        if callback.stopped_epoch and stopped < epochs:
            why = (f"early stopping after epoch {stopped}: no {callback.monitor} gain for "
                   f"{callback.patience} epochs")
        elif best < epochs:
            why = f"no {callback.monitor} gain after epoch {best}"
        else:
            return best
        if verbose:
            print(f"[{stage}] {why}; the weights of epoch {best} ({callback.monitor} "
                  f"{callback.best:.4f}) are kept", flush=True)
        return best
    return epochs


def create_variables(model: TFRSModel, dataset: tf.data.Dataset) -> None:
    """Creates the model's and its optimizer's variables before `fit`, from the loss of
    `dataset`'s first batch run eagerly (metrics it updates are reset by `fit` at every epoch;
    the models' losses run no random op, and Keras's initializers draw their seeds in Python,
    in the order the layers are built, eagerly or traced). Otherwise they are created in `fit`'s
    first trace of the training step, and `tf.function` traces a function that creates
    variables twice: the second trace of a tiny two-tower model's step took 2 s of its 6 s
    `fit` on a CPU, 5 s of 15 s under `MirroredStrategy` over two CPU devices. Under that
    strategy and `MultiWorkerMirroredStrategy` the loss runs in the replicas (`strategy.run`,
    on `dataset`'s first batch, distributed as `fit` distributes it); other strategies (the
    parameter-server one, for example) leave them to `fit`, and so does a call made inside a
    strategy's scope, which returns at once."""
    default, strategy = tf.distribute.get_strategy(), model.distribute_strategy
    if tf.distribute.has_strategy():
        return
    if strategy is default:
        model.compute_loss(next(iter(dataset)))
    elif isinstance(strategy, (tf.distribute.MirroredStrategy,
                               tf.distribute.MultiWorkerMirroredStrategy)):
        with strategy.scope():
            batch = next(iter(strategy.experimental_distribute_dataset(dataset.take(1))))
            strategy.run(model.compute_loss, args=(batch,))
    else:
        return
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)


def train(model: tf.keras.Model, dataset: tf.data.Dataset, *, stage: str, config,
          steps_per_epoch: int, examples_per_epoch: int, callbacks: list = (),
          validation: tf.data.Dataset | None = None, run_dir: str | None = None,
          verbose: int = 1) -> dict:
    """Runs `model.fit` for `config.epochs` and returns the run summary, also written to
    RUN/STAGE_train.json: per-epoch logs (`history`), `seconds`, `epochs`, `best_epoch` and
    `examples_per_second`. In a run folder, an interrupted training resumes after its last
    finished epoch, on the batches the uninterrupted one would have read next (`dataset` is
    endless and depends only on its position, as `features.batches`'s are), and its summary
    counts every epoch. `validation`, when given, is Keras's `validation_data` (its `val_`
    logs after every epoch). With `verbose`, a terminal gets Keras's progress bar and any other
    output (and the parameter-server strategy, where Keras has no progress bar) one line per
    epoch."""
    early_stopping = [c for c in callbacks if isinstance(c, tf.keras.callbacks.EarlyStopping)]
    callbacks = list(callbacks) + run_callbacks(run_dir, stage, config.to_json(), early_stopping)
    resumable = next((c for c in callbacks if isinstance(c, ResumableTraining)), None)
    start = time.perf_counter()                # setting up counts, as it did inside `fit`
    if resumable:
        resumable.started = start                  # in every process of a resumed training
    if isinstance(dataset, tf.data.Dataset):
        create_variables(model, dataset)
    if resumable and isinstance(dataset, tf.data.Dataset):
        dataset = dataset.skip(resumable.finished_epochs() * steps_per_epoch)
    keras_verbose = verbose
    coordinated = isinstance(model.distribute_strategy, tf.distribute.ParameterServerStrategy)
    if verbose and (coordinated or not sys.stdout.isatty()):
        callbacks.append(EpochLog(stage, config.epochs))
        keras_verbose = 0
    history = model.fit(dataset, epochs=config.epochs, steps_per_epoch=steps_per_epoch,
                        validation_data=validation, callbacks=callbacks, verbose=keras_verbose)
    seconds = (resumable.seconds_before if resumable else 0.0) + time.perf_counter() - start
    logs = resumable.history if resumable else {
        name: [float(v) for v in values] for name, values in history.history.items()}
    epochs = len(logs.get("loss", []))
    summary = {"seconds": seconds, "epochs": epochs,
               "best_epoch": best_epoch(callbacks, config.epochs, stage, verbose),
               "examples_per_second": epochs * examples_per_epoch / max(seconds, 1e-9),
               "history": logs}
    if run_dir:
        with open(os.path.join(run_dir, f"{stage}_train.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    serve_task()
