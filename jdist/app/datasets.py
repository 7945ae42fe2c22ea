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
and int32 labels. The IDX reader and writer are in `jdist.app.idx_format`
(and importable from here).
"""

from __future__ import annotations

import http.client
import importlib.metadata
import logging
import os
import shutil
import urllib.request
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

# Re-exported: the IDX reader and writer and their error are part of this module's API.
from jdist.app.idx_format import DatasetError  # pylint: disable=unused-import
from jdist.app.idx_format import atomic_file
from jdist.app.idx_format import read_idx
from jdist.app.idx_format import write_idx  # pylint: disable=unused-import

log = logging.getLogger(__name__)


class Dataset(NamedTuple):
  """A train/test split of images and labels."""
  train_x: np.ndarray  # float32 [N, H, W, C] in [0, 1]
  train_y: np.ndarray  # int32 [N]
  test_x: np.ndarray
  test_y: np.ndarray
  num_classes: int
  name: str


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
  with atomic_file(target) as (stream, temp), \
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


_SPLIT_FIELDS = ("train_x", "train_y", "test_x", "test_y")  # what the digits cache keeps


def load_digits(*, test_size: int = 360, seed: int = 0) -> Dataset:
  """scikit-learn's bundled 8x8 handwritten digits (1797 images); never downloads.

  The split is kept in the cache (`cache_dir("digits")`, one file per split
  and scikit-learn release): importing scikit-learn costs every rank of
  every run about 1.2 s of CPU, a third of a short `jdist train` job's.

  Args:
    test_size: images held out for testing (the default leaves 1437 to train).
    seed: seed of the split, which is stratified so both sides keep the class
      balance; the same seed gives the same split everywhere.

  Returns:
    The `Dataset`, named "digits", images `[N, 8, 8, 1]`.
  """
  cached = _digits_cache_file(test_size, seed)
  try:
    with np.load(cached) as arrays:
      return Dataset(*(arrays[field] for field in _SPLIT_FIELDS), num_classes=10, name="digits")
  except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):  # none yet, or unreadable
    pass
  dataset = _split_digits(test_size, seed)
  try:
    cached.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(cached) as (stream, _):
      np.savez(stream, **{field: getattr(dataset, field) for field in _SPLIT_FIELDS})
  except OSError as err:  # a read-only home: load from scikit-learn every time
    log.debug("digits: not cached at %s: %s", cached, err)
  return dataset


def _digits_cache_file(test_size: int, seed: int) -> Path:
  """The cached split's file: named by its arguments and scikit-learn's release."""
  try:
    release = importlib.metadata.version("scikit-learn")
  except importlib.metadata.PackageNotFoundError:
    release = "none"
  return cache_dir("digits") / f"split-test{int(test_size)}-seed{int(seed)}-sklearn{release}.npz"


def _split_digits(test_size: int, seed: int) -> Dataset:
  """`load_digits`'s split, made by scikit-learn."""
  # Imported here: scikit-learn is slow to import and only this loader needs it.
  from sklearn import datasets as sk_datasets  # pylint: disable=g-import-not-at-top
  from sklearn import model_selection  # pylint: disable=g-import-not-at-top

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


def normalize_name(name: str) -> str:
  """The spelling of a dataset name in `NAMES` ("Fashion-MNIST" -> "fashion_mnist")."""
  return str(name).strip().lower().replace("-", "_")


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
  key = normalize_name(name)
  if key == "digits":
    return load_digits()
  if key == "synthetic":
    return synthetic()
  if key in ("mnist", "fashion_mnist"):
    return _load_idx_dataset(key, data_dir, download)
  raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(NAMES)}.")
