"""The wire's field codec (wire.py's records use it; pure, no I/O): numpy arrays as ``{dtype, shape, data}``
maps in little-endian bytes (``encode_array``; ``Fields.array`` checks and decodes them), and ``Fields``, typed
access to a decoded map whose every failure is a WireError naming ``<kind>.<field>``."""

from __future__ import annotations

import builtins
import math
from enum import Enum
from typing import Any

import numpy as np

from t1async.protocol.errors import DeadReason, WireError

__all__ = ["CODES", "DTYPES", "Fields", "encode_array"]

DTYPES = {"i4": "<i4", "f4": "<f4", "u1": "u1", "u2": "<u2", "i2": "<i2", "i8": "<i8", "f8": "<f8"}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}


def encode_array(arr: np.ndarray) -> dict:
    a = np.asarray(arr)
    code = CODES.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
    if code is None:
        raise WireError(f"cannot encode array of dtype {a.dtype}; allowed: {sorted(DTYPES)}", field="array")
    return {"dtype": code, "shape": list(a.shape), "data": np.ascontiguousarray(a, dtype=DTYPES[code]).tobytes()}


class Fields:
    """Typed access to a decoded map; every failure names ``<kind>.<field>``."""

    def __init__(self, kind: str, m: dict):
        self.kind, self.m = kind, m

    def error(self, name: str, what: str, reason: DeadReason = DeadReason.FIELD) -> WireError:
        return WireError(f"{self.kind}.{name}: {what}", field=name, reason=reason)

    def get(self, name: str, types: type | tuple[type, ...], *, default: Any = ..., what: str = "") -> Any:
        if name not in self.m:
            if default is not ...:
                return default
            raise self.error(name, "missing required field", DeadReason.MISSING)
        val = self.m[name]
        if isinstance(val, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise self.error(name, f"expected {what or types}, got bool")
        if not isinstance(val, types):
            raise self.error(name, f"expected {what or getattr(types, '__name__', types)}, got {type(val).__name__}")
        return val

    def int(self, name: str, *, lo: int | None = 0, default: Any = ...) -> int:
        val = self.get(name, int, default=default, what="int")
        if lo is not None and val < lo:
            raise self.error(name, f"must be >= {lo}, got {val}")
        return val

    def float(self, name: str, *, default: Any = ...) -> float:
        val = float(self.get(name, (int, float), default=default, what="number"))
        if not math.isfinite(val):
            raise self.error(name, f"must be finite, got {val}")
        return val

    def str(self, name: str, *, nonempty: bool = True, default: Any = ...) -> str:
        val = self.get(name, str, default=default, what="str")
        if nonempty and not val:
            raise self.error(name, "must be a non-empty string")
        return val

    def enum(self, name: builtins.str, enum: type[Enum]) -> Any:
        val = self.get(name, str, what="str")
        try:
            return enum(val)
        except ValueError:
            raise self.error(name, f"{val!r} is not one of {[e.value for e in enum]}") from None

    def array(
        self, name: builtins.str, m: Any = None, *, dtypes: tuple[builtins.str, ...], ndim: builtins.int
    ) -> np.ndarray:
        m = self.get(name, dict, what="array map {dtype, shape, data}") if m is None else m
        for key in ("dtype", "shape", "data"):
            if key not in m:
                raise self.error(f"{name}.{key}", "missing required field", DeadReason.MISSING)
        code, shape, data = m["dtype"], m["shape"], m["data"]
        if code not in dtypes:
            raise self.error(f"{name}.dtype", f"{code!r} is not one of {list(dtypes)}")
        if (
            not isinstance(shape, list)
            or len(shape) != ndim
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in shape)
        ):
            raise self.error(f"{name}.shape", f"expected {ndim} non-negative ints, got {shape!r}")
        if not isinstance(data, bytes):
            raise self.error(f"{name}.data", f"expected bin, got {type(data).__name__}")
        dt = np.dtype(DTYPES[code])
        want = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if len(data) != want:
            raise self.error(f"{name}.data", f"holds {len(data)} bytes, shape {shape} of {code} needs {want}")
        return np.frombuffer(data, dtype=dt).reshape(shape)
