"""One SavedModel version loaded the way TF Serving loads it.

The MetaGraph tagged `serve` is imported into a `tf.compat.v1.Session` (variables restored, the
init op run), and a request runs one signature by feeding `signature.inputs[name].name` and
fetching `signature.outputs[name].name`. Nothing else of the SavedModel is reachable, exactly as
in TF Serving, so a model that works here works there; and of its signatures only those meant
for serving: `__saved_model_init_op` and other reserved `__` names cannot be called.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow_serving.apis import get_model_metadata_pb2, prediction_log_pb2

from tworec.serving.errors import ServingError, echo, from_tf_error, redact
from tworec.serving.layout import MAX_WARMUP_RECORDS, WARMUP_FILE
from tworec.serving.protocol import DEFAULT_SIGNATURE


@functools.cache
def register_custom_ops() -> bool:
    """Imports ScaNN so its TF ops are registered; returns whether ScaNN is installed."""
    try:
        import scann  # noqa: F401  (the import registers the ops)
    except ImportError:
        return False
    return True


@functools.cache
def settle_native_logs() -> None:
    """Runs a one-op graph in a Session with the native log lines filtered out. A process's
    first Session run writes absl's "before absl::InitializeLog()" banner and an MLIR INFO
    line to file descriptor 2, whatever TF_CPP_MIN_LOG_LEVEL says, and only then; after this
    a server loads and serves with its file descriptor 2 as it is (a crash's lines intact)."""
    from tworec.console import quiet_native_logs
    graph = tf.Graph()
    with graph.as_default():
        value = tf.constant(1.0) + 1.0
    with quiet_native_logs(), tf.compat.v1.Session(graph=graph) as session:
        session.run(value)


def tf_dtype(array: np.ndarray) -> tf.DType:
    """The TF dtype of a NumPy array; str, bytes and object arrays are `tf.string`."""
    return tf.string if array.dtype.kind in "OSU" else tf.as_dtype(array.dtype)


def batch_size(inputs: dict[str, np.ndarray]) -> int | None:
    """Dimension 0 shared by every input; None when an input is a scalar (nothing to batch).

    Raises:
        ServingError: INVALID_ARGUMENT when the inputs disagree on dimension 0.
    """
    sizes = {name: np.shape(value)[0] for name, value in inputs.items() if np.ndim(value)}
    if len(sizes) < len(inputs) or not sizes:
        return None
    if len(set(sizes.values())) > 1:
        detail = ", ".join(f"{name} has {size}" for name, size in sorted(sizes.items()))
        raise ServingError("INVALID_ARGUMENT", "Every input must have the same size in "
                           f"dimension 0 (the batch): {detail}")
    return next(iter(sizes.values()))


def callable_signature(name: str, signature: meta_graph_pb2.SignatureDef) -> bool:
    """Whether requests may call a signature: not a reserved `__` name, and meant for serving."""
    return not name.startswith("__") and bool(signature.method_name)


def dims(shape) -> list[int]:
    """The dimensions of a `TensorShapeProto`, -1 for unknown; [] when the rank is unknown."""
    return [d.size for d in shape.dim]


class LoadedModel:
    """A SavedModel version in its own graph and session; `run` is thread-safe.

    Args:
        path: the version folder (`BASE/VERSION`).
        run_warmup: replays `assets.extra/tf_serving_warmup_requests` when it exists; a
            failing record fails the load.
    """

    def __init__(self, path: str, run_warmup: bool = True):
        register_custom_ops()
        self.path = path
        self.graph = tf.Graph()
        self.session = tf.compat.v1.Session(graph=self.graph)
        try:
            with self.graph.as_default():
                meta = tf.compat.v1.saved_model.loader.load(self.session, ["serve"], path)
            self.signature_defs = dict(meta.signature_def)
            if run_warmup:
                self._warm_up()
        except BaseException:
            self.session.close()
            raise

    def signature_def_map(self) -> get_model_metadata_pb2.SignatureDefMap:
        """The signatures as the `SignatureDefMap` proto that metadata requests return."""
        result = get_model_metadata_pb2.SignatureDefMap()
        for name, signature in self.signature_defs.items():
            result.signature_def[name].CopyFrom(signature)
        return result

    def signature(self, name: str) -> meta_graph_pb2.SignatureDef:
        """The signature `name` ("" means `serving_default`); FAILED_PRECONDITION if absent."""
        name = name or DEFAULT_SIGNATURE
        if name not in self.signature_defs or not callable_signature(
                name, self.signature_defs[name]):
            raise ServingError("FAILED_PRECONDITION",
                               f'Serving signature key "{echo(name)}" not found.')
        return self.signature_defs[name]

    def check_inputs(self, inputs: dict[str, np.ndarray],
                     signature_name: str = "") -> dict[str, np.ndarray]:
        """The inputs as arrays ready to feed; INVALID_ARGUMENT unless names, dtypes, ranks and
        known dimensions match the signature and every input shares dimension 0 (the batch),
        FAILED_PRECONDITION for an unknown signature."""
        return _check_inputs(self.signature(signature_name), inputs)

    def check_input_names(self, names, signature_name: str = "") -> None:
        """INVALID_ARGUMENT unless `names` are the signature's input names, FAILED_PRECONDITION
        for an unknown signature: the cheap part of `check_inputs`, for a request whose inputs
        are costly to convert."""
        _check_names(self.signature(signature_name), names)

    def run(self, inputs: dict[str, np.ndarray], signature_name: str = "",
            output_filter: tuple[str, ...] | list[str] = (),
            timeout_seconds: float | None = None) -> dict[str, np.ndarray]:
        """Runs one signature.

        Args:
            inputs: input name -> array; names, dtypes and shapes must match the signature.
            signature_name: "" means `serving_default`.
            output_filter: the outputs to fetch; empty fetches all of them.
            timeout_seconds: the session run is cancelled after this long (DEADLINE_EXCEEDED),
                as TF Serving bounds a run by the request's deadline; None waits.

        Returns:
            Output name -> array.

        Raises:
            ServingError: INVALID_ARGUMENT for inputs or filters that do not match the
                signature, FAILED_PRECONDITION for an unknown signature, and the TF error code
                of a failing run.
        """
        signature = self.signature(signature_name)
        feeds = {signature.inputs[name].name: value
                 for name, value in self.check_inputs(inputs, signature_name).items()}
        outputs = _check_output_filter(signature, output_filter)
        options = None
        if timeout_seconds is not None:
            if timeout_seconds <= 0:
                raise ServingError("DEADLINE_EXCEEDED", "the request's deadline passed before "
                                   "its model run started")
            options = tf.compat.v1.RunOptions(                     # an int64 of milliseconds
                timeout_in_ms=max(1, int(min(timeout_seconds, 1e15) * 1e3)))
        try:
            values = self.session.run([signature.outputs[n].name for n in outputs], feeds,
                                      options=options)
        except tf.errors.OpError as error:
            raise from_tf_error(error) from error
        except (ValueError, TypeError) as error:  # a feed that cannot convert to its dtype
            raise ServingError("INVALID_ARGUMENT", redact(str(error))) from error
        return dict(zip(outputs, values))

    def close(self) -> None:
        self.session.close()

    def _warm_up(self) -> None:
        path = os.path.join(self.path, WARMUP_FILE)
        if not os.path.exists(path):
            return
        for count, record in enumerate(tf.compat.v1.io.tf_record_iterator(path)):
            if count >= MAX_WARMUP_RECORDS:
                raise ServingError("INVALID_ARGUMENT", f"{WARMUP_FILE} has more than "
                                   f"{MAX_WARMUP_RECORDS} warmup records")
            log = prediction_log_pb2.PredictionLog.FromString(record)
            if log.WhichOneof("log_type") != "predict_log":
                raise ServingError("UNIMPLEMENTED", f"warmup record {count} of {WARMUP_FILE} is a "
                                   f"{log.WhichOneof('log_type')}; only predict logs are served")
            request = log.predict_log.request
            self.run({name: tf.make_ndarray(proto) for name, proto in request.inputs.items()},
                     request.model_spec.signature_name, list(request.output_filter))


def _check_inputs(signature: meta_graph_pb2.SignatureDef,
                  inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inputs checked against the signature (names, dtypes, ranks and known dimensions)."""
    _check_names(signature, inputs)
    checked = {}
    for name, value in inputs.items():
        spec = signature.inputs[name]
        value = np.asarray(value)
        want = tf.as_dtype(spec.dtype)
        if tf_dtype(value) != want:
            raise ServingError("INVALID_ARGUMENT", f'Input "{name}" expects dtype {want.name} '
                               f"but got {tf_dtype(value).name}")
        shape = dims(spec.tensor_shape)
        if not spec.tensor_shape.unknown_rank and (
                len(shape) != value.ndim
                or any(d not in (-1, got) for d, got in zip(shape, value.shape))):
            raise ServingError("INVALID_ARGUMENT", f'Input "{name}" expects shape {shape} '
                               f"but got {list(value.shape)}")
        checked[name] = np.char.encode(value, "utf-8") if value.dtype.kind == "U" else value
    batch_size(checked)
    return checked


def _check_names(signature: meta_graph_pb2.SignatureDef, names) -> None:
    """Refuses input names that are not exactly the signature's, as TF Serving words it."""
    sent, expected = set(names), set(signature.inputs)
    if sent != expected:
        raise ServingError(
            "INVALID_ARGUMENT",
            f"input size does not match signature: {len(sent)}!={len(expected)} "
            f"len({_names(sent)}) != len({_names(expected)}). "
            f"Sent extra: {_names(sent - expected)}. "
            f"Missing but required: {_names(expected - sent)}.")


def _check_output_filter(signature: meta_graph_pb2.SignatureDef,
                         output_filter: tuple[str, ...] | list[str]) -> list[str]:
    """The output names to fetch, in a fixed order; all of them for an empty filter."""
    if not output_filter:
        return sorted(signature.outputs)
    for index, name in enumerate(output_filter):
        if name not in signature.outputs:
            raise ServingError("INVALID_ARGUMENT",
                               f"output tensor alias not found in signature: {name} Outputs "
                               f"expected to be in the set {_names(signature.outputs)}.")
        if name in output_filter[:index]:
            raise ServingError("INVALID_ARGUMENT", f"duplicate output tensor alias: {name}")
    return list(output_filter)


def _names(names) -> str:
    return "{" + ",".join(sorted(names)) + "}"
