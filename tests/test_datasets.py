"""Tests of jdist.app.datasets: the IDX reader, dataset lookup and download.

Nothing here reaches the internet: every test runs with the mirror list
pointing at a closed local port, the cache in a temporary directory and no
system directories, unless it sets them itself (downloads are served by
`http.server` on 127.0.0.1).
"""

import functools
import gzip
import http.server
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from jdist.app import datasets
from jdist import errors
from jdist.app.datasets import DatasetError

REAL_SYSTEM_DIRS = {name: list(dirs) for name, dirs in datasets.SYSTEM_DIRS.items()}
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def _closed_port_url():
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  return f"http://127.0.0.1:{port}/"


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
  """No network, no real cache, no system directories."""
  dead = _closed_port_url()
  monkeypatch.setattr(datasets, "MIRRORS", {"mnist": [dead], "fashion_mnist": [dead]})
  monkeypatch.setattr(datasets, "SYSTEM_DIRS", {"mnist": [], "fashion_mnist": []})
  monkeypatch.setattr(datasets, "DOWNLOAD_TIMEOUT_S", 10.0)
  monkeypatch.setenv(datasets.CACHE_ENV, str(tmp_path / "cache"))
  for proxy in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
    monkeypatch.delenv(proxy, raising=False)


def _fake_split(rng, count, size=28):
  images = rng.integers(0, 256, size=(count, size, size), dtype=np.uint8)
  labels = rng.integers(0, 10, size=count).astype(np.uint8)
  return images, labels


def _write_dataset(directory, *, seed=0, gzip_files=True, train=12, test=6):
  """Writes a small MNIST-format dataset; returns its arrays by field."""
  rng = np.random.default_rng(seed)
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  arrays = {}
  arrays["train_x"], arrays["train_y"] = _fake_split(rng, train)
  arrays["test_x"], arrays["test_y"] = _fake_split(rng, test)
  for field, stem in datasets.IDX_FILES.items():
    name = f"{stem}.gz" if gzip_files else stem
    datasets.write_idx(directory / name, arrays[field], gzip=gzip_files)
  return arrays


def _check_matches(dataset, arrays, name):
  assert dataset.name == name and dataset.num_classes == 10
  assert dataset.train_x.shape == arrays["train_x"].shape + (1,)
  assert dataset.train_x.dtype == np.float32 and dataset.train_y.dtype == np.int32
  assert 0.0 <= dataset.train_x.min() and dataset.train_x.max() <= 1.0
  np.testing.assert_allclose(dataset.test_x[..., 0] * 255, arrays["test_x"], atol=1e-3)
  np.testing.assert_array_equal(dataset.train_y, arrays["train_y"])
  np.testing.assert_array_equal(dataset.test_y, arrays["test_y"])


class _QuietHandler(http.server.SimpleHTTPRequestHandler):

  def log_message(self, *args):
    pass


@pytest.fixture
def http_root(tmp_path):
  """Serves a directory on 127.0.0.1; yields (directory, base URL, request log)."""
  root = tmp_path / "served"
  root.mkdir()
  requests = []

  class Handler(_QuietHandler):

    def do_GET(self):
      requests.append(self.path)
      super().do_GET()

  server = http.server.ThreadingHTTPServer(
      ("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
  thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
  thread.start()
  try:
    yield root, f"http://127.0.0.1:{server.server_address[1]}/", requests
  finally:
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


# --- IDX reader / writer -------------------------------------------------------


@pytest.mark.parametrize("compress", (False, True))
@pytest.mark.parametrize("dtype, shape", [
    (np.uint8, (5, 3, 2)), (np.int8, (7,)), (np.int16, (4, 3)),
    (np.int32, (2, 1, 3, 2)), (np.float32, (3, 3)), (np.float64, (6,)),
    (np.uint8, (0, 4)),
])
def test_idx_round_trip(tmp_path, dtype, shape, compress):
  rng = np.random.default_rng(1)
  array = (rng.standard_normal(shape) * 100).astype(dtype)
  path = datasets.write_idx(tmp_path / "a.idx", array, gzip=compress)
  assert (path.read_bytes()[:2] == b"\x1f\x8b") == compress
  loaded = datasets.read_idx(path)
  assert loaded.dtype == np.dtype(dtype) and loaded.dtype.isnative
  np.testing.assert_array_equal(loaded, array)
  loaded[...] = 0  # The result is a writable copy.


def test_write_idx_rejects_what_idx_cannot_hold(tmp_path):
  with pytest.raises(ValueError, match="no IDX code"):
    datasets.write_idx(tmp_path / "a", np.zeros(3, np.uint16))
  with pytest.raises(ValueError, match="1 to 4 dimensions"):
    datasets.write_idx(tmp_path / "a", np.zeros((1,) * 5, np.uint8))
  with pytest.raises(ValueError, match="1 to 4 dimensions"):
    datasets.write_idx(tmp_path / "a", np.uint8(3))
  assert list(tmp_path.iterdir()) == []


def _idx_bytes(tmp_path, array, compress=False):
  return datasets.write_idx(tmp_path / "valid.idx", array, gzip=compress).read_bytes()


@pytest.mark.parametrize("mutate, problem", [
    (lambda raw: b"\x01" + raw[1:], "bad magic 01 00 08 02"),
    (lambda raw: raw[:2] + b"\x0a" + raw[3:], "unknown IDX dtype code 0x0A"),
    (lambda raw: raw[:3] + b"\x00" + raw[4:], "ndim=0"),
    (lambda raw: raw[:3] + b"\x05" + raw[4:], "ndim=5"),
    (lambda raw: raw[:6], "truncated header"),
    (lambda raw: raw[:-1], "truncated payload"),
    (lambda raw: raw + b"\x00\x00", "2 extra bytes after the payload"),
    (lambda raw: raw[:3], "too short"),
    (lambda raw: b"", "too short"),
    (lambda raw: gzip.compress(raw)[:-9], "corrupt or truncated gzip"),
    (lambda raw: gzip.compress(raw)[:-4] + b"\xff\xff\xff\xff", "corrupt or truncated gzip"),
    (lambda raw: gzip.compress(raw) + b"garbage", "corrupt or truncated gzip"),
])
def test_read_idx_rejects_corrupt_files(tmp_path, mutate, problem):
  raw = _idx_bytes(tmp_path, np.arange(12, dtype=np.uint8).reshape(3, 4))
  bad = tmp_path / "bad-file.idx"
  bad.write_bytes(mutate(raw))
  with pytest.raises(DatasetError, match=problem) as info:
    datasets.read_idx(bad)
  assert str(bad) in str(info.value)
  assert isinstance(info.value, errors.JdistError) and isinstance(info.value, ValueError)


def test_read_idx_missing_file_names_it(tmp_path):
  with pytest.raises(DatasetError, match="nope.idx: cannot read"):
    datasets.read_idx(tmp_path / "nope.idx")


@pytest.mark.timeout(60)
def test_read_idx_fuzz_never_raises_anything_else(tmp_path):
  rng = np.random.default_rng(1234)
  valid = [_idx_bytes(tmp_path, np.arange(60, dtype=dtype).reshape(shape), compress)
           for dtype, shape in [(np.uint8, (3, 4, 5)), (np.int16, (60,)), (np.float64, (6, 10))]
           for compress in (False, True)]
  path = tmp_path / "fuzz.idx"
  outcomes = {"error": 0, "array": 0}
  for case in range(400):
    kind = case % 4
    base = valid[rng.integers(len(valid))]
    if kind == 0:  # Random bytes, sometimes behind a plausible magic.
      raw = rng.bytes(int(rng.integers(0, 64)))
      if rng.random() < 0.5:
        raw = bytes([0, 0, int(rng.choice([8, 9, 11, 12, 13, 14])), int(rng.integers(0, 6))]) + raw
    elif kind == 1:  # Truncated valid files.
      raw = base[:int(rng.integers(0, len(base)))]
    elif kind == 2:  # Valid files with a few bytes flipped.
      raw = bytearray(base)
      for position in rng.integers(0, len(raw), size=int(rng.integers(1, 4))):
        raw[position] ^= int(rng.integers(1, 256))
      raw = bytes(raw)
    else:  # Gzip streams of random or damaged content, maybe truncated.
      raw = gzip.compress(rng.bytes(int(rng.integers(0, 40))) if rng.random() < 0.5 else base)
      raw = raw[:int(rng.integers(1, len(raw) + 1))]
    path.write_bytes(raw)
    try:
      array = datasets.read_idx(path)
    except DatasetError as error:
      assert str(path) in str(error)
      outcomes["error"] += 1
    else:
      assert isinstance(array, np.ndarray) and 1 <= array.ndim <= 4
      outcomes["array"] += 1
  assert outcomes["error"] > 200 and outcomes["array"] > 0


# --- MNIST-format loaders ---------------------------------------------------


def test_fashion_mnist_from_data_dir(tmp_path):
  arrays = _write_dataset(tmp_path / "data")
  _check_matches(datasets.load_fashion_mnist(tmp_path / "data", download=False),
                 arrays, "fashion_mnist")


def test_mnist_from_named_subdirectory_with_raw_files(tmp_path):
  arrays = _write_dataset(tmp_path / "data" / "mnist", gzip_files=False)
  _check_matches(datasets.load("mnist", tmp_path / "data", download=False), arrays, "mnist")


def test_cache_is_searched_after_data_dir(tmp_path):
  cached = _write_dataset(tmp_path / "cache" / "mnist", seed=1)
  _check_matches(datasets.load_mnist(download=False), cached, "mnist")
  _check_matches(datasets.load_mnist(tmp_path / "empty", download=False), cached, "mnist")
  preferred = _write_dataset(tmp_path / "mine", seed=2)
  _check_matches(datasets.load_mnist(tmp_path / "mine", download=False), preferred, "mnist")


def test_system_directory_is_searched(tmp_path, monkeypatch):
  arrays = _write_dataset(tmp_path / "usr-share")
  monkeypatch.setitem(datasets.SYSTEM_DIRS, "fashion_mnist", [str(tmp_path / "usr-share")])
  _check_matches(datasets.load("fashion-mnist", download=False), arrays, "fashion_mnist")


def test_download_from_local_server_into_cache(tmp_path, monkeypatch, http_root):
  root, url, requests = http_root
  arrays = _write_dataset(root / "fashion")
  dead = _closed_port_url()
  monkeypatch.setitem(datasets.MIRRORS, "fashion_mnist", [dead, url + "fashion/"])
  dataset = datasets.load_fashion_mnist()
  _check_matches(dataset, arrays, "fashion_mnist")
  assert len(requests) == 4
  cache = tmp_path / "cache" / "fashion_mnist"
  assert sorted(p.name for p in cache.iterdir()) == sorted(
      f"{stem}.gz" for stem in datasets.IDX_FILES.values())
  # The second load reads the cache: no request, no mirror needed.
  monkeypatch.setitem(datasets.MIRRORS, "fashion_mnist", [])
  _check_matches(datasets.load_fashion_mnist(download=False), arrays, "fashion_mnist")
  assert len(requests) == 4


def test_download_only_fetches_missing_files(tmp_path, monkeypatch, http_root):
  root, url, requests = http_root
  arrays = _write_dataset(root)
  cache = tmp_path / "cache" / "mnist"
  cache.mkdir(parents=True)
  stem = datasets.IDX_FILES["train_x"]
  (cache / f"{stem}.gz").write_bytes((root / f"{stem}.gz").read_bytes())
  monkeypatch.setitem(datasets.MIRRORS, "mnist", [url])
  _check_matches(datasets.load_mnist(), arrays, "mnist")
  assert len(requests) == 3 and f"/{stem}.gz" not in requests


def test_corrupt_download_never_reaches_the_cache(tmp_path, monkeypatch, http_root):
  root, url, _ = http_root
  _write_dataset(root)
  stem = datasets.IDX_FILES["test_x"]
  served = root / f"{stem}.gz"
  served.write_bytes(served.read_bytes()[:-20])  # A cut-off transfer.
  monkeypatch.setitem(datasets.MIRRORS, "mnist", [url])
  with pytest.raises(DatasetError) as info:
    datasets.load_mnist()
  message = str(info.value)
  assert f"{url}{stem}.gz" in message and "corrupt or truncated gzip" in message
  cache = tmp_path / "cache" / "mnist"
  names = sorted(p.name for p in cache.iterdir())
  # The good files fetched before it are kept for next time; nothing else.
  assert names == sorted(f"{datasets.IDX_FILES[f]}.gz" for f in ("train_x", "train_y"))


def test_missing_everywhere_lists_places_and_fixes(tmp_path, monkeypatch):
  monkeypatch.setitem(datasets.SYSTEM_DIRS, "fashion_mnist", [str(tmp_path / "system")])
  partial = tmp_path / "data"
  _write_dataset(partial)
  (partial / f"{datasets.IDX_FILES['test_y']}.gz").unlink()
  with pytest.raises(DatasetError) as info:
    datasets.load_fashion_mnist(partial, download=False)
  message = str(info.value)
  for expected in (str(partial), "missing t10k-labels-idx1-ubyte[.gz]",
                   str(tmp_path / "cache" / "fashion_mnist"), "JDIST_DATA",
                   str(tmp_path / "system"), "no such directory",
                   "not tried (download=False)",
                   "apt-get install dataset-fashion-mnist", "--data-dir"):
    assert expected in message, expected


def test_a_directory_without_any_file_says_all_four_are_missing(tmp_path, monkeypatch):
  monkeypatch.setitem(datasets.SYSTEM_DIRS, "fashion_mnist", [])
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(DatasetError) as info:
    datasets.load_fashion_mnist(empty, download=False)
  assert f"{empty} (" in str(info.value) and "missing all four files" in str(info.value)
  assert "missing none" not in str(info.value)


def test_offline_download_failure_is_reported(tmp_path):
  with pytest.raises(DatasetError) as info:
    datasets.load_mnist()
  message = str(info.value)
  assert "Download: failed" in message and "train-images-idx3-ubyte.gz" in message
  assert "apt-get" not in message  # No Debian package holds MNIST.


def test_corrupt_local_file_is_named(tmp_path):
  _write_dataset(tmp_path / "data")
  bad = tmp_path / "data" / f"{datasets.IDX_FILES['train_y']}.gz"
  bad.write_bytes(bad.read_bytes()[:10])
  with pytest.raises(DatasetError, match=str(bad)):
    datasets.load_mnist(tmp_path / "data", download=False)


def test_mismatched_labels_are_rejected(tmp_path):
  _write_dataset(tmp_path / "data")
  datasets.write_idx(tmp_path / "data" / f"{datasets.IDX_FILES['test_y']}.gz",
                     np.zeros(5, np.uint8))
  with pytest.raises(DatasetError, match="expected 6 uint8 labels"):
    datasets.load_mnist(tmp_path / "data", download=False)


def test_real_debian_fashion_mnist(monkeypatch):
  """Checks the loader against the files of Debian's dataset-fashion-mnist."""
  if not DEBIAN_FASHION_MNIST.is_dir():
    message = f"{DEBIAN_FASHION_MNIST} missing: apt-get install dataset-fashion-mnist"
    if os.environ.get("CI"):
      pytest.fail(message)  # CI installs the package; its absence is a bug.
    pytest.skip(message)
  monkeypatch.setattr(datasets, "SYSTEM_DIRS", REAL_SYSTEM_DIRS)
  dataset = datasets.load_fashion_mnist(download=False)
  assert dataset.train_x.shape == (60000, 28, 28, 1)
  assert dataset.test_x.shape == (10000, 28, 28, 1)
  assert np.bincount(dataset.train_y).tolist() == [6000] * 10
  assert np.bincount(dataset.test_y).tolist() == [1000] * 10
  assert dataset.train_x.min() == 0.0 and dataset.train_x.max() == 1.0


# --- Datasets without files --------------------------------------------------


def test_digits_shapes_ranges_and_determinism():
  dataset = datasets.load("digits")
  assert dataset.name == "digits" and dataset.num_classes == 10
  assert dataset.train_x.shape == (1437, 8, 8, 1) and dataset.test_x.shape == (360, 8, 8, 1)
  assert dataset.train_x.dtype == np.float32 and dataset.test_y.dtype == np.int32
  assert dataset.train_x.min() == 0.0 and dataset.train_x.max() == 1.0
  # Stratified: every class is in the test split in proportion.
  assert np.bincount(dataset.test_y, minlength=10).min() >= 35
  again = datasets.load_digits()
  for first, second in zip(dataset[:4], again[:4]):
    np.testing.assert_array_equal(first, second)
  other = datasets.load_digits(seed=1)
  assert not np.array_equal(dataset.test_y, other.test_y)


def test_digits_split_is_cached_and_equals_scikit_learns(monkeypatch, tmp_path):
  monkeypatch.setenv(datasets.CACHE_ENV, str(tmp_path / "cache"))
  first = datasets.load_digits(seed=2)  # split by scikit-learn, then cached
  cached = list((tmp_path / "cache" / "digits").glob("split-test360-seed2-sklearn*.npz"))
  assert len(cached) == 1
  monkeypatch.setattr(datasets, "_split_digits", lambda *args: pytest.fail("not read from the cache"))
  again = datasets.load_digits(seed=2)
  for field in ("train_x", "train_y", "test_x", "test_y"):
    assert getattr(again, field).dtype == getattr(first, field).dtype
    np.testing.assert_array_equal(getattr(again, field), getattr(first, field))
  assert again.name == "digits" and again.num_classes == 10


def test_a_corrupt_or_unwritable_digits_cache_still_loads_the_split(monkeypatch, tmp_path):
  monkeypatch.setenv(datasets.CACHE_ENV, str(tmp_path / "cache"))
  reference = datasets._split_digits(100, 0)  # pylint: disable=protected-access
  target = datasets._digits_cache_file(100, 0)  # pylint: disable=protected-access
  target.parent.mkdir(parents=True)
  for corrupt in (b"not an npz", b"PK\x03\x04 a cut-off zip"):
    target.write_bytes(corrupt)
    np.testing.assert_array_equal(datasets.load_digits(test_size=100).test_y, reference.test_y)
  with np.load(target) as arrays:  # replaced by a whole file
    np.testing.assert_array_equal(arrays["train_x"], reference.train_x)
  blocked = tmp_path / "file"
  blocked.write_text("")
  monkeypatch.setenv(datasets.CACHE_ENV, str(blocked))  # the cache's directory cannot exist
  np.testing.assert_array_equal(datasets.load_digits(test_size=100).train_y, reference.train_y)


def test_synthetic_is_seeded_and_learnable():
  dataset = datasets.synthetic(num_train=500, num_test=100, seed=3)
  assert dataset.train_x.shape == (500, 8, 8, 1) and dataset.test_y.shape == (100,)
  assert 0.0 <= dataset.train_x.min() and dataset.train_x.max() <= 1.0
  np.testing.assert_array_equal(dataset.train_x, datasets.synthetic(500, 100, seed=3).train_x)
  # Nearest class mean classifies the test split well: the classes separate.
  flat = dataset.train_x.reshape(500, -1)
  means = np.stack([flat[dataset.train_y == c].mean(0) for c in range(10)])
  distances = ((dataset.test_x.reshape(100, 1, -1) - means) ** 2).sum(-1)
  assert (distances.argmin(1) == dataset.test_y).mean() > 0.9


def test_unknown_name_lists_valid_names():
  with pytest.raises(ValueError, match="digits, mnist, fashion_mnist, synthetic"):
    datasets.load("cifar10")
