"""Codecs between wire contracts and Python values: TokenArray <-> numpy, bytes <-> protobuf.

``to_array`` decodes with ``np.frombuffer``: the result is a read-only view of the
message's bytes (no copy), ready to hand to ``treadle_native`` as a slice. Decoding
failures raise ``DecodeError`` with what was expected and where, never a bare protobuf
or numpy exception.
"""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
from google.protobuf.message import DecodeError as ProtoDecodeError
from google.protobuf.message import Message

from treadle.proto.v1 import common_pb2
from treadle.services.errors import DecodeError

P = TypeVar("P", bound=Message)

DType = common_pb2.DType

# wire dtype -> little-endian numpy dtype; bfloat16 travels as its uint16 bit pattern
_TO_NUMPY: dict[common_pb2.DType, np.dtype[Any]] = {
    DType.DTYPE_INT32: np.dtype("<i4"),
    DType.DTYPE_INT64: np.dtype("<i8"),
    DType.DTYPE_FLOAT32: np.dtype("<f4"),
    DType.DTYPE_FLOAT16: np.dtype("<f2"),
    DType.DTYPE_BFLOAT16: np.dtype("<u2"),
    DType.DTYPE_UINT8: np.dtype("u1"),
    DType.DTYPE_INT8: np.dtype("i1"),
    DType.DTYPE_UINT32: np.dtype("<u4"),
    DType.DTYPE_FLOAT64: np.dtype("<f8"),
}
_FROM_NUMPY: dict[str, common_pb2.DType] = {
    "int32": DType.DTYPE_INT32,
    "int64": DType.DTYPE_INT64,
    "float32": DType.DTYPE_FLOAT32,
    "float16": DType.DTYPE_FLOAT16,
    "uint8": DType.DTYPE_UINT8,
    "bool": DType.DTYPE_UINT8,
    "int8": DType.DTYPE_INT8,
    "uint32": DType.DTYPE_UINT32,
    "float64": DType.DTYPE_FLOAT64,
}


def to_token_array(array: np.ndarray, *, bfloat16: bool = False) -> common_pb2.TokenArray:
    """Encode a numpy array (any byte order/layout) as a little-endian C-order TokenArray.

    ``bfloat16=True`` marks a uint16 array as bfloat16 bit patterns.
    """
    arr = np.asarray(array)
    if bfloat16:
        if arr.dtype != np.uint16:
            raise ValueError(f"bfloat16 arrays travel as uint16 bit patterns, got {arr.dtype}")
        wire = DType.DTYPE_BFLOAT16
    else:
        try:
            wire = _FROM_NUMPY[arr.dtype.name]
        except KeyError:
            raise ValueError(
                f"dtype {arr.dtype} has no TokenArray encoding (supported: {sorted(_FROM_NUMPY)})"
            ) from None
    le = arr.astype(_TO_NUMPY[wire], copy=False)  # bool -> u1, big-endian -> little-endian
    shape = list(le.shape) if le.ndim != 1 else []
    return common_pb2.TokenArray(data=np.ascontiguousarray(le).tobytes(), dtype=wire, shape=shape)


def to_array(
    ta: common_pb2.TokenArray,
    *,
    field: str = "TokenArray",
    expect_dtype: str | None = None,
    expect_len: int | None = None,
) -> np.ndarray:
    """Decode a TokenArray without copying (read-only view).

    ``field`` names the array in error messages; ``expect_dtype`` (numpy name, e.g.
    "int32") and ``expect_len`` (number of elements) are checked when given.
    """
    dtype = _TO_NUMPY.get(ta.dtype)
    if dtype is None:
        raise DecodeError(f"{field}: unknown or unspecified dtype {ta.dtype}")
    if len(ta.data) % dtype.itemsize:
        raise DecodeError(
            f"{field}: {len(ta.data)} bytes is not a whole number of {dtype.name} elements"
        )
    arr = np.frombuffer(ta.data, dtype=dtype)
    if ta.shape:
        shape = tuple(int(d) for d in ta.shape)
        if any(d < 0 for d in shape) or int(np.prod(shape)) != arr.size:
            raise DecodeError(f"{field}: shape {shape} does not hold {arr.size} elements")
        arr = arr.reshape(shape)
    if expect_dtype is not None and arr.dtype.name != np.dtype(expect_dtype).name:
        raise DecodeError(f"{field}: expected dtype {expect_dtype}, got {arr.dtype.name}")
    if expect_len is not None and arr.size != expect_len:
        raise DecodeError(f"{field}: expected {expect_len} elements, got {arr.size}")
    return arr


def decode_message(msg_type: type[P], data: bytes, *, where: str = "") -> P:
    """Parse ``data`` as ``msg_type``; a parse failure becomes a DecodeError naming both."""
    msg = msg_type()
    try:
        msg.ParseFromString(data)
    except (ProtoDecodeError, RuntimeError, ValueError) as e:
        origin = f" from {where}" if where else ""
        raise DecodeError(
            f"{len(data)} bytes{origin} are not a valid {msg_type.DESCRIPTOR.full_name}: {e}"
        ) from None
    return msg


def type_name(msg_or_type: Message | type[Message]) -> str:
    """Full protobuf name, e.g. 'treadle.proto.v1.Rollout'."""
    return msg_or_type.DESCRIPTOR.full_name
