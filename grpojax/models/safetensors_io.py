"""Minimal safetensors reading and writing on plain files, tensor by tensor.

The format is an 8-byte little-endian header length, a JSON header
({name: {dtype, shape, data_offsets}}), then raw row-major bytes. Reading a
tensor straight into a caller's buffer (no mmap, no torch) keeps host memory at
one tensor beyond the loaded model; bfloat16 comes from ml_dtypes (a jax dependency).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class TensorInfo:
  """Where one tensor lives: file, dtype, shape and absolute byte offset."""

  def __init__(self, file: str, dtype: str, shape: Sequence[int], start: int, end: int):
    if dtype not in DTYPES:
      raise ValueError(f"{file}: tensor dtype {dtype} is not supported; supported: {', '.join(DTYPES)}")
    self.file, self.dtype, self.shape = file, DTYPES[dtype], tuple(shape)
    self.start, self.nbytes = start, end - start
    if self.nbytes != int(np.prod(self.shape)) * self.dtype.itemsize:
      raise ValueError(f"{file}: corrupt header, byte range does not match shape {self.shape}")


def read_header(file: str) -> dict[str, TensorInfo]:
  """{tensor name: TensorInfo} of one .safetensors file."""
  with open(file, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise ValueError(f"{file} is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", raw)
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  base = 8 + n
  return {name: TensorInfo(file, h["dtype"], h["shape"], base + h["data_offsets"][0],
                           base + h["data_offsets"][1]) for name, h in header.items()}


def read_into(info: TensorInfo, out: np.ndarray) -> None:
  """Read the tensor into `out` (C-contiguous, same element count), converting dtype."""
  if out.size != int(np.prod(info.shape)):
    raise ValueError(f"cannot read tensor of shape {info.shape} into buffer of shape {out.shape}")
  direct = out.dtype == info.dtype and out.flags.c_contiguous
  target = out if direct else np.empty(info.shape, info.dtype)
  with open(info.file, "rb") as f:
    f.seek(info.start)
    view = memoryview(target.reshape(-1).view(np.uint8))
    if f.readinto(view) != info.nbytes:
      raise ValueError(f"{info.file}: truncated file")
  if not direct:
    out[...] = target.reshape(out.shape).astype(out.dtype)


def write_file(file: str, entries: Sequence[tuple[str, tuple[int, ...], np.dtype]],
               fetch: Callable[[str], np.ndarray]) -> None:
  """Write tensors `entries` [(name, shape, dtype)] to `file`, calling fetch(name) one at a time."""
  header, offset = {}, 0
  for name, shape, dtype in entries:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape),
                    "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  # transformers refuses safetensors files without a known "format".
  header["__metadata__"] = {"format": "pt"}
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # align the data section to 8 bytes
  tmp = file + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, dtype in entries:
      arr = np.ascontiguousarray(fetch(name), dtype=dtype)
      if arr.shape != tuple(shape):
        arr = arr.reshape(shape)
      f.write(memoryview(arr.reshape(-1).view(np.uint8)))
  os.replace(tmp, file)
