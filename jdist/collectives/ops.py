"""Reductions of pytrees over every replica, for use inside a pmapped step.

`psum`, `pmean` and `all_gather` reduce over every replica of the job: the
local devices of this process (XLA collectives over `DATA_AXIS`), then the
processes (a route's `sum_all`, `sum_all_16bit`, `gather_all`). Across processes a pytree travels fused: one
flat buffer per dtype and bucket, not one MPI call per leaf.

`reduce_payload` is what `jdist.allreduce` calls: it accepts the gradient
tree itself (a dense all-reduce) or a compressed payload, which reduces
itself through a `ReplicaExchange` (see `jdist.compression.protocol`): this
layer knows no compression format. `exchange` runs any such reduction, in
either kind of step.

Each public function finds where it is traced once (`context.reduce_where`)
and passes the resulting `context.Span` (route, axis, participants) down
explicitly. `on_route(name)` offers the same functions on another route than
the one `jdist.init()` chose, for measurements that compare routes in one job.

Before a pytree first crosses processes, its structure, shapes and dtypes are
compared across processes (at trace time, one small host exchange), so a
mismatch is an error on every rank that names the first differing leaf,
instead of a hang or silently mixed buffers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jdist.collectives.routes import base
from jdist.collectives import context
from jdist import fusion
from jdist.collectives import routes
from jdist.collectives.routes.base import DATA_AXIS
from jdist.collectives.routes.base import HALF_DTYPES
from jdist.runtime import flight_recorder
from jdist.runtime import job as job_lib


def require_data_parallel(what: str) -> None:
  """Raises a clear error unless traced in a data-parallel step (either kind).

  See `jdist.collectives.context`: a `jdist.data_parallel` step, or a jit
  step over global arrays under `jax.set_mesh(jdist.mesh())`.
  """
  context.in_global_step(what)


def _packs_buckets(span: context.Span, fuse_local: bool = False) -> bool:
  """Whether sums pack the tree into buckets: across processes, or when asked."""
  return fuse_local or span.route.name != "local"


def _fused(span: context.Span, tree: Any, what: str, reduce_buffer, bucket_bytes: int,
           fuse_local: bool = False, first_bucket_bytes: int = fusion.FIRST_BUCKET_BYTES) -> Any:
  """Applies `reduce_buffer(buffer, route, axis)` to the tree's leaves, fused into buckets.

  Within one process XLA already combines per-leaf all-reduces, so plain sums
  skip the concatenation there (`fuse_local=False`).
  """
  reduce_one = lambda buffer: reduce_buffer(buffer, span.route, span.axis)
  if not _packs_buckets(span, fuse_local):
    return jax.tree.map(lambda leaf: reduce_one(leaf.reshape(-1)).reshape(leaf.shape), tree)
  job_lib.check_structure(tree, what)
  leaves, treedef = jax.tree.flatten(tree)
  shapes = [leaf.shape for leaf in leaves]
  buckets = fusion.plan_buckets(leaves, bucket_bytes, first_bucket_bytes=first_bucket_bytes)
  reduced = [reduce_one(fusion.pack(leaves, bucket)) for bucket in buckets]
  # Read together, so a bucket's update cannot wait between two exchanges.
  reduced = list(base.join(span.route, tuple(reduced))) if len(reduced) > 1 else reduced
  out = {}
  for bucket, buffer in zip(buckets, reduced):
    out.update(fusion.unpack(buffer, bucket, shapes))
  return jax.tree.unflatten(treedef, [out[i] for i in range(len(leaves))])


def _sum_all(buffer: jax.Array, on: routes.Route, axis: str) -> jax.Array:
  return on.sum_all(buffer, axis)


def _psum(span: context.Span, tree: Any, bucket_bytes: int) -> Any:
  if not jax.tree.leaves(tree):
    return tree
  return _fused(span, tree, "jdist.psum", _sum_all, bucket_bytes)


def _pmean(span: context.Span, tree: Any, bucket_bytes: int) -> Any:
  as_float = jax.tree.map(
      lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32), tree)
  return _averaged(span, lambda t: _psum(span, t, bucket_bytes), as_float, span.participants)


def _all_gather(span: context.Span, tree: Any) -> Any:
  gathered = jax.tree.map(
      lambda leaf: span.route.gather_all(leaf.reshape(-1), span.axis).reshape(
          (-1,) + leaf.shape), tree)
  return context.gather_rows_per_process(gathered, span) if span.global_step else gathered


class Reductions:
  """`psum`, `pmean`, `all_gather`, `exchange` and `reduce_payload` on one route.

  `jdist.psum` and the others are this class's methods on the route
  `jdist.init()` chose (`route=None`); `on_route(name)` gives them on
  another, for measurements and tests that compare routes in one job.
  Every process must trace the same routes.
  """

  def __init__(self, route: str | routes.Route | None = None):
    if isinstance(route, str) and route not in routes.ROUTES:
      raise ValueError(f"route={route!r} is not a jdist route: choose one of "
                       f"{', '.join(routes.ROUTES)}, or None for the job's.")
    self.route = route

  def psum(self, tree: Any, *, bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES) -> Any:
    """See `jdist.psum`."""
    return context.reduce_where("jdist.psum", lambda span, t: _psum(span, t, bucket_bytes),
                                tree, route=self.route)

  def pmean(self, tree: Any, *, bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES) -> Any:
    """See `jdist.pmean`."""
    return context.reduce_where("jdist.pmean", lambda span, t: _pmean(span, t, bucket_bytes),
                                tree, route=self.route)

  def all_gather(self, tree: Any) -> Any:
    """See `jdist.all_gather`."""
    return context.reduce_where("jdist.all_gather", _all_gather, tree, first_only=False,
                                route=self.route)

  def exchange(self, reduce_fn, tree: Any, *, bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES,
               what: str = "jdist.allreduce") -> Any:
    """See `jdist.collectives.exchange`."""
    return context.reduce_where(
        what, lambda span, values: reduce_fn(ReplicaExchange(span, bucket_bytes, what), values),
        tree, route=self.route)

  def reduce_payload(self, updates: Any, *, mean: bool = True,
                     bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES) -> Any:
    """See `jdist.collectives.reduce_payload`."""
    def reduce(replicas: ReplicaExchange, values: Any) -> Any:
      factor = 1.0 / replicas.replicas if mean else 1.0
      if callable(getattr(type(values), "reduce_over_replicas", None)):
        with flight_recorder.scheme(type(values).SCHEME):
          return values.reduce_over_replicas(replicas, factor)
      if not mean:
        return replicas.sum(values)
      return _averaged(replicas.span, replicas.sum, values, replicas.replicas)

    return self.exchange(reduce, updates, bucket_bytes=bucket_bytes)


_JOBS_ROUTE = Reductions()


def on_route(route: str | routes.Route) -> Reductions:
  """The reductions of this module on route `route` instead of the job's.

  `route` is a route's name, or a `jdist.collectives.routes.Route` object
  (tests trace steps on routes built for them).

  Raises:
    ValueError: `route` is not a jdist route (one this job cannot take
      raises where the reduction is traced).
  """
  return Reductions(route)


def psum(tree: Any, *, bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES) -> Any:
  """Sum of `tree` over every replica (inside `jdist.data_parallel` or a jit step).

  Differentiable and batchable on every route, as `lax.psum` in a `pmap`:
  `jax.grad`, `jax.jvp`, `jax.vmap` and `lax.scan` work through it, and its
  transpose is again a sum over every replica. So a replica's gradient of
  `pmean(its local mean loss)` is its local loss's gradient, and averaging
  gradients over replicas (`jdist.allreduce`) gives one device's gradient on
  the whole batch, in every topology (see `jdist.collectives.routes.base`).
  """
  return _JOBS_ROUTE.psum(tree, bucket_bytes=bucket_bytes)


def pmean(tree: Any, *, bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES) -> Any:
  """Mean of `tree` over every replica; integer leaves are averaged as floats.

  Differentiable like `psum` (the transpose of a mean over replicas is the
  mean over replicas of the cotangents).
  """
  return _JOBS_ROUTE.pmean(tree, bucket_bytes=bucket_bytes)


def all_gather(tree: Any) -> Any:
  """Every replica's value of each leaf, stacked: leaves get a leading [R] axis.

  Replicas are in global order (process-major, then local device); in a
  global (jit) step, one row per process. Differentiable like
  `lax.all_gather`: a replica's cotangent is the sum over replicas of the
  cotangents of its row.
  """
  return _JOBS_ROUTE.all_gather(tree)


class ReplicaExchange:
  """The reductions over every replica a compressed payload may use.

  Implements `jdist.compression.protocol.Exchange` on the route's
  primitives, with tensor fusion across processes, on the route, axis and
  participants of `span`.
  """

  def __init__(self, span: context.Span, bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES,
               what: str = "jdist.allreduce"):
    self.span = span
    self.bucket_bytes = bucket_bytes
    self.what = what

  @property
  def replicas(self) -> int:
    return self.span.participants

  def sum(self, tree: Any) -> Any:
    if not jax.tree.leaves(tree):
      return tree
    return _fused(self.span, tree, self.what, _sum_all, self.bucket_bytes)

  def sum_16bit(self, tree: Any) -> Any:
    if not jax.tree.leaves(tree):
      return tree

    def reduce_buffer(buffer, on, axis):
      if buffer.dtype in HALF_DTYPES:
        return on.sum_all_16bit(buffer, axis)
      return on.sum_all(buffer, axis)

    # Half the caps: a bucket holds the gradients it would hold in float32,
    # so the first one still leaves while the backward pass goes on.
    return _fused(self.span, tree, f"{self.what} (16-bit)", reduce_buffer,
                  max(1, self.bucket_bytes // 2), fuse_local=True,
                  first_bucket_bytes=fusion.FIRST_BUCKET_BYTES // 2)

  def gather(self, buffer: jax.Array) -> jax.Array:
    if self.span.global_step:  # one value per process (`per_process`): each crosses once
      return self.gather_per_process(buffer)
    return self.span.route.gather_all(buffer, self.span.axis)

  @property
  def processes(self) -> int:
    return self.span.route.processes

  def gather_per_process(self, buffer: jax.Array) -> jax.Array:
    """See `protocol.Exchange`: each local device sends 1/D of the buffer, D per process."""
    span, size = self.span, buffer.shape[0]
    devices = span.route.devices
    device = lax.axis_index(span.axis)
    if span.global_step:  # only the mesh's first device holds the value (`per_process`)
      buffer = lax.psum(jnp.where(device == 0, buffer, jnp.zeros_like(buffer)), span.axis)
    width = -(-size // devices)
    part = lax.dynamic_slice(jnp.pad(buffer, (0, width * devices - size)), (device * width,),
                             (width,))
    rows = span.route.gather_all(part, span.axis)  # [P * D, width], process-major
    return rows.reshape(span.route.processes, devices * width)[:, :size]


def exchange(reduce_fn, tree: Any, *, bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES,
             what: str = "jdist.allreduce") -> Any:
  """Runs `reduce_fn(exchange, tree)` where it reduces over every replica.

  In a `jdist.data_parallel` step, directly; in a global (jit) step, once per
  process (see `context.per_process`: other devices than the mesh's first
  see zeros, so every sum counts each process once).

  Args:
    reduce_fn: (`ReplicaExchange`, tree) -> result, the same on every replica.
    tree: the step's values.
    bucket_bytes: fusion bucket size of the exchange's sums.
    what: named in errors (mismatched trees across processes, wrong context).

  Returns:
    `reduce_fn`'s result.
  """
  return _JOBS_ROUTE.exchange(reduce_fn, tree, bucket_bytes=bucket_bytes, what=what)


def _averaged(span: context.Span, summing, tree: Any, replicas: int) -> Any:
  """`summing(tree)` divided by `replicas`.

  Where the sum packs buckets (across processes), 32- and 64-bit floats are
  scaled before it: the multiply fuses into the packing instead of taking a
  pass of its own over the reduced buffer (measured: 2x2 16 MB mean 42.8 ->
  24.6 ms), and values near the largest float cannot overflow in the sum.
  Within one process the sum is XLA's all-reduce of each leaf, whose input
  a multiply would have to write first (an MLP step 1.13-1.29x the
  hand-written one's time): there the mean is `lax.pmean`'s, the sum divided
  after, fused into whatever reads it. 16-bit floats and integers are always
  divided after, where small values cannot underflow.
  """
  factor = 1.0 / replicas
  packs = _packs_buckets(span)

  def scaled_first(x):
    return packs and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize >= 4

  summed = summing(jax.tree.map(
      lambda x: x * jnp.asarray(factor, x.dtype) if scaled_first(x) else x, tree))
  return jax.tree.map(
      lambda x: x if scaled_first(x) else (x * factor).astype(x.dtype), summed)


def process_mean(tree: Any) -> Any:
  """The mean of `tree` over this process's replicas, the same on each of them.

  In a `jdist.data_parallel` step, XLA's mean over the local devices (no
  bytes cross processes); in a global (jit) step, and outside a step, where
  one process holds one value already, `tree` itself. A compressor that
  encodes once per process calls it before encoding, then sends its payload
  with `Exchange.gather_per_process`.
  """
  try:
    lax.axis_index(DATA_AXIS)
  except NameError:
    return tree
  return jax.tree.map(lambda x: lax.pmean(x, DATA_AXIS), tree)


def reduce_payload(updates: Any, *, mean: bool = True,
                   bucket_bytes: int = fusion.DEFAULT_BUCKET_BYTES) -> Any:
  """Sum or mean over every replica of a gradient tree or a compressed payload.

  Args:
    updates: a pytree of arrays, or a payload with a `reduce_over_replicas`
      method (`jdist.compression.protocol.WirePayload`).
    mean: divide by the replica count (else sum).
    bucket_bytes: fusion bucket size for dense and 16-bit exchanges.

  Returns:
    The reduced gradient tree, leaves in their original dtypes.
  """
  return _JOBS_ROUTE.reduce_payload(updates, mean=mean, bucket_bytes=bucket_bytes)
