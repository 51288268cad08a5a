"""TF Serving's JSON tensor format (`util/json_tensor.cc`): request bodies in, responses out.

Requests come in the row form (`instances`) or the columnar form (`inputs`); dtypes come from the
signature. Responses are `{"predictions": ...}` for a row request and `{"outputs": ...}` for a
columnar one, shaped as TF Serving shapes them.
"""
from __future__ import annotations

import base64
import binascii
import json
import math

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from tworec.serving.errors import MAX_ECHOED, ServingError, truncate
from tworec.serving.limits import MAX_RANK, check_elements, check_shape, default_max_elements

# A predict answer is encoded at most this many elements at a time (see `format_predict`).
_PIECE_ELEMENTS = 1 << 16
# The non-string dtypes TF Serving writes as JSON (`AddSingleValueAndAdvance`); others (half,
# bfloat16, uint16, complex, ...) are refused.
_JSON_DTYPES = {np.dtype(t) for t in (np.float32, np.float64, np.int8, np.int16, np.int32,
                                      np.int64, np.uint8, np.uint32, np.uint64, np.bool_)}


def parse_json(body: bytes):
    """The JSON value of a request body; INVALID_ARGUMENT when it does not parse.

    As TF Serving's parser (RapidJSON), it accepts NaN and Infinity, reads an integer beyond
    64 bits as a double, and refuses a number beyond the range of a double (1e400), which
    Python would read as infinity. A float or double input then takes any number, as TF
    Serving does since 2.5 (its commit 57dac6cd): a double, rounded to float32 for a float
    (an integer of more than 24 bits loses its last digits, beyond float32's range is
    infinite, as C's cast makes it). A key given twice keeps its first value, as RapidJSON's
    `FindMember` finds it in the request object and in `inputs`, and the body must be UTF-8,
    a byte-order mark skipped as RapidJSON's input stream skips it (Python would also read
    UTF-16 and 32).
    """
    try:
        text = body.decode("utf-8-sig") if isinstance(body, (bytes, bytearray)) else body
        return json.loads(text, parse_float=_double, parse_int=_integer,
                          object_pairs_hook=_first_of_each_key)
    except (ValueError, RecursionError) as error:   # UnicodeDecodeError is a ValueError
        raise ServingError("INVALID_ARGUMENT", f"JSON Parse error: {error}") from error


class _Repeated(dict):
    """A JSON object that gave a key more than once, with each key's first value: taken as the
    request object and as `inputs` (TF Serving's `FindMember`); refused as an instance (TF
    Serving would append both values) and as a b64 value (TF Serving wants its only key)."""


def _first_of_each_key(pairs: list[tuple[str, object]]) -> dict:
    found: dict = {}
    for key, value in pairs:
        found.setdefault(key, value)
    return found if len(found) == len(pairs) else _Repeated(found)


def _integer(text: str) -> int | float:
    """A JSON integer as RapidJSON keeps it: an integer within 64 bits, else a double."""
    if len(text) <= 20:
        value = int(text)
        if -2 ** 63 <= value < 2 ** 64:
            return value
    return _double(text)


def _double(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ServingError("INVALID_ARGUMENT", "JSON Parse error: Number too big to be stored "
                           f"in double: {text[:40]}")
    return value


def parse_predict(body, signature: meta_graph_pb2.SignatureDef, max_rows: int,
                  max_elements: int | None = None) -> tuple[dict[str, np.ndarray], bool]:
    """The inputs of a predict body.

    Args:
        body: the parsed JSON body (`instances` or `inputs`, optional `signature_name`).
        signature: the signature the request runs; it gives every input's dtype.
        max_rows: an input with more rows is refused before it is converted.
        max_elements: inputs with more elements together are refused before any is
            converted (None: `limits.default_max_elements`).

    Returns:
        (input name -> array [batch, ...], whether the request used the row form).
    """
    if not isinstance(body, dict):
        raise ServingError("INVALID_ARGUMENT", "Request body must be a JSON object with "
                           "'instances' or 'inputs'")
    if ("instances" in body) == ("inputs" in body):
        raise ServingError("INVALID_ARGUMENT", "Missing 'inputs' or 'instances' key"
                           if "inputs" not in body else "Not formatted correctly expecting only "
                           "one of 'inputs' or 'instances' keys exists")
    if "instances" in body:
        values, row_form = _parse_instances(body["instances"], signature), True
    else:
        values, row_form = _parse_inputs(body["inputs"], signature), False
    shapes = {}
    for name, (value, _) in values.items():
        shapes[name] = _shape_of(value)
        check_shape(name, shapes[name], max_rows)
    check_elements(shapes, default_max_elements() if max_elements is None else max_elements)
    return {name: _to_array(value, spec, name, shapes[name])
            for name, (value, spec) in values.items()}, row_form


_ASCII_SPACE = str.maketrans("", "", " \t\n\v\f\r")         # absl::ascii_isspace


def b64_unescape(text: str) -> bytes:
    """The bytes of base64 `text` as TF Serving reads them (`absl::Base64Unescape`): ASCII
    whitespace skipped (MIME encoders break lines), padding optional but correct when given,
    '.' padding as '='. Raises binascii.Error for anything else."""
    compact = text.translate(_ASCII_SPACE)
    if not compact.isascii():                   # b64decode would raise ValueError, a 500
        raise binascii.Error("characters outside base64's alphabet")
    data = compact.rstrip("=.")
    padding, wanted = len(compact) - len(data), -len(data) % 4
    if padding and padding != wanted:
        raise binascii.Error(f"{padding} padding characters after {len(data)} characters "
                             f"(they pad to a multiple of 4: {wanted})")
    return base64.b64decode(data + "=" * wanted, validate=True)


def signature_name(body) -> str:
    """The body's `signature_name` ("" when absent, meaning `serving_default`)."""
    name = body.get("signature_name", "") if isinstance(body, dict) else ""
    if not isinstance(name, str):
        raise ServingError("INVALID_ARGUMENT", "'signature_name' must be a string")
    return name


def format_predict(outputs: dict[str, np.ndarray], row_form: bool) -> bytes:
    """The JSON response body of a predict: `{"predictions": ...}` (row form) or
    `{"outputs": ...}` (columnar).

    It is written in pieces of at most `_PIECE_ELEMENTS` elements: encoding a piece holds
    Python's GIL, so a thread writing a large answer lets the event loop run between pieces.

    Raises:
        ServingError: INVALID_ARGUMENT for a dtype JSON cannot carry, or (row form) outputs
            whose dimension 0 differ.
    """
    batch = _batch_size(outputs) if row_form else None
    pieces = ['{"predictions": ' if row_form else '{"outputs": ']
    if len(outputs) == 1:
        _write(*next(iter(outputs.items())), pieces)
    elif not row_form:
        _write_object(outputs, pieces)
    else:
        _write_rows(outputs, batch, pieces)
    pieces.append("}")
    data, pieces = bytearray(), pieces[::-1]
    while pieces:                             # each piece freed once encoded: peak ~2x
        data += pieces.pop().encode("utf-8")
    return bytes(data)


def to_json(name: str, value: np.ndarray):
    """An output array as nested lists; strings raw, or `{"b64": ...}` if `name` ends `_bytes`.

    Raises:
        ServingError: INVALID_ARGUMENT for a dtype JSON cannot carry (complex, half, ...).
    """
    value = np.asarray(value)
    if value.dtype.kind not in "OSU":
        if value.dtype not in _JSON_DTYPES:
            raise ServingError("INVALID_ARGUMENT", "Failed to write JSON value for tensor "
                               f"type: {_type_string(value.dtype)}")
        if value.dtype == np.float32:
            return as_tf_serving_writes(value).tolist()
        return value.tolist()
    encode = _b64 if name.endswith("_bytes") else _text
    flat = np.empty(value.size, object)
    flat[:] = [encode(item) for item in value.reshape(-1)]
    return flat.reshape(value.shape).tolist()


def as_tf_serving_writes(value: np.ndarray) -> np.ndarray:
    """float32 [...] -> float64 [...]: the numbers of the decimals TF Serving writes for them.

    TF Serving writes a float32 in six significant digits (`%g`) when they read back as the
    same float32, else in nine (`WriteDecimal` in util/json_tensor.cc): 0.1f as 0.1. The
    float32's own double, which `tolist` gives, is another number (0.10000000149011612) to a
    client that reads JSON numbers as doubles. NaN and infinities stay as they are.

    The six digits are read back as a double, then rounded to float32, where TF Serving's
    reader (absl::SimpleAtof) rounds the decimal once. The two differ only for a decimal that
    is not halfway between two float32s but reads as a double that is; a check of every
    six-digit decimal within float32's range found none.
    """
    flat = value.reshape(-1)
    numbers = np.array([float(f"{x:.6g}") for x in flat.tolist()], np.float64)
    with np.errstate(invalid="ignore"):                 # signalling NaNs
        reads_back = numbers.astype(np.float32) == flat
    numbers[~reads_back] = [float(f"{x:.9g}") for x in flat[~reads_back].tolist()]
    return numbers.reshape(value.shape)


def _write(name: str, value: np.ndarray, pieces: list[str]) -> None:
    """Appends the JSON of `to_json(name, value)`, a slice of rows (or one row) at a time."""
    value = np.asarray(value)
    if value.ndim == 0 or value.size <= _PIECE_ELEMENTS:
        pieces.append(json.dumps(to_json(name, value)))
        return
    per_row = value.size // len(value)
    step = max(_PIECE_ELEMENTS // per_row, 1)
    pieces.append("[")
    for start in range(0, len(value), step):
        pieces.append(", " if start else "")
        if per_row > _PIECE_ELEMENTS:
            _write(name, value[start], pieces)
        else:                                  # the slice's list without its brackets
            pieces.append(json.dumps(to_json(name, value[start:start + step]))[1:-1])
    pieces.append("]")


def _write_object(values: dict[str, np.ndarray], pieces: list[str]) -> None:
    """Appends `{name: to_json(name, value), ...}`."""
    pieces.append("{")
    for i, (name, value) in enumerate(values.items()):
        pieces.append((", " if i else "") + json.dumps(name) + ": ")
        _write(name, value, pieces)
    pieces.append("}")


def _write_rows(outputs: dict[str, np.ndarray], batch: int, pieces: list[str]) -> None:
    """Appends the row form of several outputs: a list of {name: row} objects."""
    per_row = sum(np.size(value) for value in outputs.values()) // max(batch, 1)
    step = max(_PIECE_ELEMENTS // max(per_row, 1), 1)
    pieces.append("[")
    for start in range(0, batch, step):
        pieces.append(", " if start else "")
        if per_row > _PIECE_ELEMENTS:          # one large row, each output in pieces
            _write_object({name: value[start] for name, value in outputs.items()}, pieces)
            continue
        columns = {name: to_json(name, value[start:start + step])
                   for name, value in outputs.items()}
        rows = [{name: column[row] for name, column in columns.items()}
                for row in range(min(step, batch - start))]
        pieces.append(json.dumps(rows)[1:-1])
    pieces.append("]")


def _parse_instances(instances, signature) -> dict[str, tuple]:
    """Input name -> (its JSON value, its TensorInfo), not converted yet."""
    if not isinstance(instances, list):
        raise ServingError("INVALID_ARGUMENT", "Expecting 'instances' to be an list/array")
    if not instances:
        raise ServingError("INVALID_ARGUMENT", "No values in 'instances' list")
    if all(_is_named(row) for row in instances):
        for row in instances:
            if isinstance(row, _Repeated):
                raise ServingError("INVALID_ARGUMENT", "An instance gives a key more than "
                                   "once; give each input once")
            _check_names(row, signature, "instance")
            extra = sorted(set(row) - set(signature.inputs))       # refused here, as in TF's
            if extra:
                raise ServingError("INVALID_ARGUMENT", "Unknown named input: "
                                   f"{truncate(extra[0], MAX_ECHOED)} in "
                                   f"instance; the signature's inputs are "
                                   f"{sorted(signature.inputs)}")
        return {name: ([row[name] for row in instances], spec)
                for name, spec in signature.inputs.items()}
    return _single_input(instances, signature,
                         "Expecting object with named inputs in every instance")


def _parse_inputs(inputs, signature) -> dict[str, tuple]:
    if _is_named(inputs):
        _check_names(inputs, signature, "'inputs' object")
        return {name: (inputs[name], spec) for name, spec in signature.inputs.items()}
    return _single_input(inputs, signature,
                         "Expecting 'inputs' to be an object of named inputs")


def _single_input(values, signature, expectation: str) -> dict[str, tuple]:
    """Unnamed values feed the signature's only input; with several inputs, `expectation`."""
    if len(signature.inputs) != 1:
        raise ServingError("INVALID_ARGUMENT", f"{expectation}: the signature has "
                           f"{len(signature.inputs)} inputs {sorted(signature.inputs)}")
    name, spec = next(iter(signature.inputs.items()))
    return {name: (values, spec)}


def _is_named(value) -> bool:
    return isinstance(value, dict) and not _is_b64(value)


def _is_b64(value) -> bool:
    return isinstance(value, dict) and list(value) == ["b64"] and not isinstance(value, _Repeated)


def _check_names(named: dict, signature, where: str) -> None:
    """Refuses a missing input; other keys go unread, as TF Serving's
    `FillTensorMapFromInputsMap` looks up the signature's names alone (an instance's unknown
    key is refused: `_parse_instances`)."""
    missing = sorted(set(signature.inputs) - set(named))
    if missing:
        raise ServingError("INVALID_ARGUMENT", f"Missing named input: {missing[0]} in {where}; "
                           f"the signature's inputs are {sorted(signature.inputs)}")


def _to_array(value, spec: meta_graph_pb2.TensorInfo, name: str, shape: list[int]
              ) -> np.ndarray:
    """A JSON value (nested lists) of the checked `shape` as an array of the signature input's
    dtype."""
    dtype = tf.as_dtype(spec.dtype)
    leaves: list = []
    _flatten(value, shape, 0, leaves, name)
    convert = _leaf_converter(dtype)
    converted = [convert(leaf, name) for leaf in leaves]
    if dtype == tf.string:
        return np.array(converted, dtype=object).reshape(shape)
    if dtype in _NARROW_INTS:                                   # wrapped, as TF Serving
        return np.array(converted, np.int64).astype(dtype.as_numpy_dtype).reshape(shape)
    with np.errstate(over="ignore"):                  # 3.5e38 is float32's inf, as in C
        return np.array(converted, dtype=dtype.as_numpy_dtype).reshape(shape)


def _shape_of(value) -> list[int]:
    """The shape given by the first element at every depth (cut past `MAX_RANK` + 1)."""
    shape = []
    while isinstance(value, list) and len(shape) <= MAX_RANK:
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return shape


def _flatten(value, shape: list[int], depth: int, leaves: list, name: str) -> None:
    """Appends the leaves of `value` to `leaves`, refusing ragged lists."""
    if isinstance(value, list):
        if depth >= len(shape) or len(value) != shape[depth]:
            raise ServingError("INVALID_ARGUMENT", f'Input "{name}": Encountered list at '
                               f"unexpected size: {len(value)} at depth {depth}, expected shape "
                               f"{shape}")
        for item in value:
            _flatten(item, shape, depth + 1, leaves, name)
    elif depth != len(shape):
        raise ServingError("INVALID_ARGUMENT", f'Input "{name}": Encountered a scalar at depth '
                           f"{depth}, expected shape {shape}")
    else:
        leaves.append(value)


# Read as JSON int32s and wrapped to their width, as TF Serving's `int_val` (and gRPC here).
_NARROW_INTS = (tf.int8, tf.int16, tf.uint8)
# The integers a JSON value may hold for each integer dtype JSON reads, [low, high); the narrow
# ones are read as int32 and wrapped, as TF Serving's `int_val` holds them.
JSON_INT_RANGES = {tf.int32: (-2 ** 31, 2 ** 31), tf.int64: (-2 ** 63, 2 ** 63),
                   tf.uint32: (0, 2 ** 32), tf.uint64: (0, 2 ** 64),
                   **{narrow: (-2 ** 31, 2 ** 31) for narrow in _NARROW_INTS}}


def _leaf_converter(dtype: tf.DType):
    """The converter of one JSON leaf to a value of `dtype`, for the dtypes TF Serving's JSON
    reads (`AddValueToTensor`); UNIMPLEMENTED for others (half, bfloat16, uint16, ...)."""
    if dtype == tf.string:
        return _string_leaf
    if dtype == tf.bool:
        return _typed_leaf(lambda v: isinstance(v, bool), "Bool", dtype)
    if dtype in (tf.float32, tf.float64):
        number = _typed_leaf(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
                             "Number", dtype)
        return lambda leaf, name: float(number(leaf, name))       # RapidJSON's GetDouble
    if dtype in JSON_INT_RANGES:
        low, high = JSON_INT_RANGES[dtype]
        width = "int32" if dtype in _NARROW_INTS else dtype.name
        return _typed_leaf(lambda v: isinstance(v, int) and not isinstance(v, bool)
                           and low <= v < high, f"Integer within {width}", dtype)
    raise ServingError("UNIMPLEMENTED", f"Conversion of JSON values to type: {dtype.name} is "
                       "not supported, as in TF Serving")


def _typed_leaf(accepts, kind: str, dtype: tf.DType):
    def convert(leaf, name: str):
        if not accepts(leaf):
            raise ServingError("INVALID_ARGUMENT", f'Input "{name}": JSON Value: '
                               f"{_echo(leaf)} Type: {_json_type(leaf)} is not of expected "
                               f"type: {dtype.name} (a JSON {kind})")
        return leaf
    return convert


def _string_leaf(leaf, name: str) -> bytes:
    if isinstance(leaf, str):
        try:
            return leaf.encode("utf-8")
        except UnicodeEncodeError as error:      # a lone surrogate such as "\ud800"
            raise ServingError("INVALID_ARGUMENT", f'Input "{name}": the string at position '
                               f"{error.start} is not valid Unicode text") from error
    if _is_b64(leaf) and isinstance(leaf["b64"], str):
        try:
            return b64_unescape(leaf["b64"])
        except binascii.Error as error:
            raise ServingError("INVALID_ARGUMENT", f'Input "{name}": Unable to base64 decode '
                               f"{truncate(repr(leaf['b64']), MAX_ECHOED)}: {error}") from error
    raise ServingError("INVALID_ARGUMENT", f'Input "{name}": JSON Value: {_echo(leaf)} '
                       f"Type: {_json_type(leaf)} is not of expected type: string (a JSON "
                       'string or {"b64": "..."})')


def _echo(leaf) -> str:
    """A client's JSON value as an error repeats it, cut (`errors.MAX_ECHOED`)."""
    return truncate(json.dumps(leaf), MAX_ECHOED)


def _json_type(value) -> str:
    return {bool: "Bool", int: "Integer", float: "Number", str: "String", dict: "Object",
            list: "Array", type(None): "Null"}.get(type(value), type(value).__name__)


def _batch_size(outputs: dict[str, np.ndarray]) -> int:
    """Dimension 0 shared by every output, which the row form needs."""
    batch = None
    for name, value in outputs.items():
        size = np.shape(value)[0] if np.ndim(value) else None
        if size is None or (batch is not None and size != batch):
            raise ServingError("INVALID_ARGUMENT", f"Tensor name: {name} has inconsistent "
                               f"batch size: {size} expecting: {batch}")
        batch = size
    return batch


def _type_string(dtype: np.dtype) -> str:
    """TF's name of a dtype (`DataTypeString`: "half", "complex64", ...)."""
    try:
        return types_pb2.DataType.Name(tf.as_dtype(dtype).as_datatype_enum)[3:].lower()
    except TypeError:
        return str(dtype)


def _text(item) -> str:
    return item.decode("utf-8", errors="replace") if isinstance(item, bytes) else str(item)


def _b64(item) -> dict:
    data = item if isinstance(item, bytes) else str(item).encode("utf-8")
    return {"b64": base64.b64encode(data).decode("ascii")}
