"""Keras and TF building blocks over the model inputs both stages share: item features, the
string-id lookups and the per-user inputs an export bakes in."""
from __future__ import annotations

import contextlib
import json
import os
import threading

import numpy as np
import tensorflow as tf

from tworec.features.vocab import OOV

YEAR_BUCKETS = 32          # 0 unknown, then five-year buckets from 1900


def year_bucket(year: tf.Tensor) -> tf.Tensor:
    """[...] int32 year -> [...] int32 bucket in [0, YEAR_BUCKETS)."""
    bucket = tf.clip_by_value((year - 1900) // 5 + 1, 1, YEAR_BUCKETS - 1)
    return tf.where(year > 0, bucket, 0)


class ItemFeatures(tf.keras.layers.Layer):
    """Catalogue codes -> concatenated item id embedding, year embedding and projected genres.

    Call: codes [...] int64 -> [..., dim + 8 + 16]: the genres dropped when the log has none,
    only the id embedding [..., dim] without `use_features`. A code of -1 (an id outside the
    catalogue, as `id_lookup` answers it) reads as an item without training rows and without
    features: the out-of-vocabulary id row, no year, no genres.
    The id embedding is public (`id_embedding`) so a history encoder can share it.
    """

    def __init__(self, item_index: np.ndarray, item_vocab_size: int, item_genres: np.ndarray,
                 item_year: np.ndarray, dim: int, use_features: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.item_index = tf.constant(item_index, tf.int64)                  # [num_items]
        self.item_genres = tf.constant(item_genres, tf.float32)              # [num_items, g]
        self.item_year = tf.constant(item_year, tf.int32)                    # [num_items]
        self.id_embedding = tf.keras.layers.Embedding(item_vocab_size, dim)
        # only the layers `call` uses: an export tracks a model with a never-called layer whole
        self.year_embedding = tf.keras.layers.Embedding(YEAR_BUCKETS, 8) if use_features else None
        self.genre_projection = (tf.keras.layers.Dense(16)
                                 if use_features and item_genres.shape[1] else None)

    def call(self, codes: tf.Tensor) -> tf.Tensor:
        known = codes >= 0
        codes = tf.maximum(codes, 0)
        index = tf.where(known, tf.gather(self.item_index, codes), tf.constant(OOV, tf.int64))
        parts = [self.id_embedding(index)]
        if self.year_embedding is not None:
            year = tf.where(known, tf.gather(self.item_year, codes), 0)             # 0: no year
            parts.append(self.year_embedding(year_bucket(year)))
        if self.genre_projection is not None:
            genres = tf.gather(self.item_genres, codes) * tf.cast(known, tf.float32)[..., None]
            parts.append(tf.cast(self.genre_projection(genres), parts[0].dtype))
        return tf.concat(parts, axis=-1)


def id_lookup(ids: np.ndarray) -> tf.lookup.StaticHashTable:
    """A table from string id to its int64 position in `ids` ([d] str), -1 when absent."""
    return tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(tf.constant(ids), tf.range(len(ids), dtype=tf.int64)),
        default_value=-1)


def hold_model(module: tf.Module, model: tf.keras.Model) -> None:
    """Sets `module.model` for the module's functions to call, tracking only the model's
    weights: a tracked Keras model would have `tf.saved_model.save` trace every layer for Keras
    metadata and save its optimizer's slots and metrics' totals, which no servable uses. A model
    with a layer never called (an untrained model: the signatures' tracing may create its
    weights) is tracked whole; that is why models create only the layers they call. A Keras
    model inside the model (an ensemble's member, a `Sequential` head) is not checked itself,
    its layers are: a member whose methods alone are called is never marked built."""
    layers = [layer for layer in model.submodules if isinstance(layer, tf.keras.layers.Layer)
              and not isinstance(layer, (tf.keras.metrics.Metric, tf.keras.Model))]
    if not all(layer.built for layer in layers):
        module.model = model
        return
    object.__setattr__(module, "model", model)             # not tracked by the module
    module.model_variables = model_variables(model)


def model_variables(model: tf.keras.Model) -> list:
    """The model's weights as its layers hold them (a sharded table as its `ShardedVariable`,
    which a SavedModel saves whole), without its optimizer's or metrics' variables."""
    weights = {id(v) for v in model.variables}                   # a sharded table's shards
    held = []
    for node in tf.train.TrackableView(model).descendants():
        sharded = any(cls.__name__ == "ShardedVariable" for cls in type(node).__mro__)
        parts = node.variables if sharded else [node]
        if all(id(part) in weights for part in parts):
            held.append(node)
    return held


class UserInputs(tf.Module):
    """String user ids -> the model inputs of those users, from the state baked in: each known
    user's latest items and seen items of the rows the models were fit on (`ModelInputs`).

    Call: user_id [b] string (and optionally history [b, L] vocabulary indexes to use instead
    of the baked-in one) -> ({"user": [b], "history": [b, L], "user_NAME": [b]}, known [b] bool).
    Users without fit rows are unknown: the out-of-vocabulary index and an empty history.
    """

    def __init__(self, inputs):
        super().__init__()
        interactions = inputs.interactions
        known_users = np.flatnonzero(inputs.known)
        self.user_positions = id_lookup(interactions.user_ids[known_users])
        self.known_codes = tf.constant(known_users, tf.int64)                         # [K]
        self.user_index = tf.constant(inputs.users.remap(interactions.user_ids))       # [U]
        self.latest = tf.constant(inputs.latest)                                       # [U, L]
        self.seen_starts = tf.constant(inputs.seen.indptr, tf.int64)                   # [U + 1]
        self.seen_items = tf.constant(inputs.seen.indices, tf.int64)                   # [nnz]
        self.features = {name: tf.constant(index) for name, index in inputs.user_feature_index.items()}

    def codes(self, user_id: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """user_id [b] string -> (user codes [b] int64, 0 for unknown users; known [b] bool)."""
        positions = self.user_positions.lookup(user_id)                                 # [b]
        known = positions >= 0
        return tf.gather(self.known_codes, tf.maximum(positions, 0)) * tf.cast(known, tf.int64), known

    def seen(self, codes: tf.Tensor, known: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The seen items of users [b] (`codes` and `known` as `UserInputs.codes` returns them):
        (batch row [n] int64, item code [n] int64) pairs, none for an unknown user."""
        starts = tf.gather(self.seen_starts, codes)                                     # [b]
        ends = tf.where(known, tf.gather(self.seen_starts, codes + 1), starts)          # [b]
        positions = tf.ragged.range(starts, ends)                                       # [b, None]
        return positions.value_rowids(), tf.gather(self.seen_items, positions.flat_values)

    def __call__(self, user_id: tf.Tensor, history: tf.Tensor | None = None):
        codes, known = self.codes(user_id)
        oov = tf.constant(1, tf.int64)
        if history is None:
            history = tf.gather(self.latest, codes) * tf.cast(known, tf.int64)[:, None]
        features = {"user": tf.where(known, tf.gather(self.user_index, codes), oov),
                    "history": history}
        for name, table in self.features.items():
            features[f"user_{name}"] = tf.where(known, tf.gather(table, codes), oov)
        return features, known


STATE_FILE = os.path.join("assets.extra", "state.json")


def in_row_blocks(block, num_rows: tf.Tensor, block_rows: tf.Tensor | int,
                  specs: tuple[tf.TensorSpec, ...]) -> tuple[tf.Tensor, ...]:
    """`block(start, end)` -> tensors [end - start, ...] as `specs` give them (dimension 0
    None), for consecutive blocks of at most `block_rows` of `num_rows` rows in a While loop
    (stock ops), each concatenated over the blocks: an export's intermediates then take a
    block's memory, however many rows a request has. A caller whose rows fit one block should
    call `block` alone (`tf.cond`), to run the same ops as without blocks.
    """
    num_rows = tf.cast(num_rows, tf.int32)
    block_rows = tf.maximum(tf.cast(block_rows, tf.int32), 1)
    blocks = tf.maximum((num_rows + block_rows - 1) // block_rows, 1)

    def step(i, parts):
        start = i * block_rows
        outputs = block(start, tf.minimum(start + block_rows, num_rows))
        return i + 1, tuple(part.write(i, output) for part, output in zip(parts, outputs))
    parts = tuple(tf.TensorArray(spec.dtype, size=blocks, infer_shape=False,
                                 element_shape=spec.shape) for spec in specs)
    _, parts = tf.while_loop(lambda i, _: i < blocks, step, (tf.constant(0), parts),
                             parallel_iterations=1)
    outputs = tuple(part.concat() for part in parts)
    for output, spec in zip(outputs, specs):
        output.set_shape(spec.shape)
    return outputs


_tracing_state = threading.local()
_installing = threading.Lock()


@contextlib.contextmanager
def inference_tracing():
    """Traces Keras GRU and LSTM layers, in this thread, for inference alone: each call still
    adds its cuDNN variant (for Grappler to swap in on a GPU) to the graph, but not the
    gradient functions Keras also traces for it (tf_keras' `gru_lstm_utils.function_register`),
    which only a graph that trains uses (1.0 to 1.9 s of a tiny pipeline run's export step),
    and `save_servable` drops them from the SavedModel anyway. Without that private function
    (another tf_keras) nothing changes."""
    try:
        from tf_keras.src.layers.rnn import gru_lstm_utils
    except ImportError:
        gru_lstm_utils = None
    with _installing:
        register = getattr(gru_lstm_utils, "function_register", None)
        if register is not None and not getattr(register, "honours_inference_tracing", False):
            gru_lstm_utils.function_register = _registering_gradients_unless_inference(register)
    previous = getattr(_tracing_state, "active", False)
    _tracing_state.active = True
    try:
        yield
    finally:
        _tracing_state.active = previous


def _registering_gradients_unless_inference(register):
    """`register` (Keras's `function_register`), but inside `inference_tracing` only the
    function itself is added to the graph."""
    def function_register(func, *args, **kwargs):
        if not getattr(_tracing_state, "active", False):
            return register(func, *args, **kwargs)
        concrete = func.get_concrete_function(*args, **kwargs)
        concrete.add_to_graph()
        return concrete
    function_register.honours_inference_tracing = True
    return function_register


def write_state(saved_model_dir: str, inputs) -> None:
    """Writes `assets.extra/state.json` into a SavedModel folder: the rows, users, items and
    last timestamp of the state it bakes in (`ModelInputs.state`), and whether it excludes seen
    items."""
    path = os.path.join(saved_model_dir, STATE_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**inputs.state(), "exclude_seen": inputs.exclude_seen}, f, indent=2)
