"""Datasets for examples and benchmarks, usable offline.

`load_digits` (scikit-learn's bundled 8x8 digits) and `synthetic` need no
files at all. MNIST and Fashion-MNIST are read from IDX files (the format
they are distributed in), looked for in this order:

1. `data_dir` and `data_dir/<name>`, when given;
2. the cache, `$JDIST_DATA/<name>` (default `~/.cache/jdist/datasets/<name>`);
3. system directories, e.g. `/usr/share/datasets/fashion-mnist` from the
   Debian package `dataset-fashion-mnist`;
4. a download from `MIRRORS` into the cache, if `download=True`.

Every loader returns a `Dataset` of float32 images `[N, H, W, C]` in [0, 1]
and int32 labels.
"""

from __future__ import annotations

import contextlib
import gzip as gzip_lib
import http.client
import logging
import math
import os
import shutil
import struct
import tempfile
import urllib.request
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

from jdist import errors

log = logging.getLogger(__name__)


class DatasetError(errors.JdistError, ValueError):
  """A dataset file is missing, corrupt or truncated."""


class Dataset(NamedTuple):
  """A train/test split of images and labels."""
  train_x: np.ndarray  # float32 [N, H, W, C] in [0, 1]
  train_y: np.ndarray  # int32 [N]
  test_x: np.ndarray
  test_y: np.ndarray
  num_classes: int
  name: str


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
def _atomic_file(path: Path) -> Iterator[tuple[BinaryIO, Path]]:
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
  with _atomic_file(path) as (stream, _):
    stream.write(data)
  return path


# --- MNIST-format datasets ----------------------------------------------------

# Files of an MNIST-format dataset, by Dataset field; each may be raw or `.gz`.
IDX_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
# Base URLs tried in order; a file is fetched from `<base><file>.gz`.
MIRRORS: dict[str, list[str]] = {
    "mnist": [
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
    ],
    "fashion_mnist": [
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
    ],
}
# Directories that OS packages install the files into.
SYSTEM_DIRS: dict[str, list[str]] = {
    "mnist": [],
    "fashion_mnist": ["/usr/share/datasets/fashion-mnist"],  # Debian: dataset-fashion-mnist
}
_INSTALL_HINTS = {"fashion_mnist": "sudo apt-get install dataset-fashion-mnist (Debian/Ubuntu)"}
CACHE_ENV = "JDIST_DATA"
_MNIST_CLASSES = 10
DOWNLOAD_TIMEOUT_S = 60.0


def cache_dir(name: str) -> Path:
  """Where downloads of dataset `name` are kept: `$JDIST_DATA/<name>`.

  Without `$JDIST_DATA`, `$XDG_CACHE_HOME/jdist/datasets/<name>`, and without
  that `~/.cache/jdist/datasets/<name>`.
  """
  root = os.environ.get(CACHE_ENV)
  if not root:
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    root = Path(cache_home) / "jdist" / "datasets"
  return Path(root) / name


def _find(directory: Path, stem: str) -> Path | None:
  for candidate in (directory / f"{stem}.gz", directory / stem):
    if candidate.is_file():
      return candidate
  return None


def _places(name: str, data_dir: str | os.PathLike | None) -> list[tuple[Path, str]]:
  """Directories to search, in order, each with a note for error messages."""
  places = []
  if data_dir is not None:
    places += [(Path(data_dir), "data_dir"), (Path(data_dir) / name, "data_dir")]
  places.append((cache_dir(name), f"cache; set ${CACHE_ENV} to move it"))
  places += [(Path(d), "system") for d in SYSTEM_DIRS.get(name, ())]
  return places


def _complete(directory: Path) -> dict[str, Path] | None:
  files = {field: _find(directory, stem) for field, stem in IDX_FILES.items()}
  return None if None in files.values() else files


def _fetch(url: str, target: Path, ndim: int) -> None:
  """Downloads one IDX file to `target`, checking it before it appears there."""
  with _atomic_file(target) as (stream, temp), \
       urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
    shutil.copyfileobj(response, stream)
    stream.flush()
    array = read_idx(temp)
    if array.ndim != ndim:
      raise DatasetError(f"{url}: expected {ndim} dimensions, got shape {array.shape}.")


def _download(name: str, directory: Path) -> list[str]:
  """Fetches the files missing from `directory`; returns what went wrong."""
  problems = []
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    return [f"cannot create {directory}: {error.strerror or error}"]
  for field, stem in IDX_FILES.items():
    if _find(directory, stem) is not None:
      continue
    for base in MIRRORS.get(name, ()):
      url = f"{base}{stem}.gz"
      try:
        log.info("downloading %s", url)
        _fetch(url, directory / f"{stem}.gz", ndim=3 if field.endswith("x") else 1)
        break
      # URLError and timeouts are OSErrors; ValueError covers a bad URL and
      # DatasetError a corrupt file; HTTPException a cut connection.
      except (OSError, ValueError, http.client.HTTPException) as error:
        problems.append(f"{url}: {error}")
    else:
      # Without this file the dataset is incomplete: skip the other downloads.
      return problems or [f"no mirror configured for {name}"]
  return problems


def _not_found(name: str, places: list[tuple[Path, str]], download: str) -> DatasetError:
  looked = []
  for directory, note in places:
    if not directory.is_dir():
      looked.append(f"  {directory} ({note}): no such directory")
    else:
      missing = [f"{stem}[.gz]" for stem in IDX_FILES.values() if _find(directory, stem) is None]
      missing_text = ("all four files" if len(missing) == len(IDX_FILES)
                      else ", ".join(missing))
      looked.append(f"  {directory} ({note}): missing {missing_text}")
  fixes = [_INSTALL_HINTS[name]] if name in _INSTALL_HINTS else []
  fixes += ["pass --data-dir DIR (data_dir=DIR) holding the four files",
            f"copy them into {cache_dir(name)}",
            "or allow the download (download=True, with network access)"]
  return DatasetError(
      f"{name}: found no complete copy of {', '.join(IDX_FILES.values())} "
      f"(each raw or .gz). Looked in:\n" + "\n".join(looked) +
      f"\nDownload: {download}\nTo fix: " + "; ".join(fixes) + ".")


def _read_split(image_file: Path, label_file: Path) -> tuple[np.ndarray, np.ndarray]:
  """Reads and checks one split: float32 `[N, H, W, 1]` in [0, 1], int32 labels."""
  images, labels = read_idx(image_file), read_idx(label_file)
  if images.ndim != 3 or images.dtype != np.uint8:
    raise DatasetError(f"{image_file}: expected uint8 images [N, H, W], got "
                       f"{images.dtype} {images.shape}.")
  if labels.shape != images.shape[:1] or labels.dtype != np.uint8:
    raise DatasetError(f"{label_file}: expected {images.shape[0]} uint8 labels "
                       f"to match {image_file.name}, got {labels.dtype} {labels.shape}.")
  if labels.size and labels.max() >= _MNIST_CLASSES:
    raise DatasetError(f"{label_file}: label {labels.max()} is out of range for "
                       f"{_MNIST_CLASSES} classes.")
  return (images[..., None].astype(np.float32) / np.float32(255),
          labels.astype(np.int32))


def _load_idx_dataset(name: str, data_dir: str | os.PathLike | None,
                      download: bool) -> Dataset:
  places = _places(name, data_dir)
  for directory, _ in places:
    files = _complete(directory)
    if files is not None:
      break
  else:
    directory = cache_dir(name)
    download_note = "not tried (download=False)"
    if download:
      problems = _download(name, directory)
      files = _complete(directory)
      download_note = "failed:\n  " + "\n  ".join(problems)
    if files is None:
      raise _not_found(name, places, download_note)
  log.info("loading %s from %s", name, directory)
  train_x, train_y = _read_split(files["train_x"], files["train_y"])
  test_x, test_y = _read_split(files["test_x"], files["test_y"])
  return Dataset(train_x, train_y, test_x, test_y, num_classes=_MNIST_CLASSES, name=name)


def load_mnist(data_dir: str | os.PathLike | None = None, *, download: bool = True) -> Dataset:
  """MNIST handwritten digits: 60000 train and 10000 test images, 28x28x1.

  Args:
    data_dir: a directory to look in first (in it or in `data_dir/mnist`).
    download: if the files are found nowhere, download them into the cache.

  Returns:
    The `Dataset`, named "mnist".

  Raises:
    DatasetError: no copy found (the message lists the places searched and
      how to fix it), or a file is corrupt.
  """
  return _load_idx_dataset("mnist", data_dir, download)


def load_fashion_mnist(data_dir: str | os.PathLike | None = None, *,
                       download: bool = True) -> Dataset:
  """Fashion-MNIST clothing images: 60000 train and 10000 test, 28x28x1.

  Also found where Debian's `dataset-fashion-mnist` package installs it.
  Arguments, return value and errors as for `load_mnist` (the subdirectory
  of `data_dir` is `fashion_mnist`).
  """
  return _load_idx_dataset("fashion_mnist", data_dir, download)


# --- Datasets that need no files ---------------------------------------------


def load_digits(*, test_size: int = 360, seed: int = 0) -> Dataset:
  """scikit-learn's bundled 8x8 handwritten digits (1797 images); never downloads.

  Args:
    test_size: images held out for testing (the default leaves 1437 to train).
    seed: seed of the split, which is stratified so both sides keep the class
      balance; the same seed gives the same split everywhere.

  Returns:
    The `Dataset`, named "digits", images `[N, 8, 8, 1]`.
  """
  # Imported here: scikit-learn is slow to import and only this loader needs it.
  from sklearn import datasets as sk_datasets
  from sklearn import model_selection

  digits = sk_datasets.load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]  # Pixels are 0..16.
  labels = digits.target.astype(np.int32)
  train_x, test_x, train_y, test_y = model_selection.train_test_split(
      images, labels, test_size=test_size, random_state=seed, stratify=labels)
  return Dataset(train_x, train_y, test_x, test_y, num_classes=10, name="digits")


def synthetic(num_train: int = 2048, num_test: int = 512, *,
              image_shape: Sequence[int] = (8, 8, 1), num_classes: int = 10,
              noise: float = 0.25, seed: int = 0) -> Dataset:
  """Random images around one prototype per class: learnable, for benchmarks.

  Args:
    num_train: examples in the training split.
    num_test: examples in the test split.
    image_shape: shape of one image `[H, W, C]`.
    num_classes: number of classes, one random prototype image each.
    noise: standard deviation of the Gaussian noise added to the prototype;
      larger values make the classes overlap more.
    seed: the same seed gives the same data.

  Returns:
    The `Dataset`, named "synthetic", pixels clipped to [0, 1].
  """
  rng = np.random.default_rng(seed)
  prototypes = rng.random((num_classes, *image_shape), dtype=np.float32)

  def sample(count):
    labels = rng.integers(0, num_classes, size=count).astype(np.int32)
    images = prototypes[labels] + noise * rng.standard_normal(
        (count, *image_shape), dtype=np.float32)
    return np.clip(images, 0.0, 1.0), labels

  train_x, train_y = sample(num_train)
  test_x, test_y = sample(num_test)
  return Dataset(train_x, train_y, test_x, test_y, num_classes=num_classes, name="synthetic")


NAMES = ("digits", "mnist", "fashion_mnist", "synthetic")


def load(name: str, data_dir: str | os.PathLike | None = None, *,
         download: bool = True) -> Dataset:
  """Loads a dataset by name.

  Args:
    name: one of `NAMES` ("fashion-mnist" is accepted for "fashion_mnist").
    data_dir: directory to look in first (MNIST-format datasets only).
    download: allow downloading (MNIST-format datasets only).

  Returns:
    The `Dataset`.

  Raises:
    ValueError: an unknown name.
    DatasetError: the files cannot be found or are corrupt.
  """
  key = name.strip().lower().replace("-", "_")
  if key == "digits":
    return load_digits()
  if key == "synthetic":
    return synthetic()
  if key in ("mnist", "fashion_mnist"):
    return _load_idx_dataset(key, data_dir, download)
  raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(NAMES)}.")
