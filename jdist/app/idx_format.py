"""The IDX file format that MNIST and Fashion-MNIST are distributed in.

`read_idx` reads a file, raw or gzip-compressed, checking its header and size
so that a truncated or corrupt download is named as such; `write_idx` writes
one atomically. The datasets that use them are in `jdist.app.datasets`.
"""

from __future__ import annotations

import contextlib
import gzip as gzip_lib
import math
import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from jdist import errors


class DatasetError(errors.JdistError, ValueError):
  """A dataset file is missing, corrupt or truncated."""


# IDX dtype codes (third magic byte). Data is stored big-endian.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}
_IDX_CODES = {dtype.newbyteorder("="): code for code, dtype in _IDX_DTYPES.items()}
_IDX_MAX_NDIM = 4
_KNOWN_DTYPES = ", ".join(f"0x{code:02X} {dtype.name}" for code, dtype in _IDX_DTYPES.items())
_GZIP_MAGIC = b"\x1f\x8b"


def read_idx(path: str | os.PathLike) -> np.ndarray:
  """Reads an IDX file (MNIST format), raw or gzip-compressed.

  Args:
    path: the file; gzip is detected by its magic bytes, not its name.

  Returns:
    The array, in native byte order, with the shape the header gives.

  Raises:
    DatasetError: the file cannot be read or is not a complete, valid IDX
      file; the message names the file and the problem.
  """
  try:
    raw = Path(path).read_bytes()
  except OSError as error:
    raise DatasetError(f"{path}: cannot read: {error.strerror or error}.") from None
  if raw[:2] == _GZIP_MAGIC:  # An IDX file itself starts with 00 00.
    try:
      raw = gzip_lib.decompress(raw)
    except (OSError, EOFError, zlib.error) as error:
      raise DatasetError(f"{path}: corrupt or truncated gzip data ({error}); "
                         f"delete the file and fetch it again.") from None
  if len(raw) < 4:
    raise DatasetError(f"{path}: {len(raw)} bytes is too short for an IDX "
                       f"header (4 magic bytes 00 00 <dtype> <ndim>).")
  code, ndim = raw[2], raw[3]
  if raw[:2] != b"\0\0":
    raise DatasetError(f"{path}: bad magic {raw[:4].hex(' ')}: an IDX file "
                       f"starts with 00 00 <dtype> <ndim>; this is not an IDX file.")
  if code not in _IDX_DTYPES:
    raise DatasetError(f"{path}: unknown IDX dtype code 0x{code:02X} (known: {_KNOWN_DTYPES}).")
  if not 1 <= ndim <= _IDX_MAX_NDIM:
    raise DatasetError(f"{path}: IDX header says ndim={ndim}; only 1 to "
                       f"{_IDX_MAX_NDIM} dimensions are supported.")
  header_size = 4 + 4 * ndim
  if len(raw) < header_size:
    raise DatasetError(f"{path}: truncated header: {ndim} dimensions need "
                       f"{header_size} header bytes but the file has {len(raw)}.")
  shape = struct.unpack(f">{ndim}I", raw[4:header_size])
  dtype = _IDX_DTYPES[code]
  # Python ints: a corrupt header cannot overflow the expected size.
  expected = math.prod(shape) * dtype.itemsize
  found = len(raw) - header_size
  if found != expected:
    problem = "truncated payload" if found < expected else (
        f"{found - expected} extra bytes after the payload")
    raise DatasetError(f"{path}: {problem}: shape {shape} of {dtype.name} "
                       f"needs {expected} data bytes, found {found}.")
  array = np.frombuffer(raw, dtype, count=math.prod(shape), offset=header_size)
  return array.reshape(shape).astype(dtype.newbyteorder("="))


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[tuple[BinaryIO, Path]]:
  """Yields `(stream, temp_path)`, then renames the temp file to `path`.

  Readers, and other ranks writing the same file at once, see either no file
  or a whole one; on an exception the temp file is removed instead.
  """
  descriptor, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
  try:
    with os.fdopen(descriptor, "wb") as stream:
      yield stream, Path(temp)
    os.replace(temp, path)
  finally:
    Path(temp).unlink(missing_ok=True)


def write_idx(path: str | os.PathLike, array: np.ndarray, gzip: bool = True) -> Path:
  """Writes `array` as an IDX file (atomically), gzip-compressed by default.

  Args:
    path: destination file.
    array: uint8, int8, int16, int32, float32 or float64; 1 to 4 dimensions.
    gzip: compress the file (deterministically: no timestamp).

  Returns:
    The path written.

  Raises:
    ValueError: the dtype or number of dimensions has no IDX encoding.
  """
  array = np.asarray(array)
  code = _IDX_CODES.get(array.dtype.newbyteorder("="))
  if code is None:
    raise ValueError(f"write_idx: dtype {array.dtype} has no IDX code; use one "
                     f"of {_KNOWN_DTYPES}.")
  if not 1 <= array.ndim <= _IDX_MAX_NDIM or max(array.shape) >= 2**32:
    raise ValueError(f"write_idx: shape {array.shape} cannot be written; IDX "
                     f"takes 1 to {_IDX_MAX_NDIM} dimensions, each < 2**32.")
  header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
  data = header + array.astype(_IDX_DTYPES[code]).tobytes()
  if gzip:
    data = gzip_lib.compress(data, mtime=0)
  path = Path(path)
  with atomic_file(path) as (stream, _):
    stream.write(data)
  return path
