"""Minimal safetensors reader / writer over numpy memory maps (bfloat16 through ml_dtypes).

Why not `safetensors.numpy`: it cannot represent bfloat16, and we want to read one tensor at a time
from a memory map (so a 7B checkpoint never sits in host memory whole) and to detect a truncated file
with an error that names it.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from sage_jax.errors import UserError

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


class SafetensorsError(UserError, ValueError):
    """A malformed or truncated safetensors file; the message names the file (and tensor)."""


class SafetensorsFile:
    """Lazily maps tensors of one file: `f.keys()`, `f.shape(name)`, `f[name] -> np.ndarray` (a view)."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise SafetensorsError(f"{path}: truncated safetensors file (header claims {n} bytes)")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SafetensorsError(f"{path}: corrupt safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self._info = header
        self._offset = 8 + n
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if self._offset + end > size:
            raise SafetensorsError(f"{path}: truncated safetensors file: {size} bytes on disk, "
                                   f"tensors need {self._offset + end}")
        for name, v in header.items():
            if v.get("dtype") not in _DTYPES:
                raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {v.get('dtype')!r}")
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)

    def keys(self):
        return self._info.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info[name]["shape"])

    def __getitem__(self, name: str) -> np.ndarray:
        v = self._info[name]
        b, e = v["data_offsets"]
        dtype = np.dtype(_DTYPES[v["dtype"]])
        count = int(np.prod(v["shape"], dtype=np.int64))
        if (e - b) != count * dtype.itemsize:
            raise SafetensorsError(f"{self.path}: tensor {name!r}: {e - b} bytes for shape {v['shape']} "
                                   f"of {v['dtype']}")
        raw = self._mmap[self._offset + b:self._offset + e]
        return raw.view(dtype).reshape(v["shape"])


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NAMES:
            raise SafetensorsError(f"{path}: cannot write dtype {a.dtype} of tensor {name!r}")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    header["__metadata__"] = dict(metadata or {"format": "pt"})
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes, as the reference writer does
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for a in arrays:
            fh.write(a.tobytes())
    os.replace(tmp, path)
