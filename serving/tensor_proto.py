"""TensorProtos of gRPC requests as arrays, checked before anything is allocated.

`tf.make_ndarray` first expands the declared shape, filling missing values with the last one
(an 18-byte proto declaring 2^28 floats costs 1 GiB). Here a tensor must carry every value it
declares: its dimensions are non-negative, dimension 0 is within the row limit, and the values
present (`tensor_content` bytes or the typed repeated field) are exactly as many as the shape
holds. So the array a request builds is never larger than the request itself. Values of int8,
uint8, int16 and uint16 tensors sent in `int_val` (int32s) are cast to the dtype, wrapping those
out of its range (1000 is -24 as int8), as TF's `Tensor::FromProto` does in TF Serving.
"""
from __future__ import annotations

import math

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2, types_pb2

from tworec.serving.errors import ServingError
from tworec.serving.limits import check_shape

# dtype -> (the repeated field holding its values, how many entries make one element).
_FIELDS = {
    types_pb2.DT_FLOAT: ("float_val", 1), types_pb2.DT_DOUBLE: ("double_val", 1),
    types_pb2.DT_INT32: ("int_val", 1), types_pb2.DT_INT16: ("int_val", 1),
    types_pb2.DT_INT8: ("int_val", 1), types_pb2.DT_UINT8: ("int_val", 1),
    types_pb2.DT_UINT16: ("int_val", 1), types_pb2.DT_INT64: ("int64_val", 1),
    types_pb2.DT_UINT32: ("uint32_val", 1), types_pb2.DT_UINT64: ("uint64_val", 1),
    types_pb2.DT_BOOL: ("bool_val", 1), types_pb2.DT_STRING: ("string_val", 1),
    types_pb2.DT_HALF: ("half_val", 1), types_pb2.DT_BFLOAT16: ("half_val", 1),
    types_pb2.DT_COMPLEX64: ("scomplex_val", 2), types_pb2.DT_COMPLEX128: ("dcomplex_val", 2),
}
# Dtypes narrower than the int32s of `int_val` (tf.make_ndarray raises OverflowError on them).
_NARROW_INTS = {types_pb2.DT_INT8, types_pb2.DT_UINT8, types_pb2.DT_INT16, types_pb2.DT_UINT16}


def to_array(name: str, proto: tensor_pb2.TensorProto, max_rows: int) -> np.ndarray:
    """The array of a request's TensorProto.

    Raises:
        ServingError: INVALID_ARGUMENT for an unknown rank, a negative dimension, more rows
            than `max_rows`, an unsupported dtype, or values that do not fill the shape.
    """
    if proto.tensor_shape.unknown_rank:
        raise ServingError("INVALID_ARGUMENT", f'Input "{name}" has an unknown rank')
    shape = [dim.size for dim in proto.tensor_shape.dim]
    check_shape(name, shape, max_rows)
    if proto.dtype not in _FIELDS:
        raise ServingError("INVALID_ARGUMENT", f'Input "{name}" has dtype '
                           f"{_dtype_name(proto.dtype)}, which requests cannot carry")
    want = math.prod(shape)
    got = _values_present(name, proto)
    if got != want:
        carried = (f"{len(proto.tensor_content)} bytes of tensor_content, not {want} × "
                   f"{tf.as_dtype(proto.dtype).size}" if proto.tensor_content else
                   str(int(got)))
        raise ServingError("INVALID_ARGUMENT", f'Input "{name}" declares shape {shape} '
                           f"({want} values) but carries {carried}; send exactly the values "
                           "the shape holds (unlike TF Serving, this server neither repeats the "
                           "last one to fill a shape, so that a request costs no more than it "
                           "sends, nor drops extra ones)")
    if proto.dtype in _NARROW_INTS and not proto.tensor_content:
        dtype = tf.as_dtype(proto.dtype).as_numpy_dtype
        return np.array(proto.int_val, np.int32).astype(dtype).reshape(shape)
    return tf.make_ndarray(proto)


def to_proto(value: np.ndarray) -> tensor_pb2.TensorProto:
    """An answer's array as TF Serving writes it (`Tensor::AsProtoField`): its values in the
    dtype's typed repeated field (`float_val`, `int64_val`, `string_val`...), where
    `tf.make_tensor_proto` packs any array of more than one number into `tensor_content`,
    in which a client reading `outputs[name].float_val` finds nothing."""
    proto = tf.make_tensor_proto(value)
    if not proto.tensor_content or proto.dtype not in _FIELDS:
        return proto
    field, _ = _FIELDS[proto.dtype]
    content, proto.tensor_content = proto.tensor_content, b""
    if proto.dtype in _PACKED_BYTES:        # fixed-width fields: their packed encoding is the
        number = tensor_pb2.TensorProto.DESCRIPTOR.fields_by_name[field].number   # bytes
        proto.MergeFromString(_varint(number << 3 | 2) + _varint(len(content)) + content)
        return proto
    array = np.asarray(value).ravel()
    if proto.dtype in (types_pb2.DT_HALF, types_pb2.DT_BFLOAT16):
        array = array.view(np.uint16)                                    # the bits, as int32s
    getattr(proto, field).extend(array.tolist())
    return proto


# Dtypes whose typed field holds fixed-width little-endian values, as `tensor_content` does on
# a little-endian host (x86, ARM):
# float_val, double_val, and (real, imag) pairs in scomplex_val and dcomplex_val.
_PACKED_BYTES = {types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_COMPLEX64,
                 types_pb2.DT_COMPLEX128}


def _varint(number: int) -> bytes:
    """`number` as a protobuf base-128 varint."""
    out = bytearray()
    while number > 0x7F:
        out.append(number & 0x7F | 0x80)
        number >>= 7
    return bytes(out + bytes([number]))


def _dtype_name(dtype: int) -> str:
    """The DataType's name, or what the number is when it names none (a proto3 enum field
    keeps any int32 it is sent)."""
    try:
        return types_pb2.DataType.Name(dtype)
    except ValueError:
        return f"{dtype}, not a DataType enum value"


def _values_present(name: str, proto: tensor_pb2.TensorProto) -> int | float:
    """How many elements the proto's bytes hold (fractional when they do not divide)."""
    field, per_element = _FIELDS[proto.dtype]
    if proto.tensor_content:
        if proto.dtype == types_pb2.DT_STRING:
            raise ServingError("INVALID_ARGUMENT", f'Input "{name}": a DT_STRING tensor '
                               "carries its values in string_val, not tensor_content")
        return len(proto.tensor_content) / tf.as_dtype(proto.dtype).size
    return len(getattr(proto, field)) / per_element
