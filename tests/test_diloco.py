"""diloco (DiLoCo, Streaming DiLoCo) and local_sgd (post-local SGD).

Every mode is compared with a single-process reference of the same
algorithm: the K replicas of the job emulated on one device, each on its own
slice of the global batch, with the schedule written as plain Python
integers. The reference shares only optax (inner and outer optimizers) and
the fragment plan (tested on its own) with the implementation.
"""

import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist.transforms import diloco as diloco_lib
from tests import reference

PER_REPLICA = 4
STEPS = 9


def _setup(topo, seed=0):
  model = reference.TinyMLP()
  x0, _ = reference.global_batch(1, 1)
  params = model.init(jax.random.key(seed), x0)
  batches = [reference.global_batch(topo.replica_count, PER_REPLICA, seed=s) for s in range(4)]
  return model, params, batches


def _worker_grads(model, workers, x, y, rows=PER_REPLICA):
  grad = jax.jit(jax.grad(lambda p, xs, ys: reference.loss_fn(model, p, xs, ys)))
  return [grad(p, x[k * rows:(k + 1) * rows], y[k * rows:(k + 1) * rows])
          for k, p in enumerate(workers)]


def _mean(trees):
  return jax.tree.map(lambda *xs: np.mean(np.stack([np.asarray(x) for x in xs]), axis=0), *trees)


def _round_trip(x, bits, block=256):
  """x (flat float32) sent as `bits`-bit levels: max-abs scale per block, nearest level."""
  top = 127 if bits == 8 else 7
  rows = np.pad(x, (0, -x.size % block)).reshape(-1, block)
  scale = np.abs(rows).max(axis=1, keepdims=True)
  levels = np.round(np.abs(rows) / np.where(scale > 0, scale, 1) * top) * np.sign(rows)
  return (levels * (scale / top)).reshape(-1)[:x.size]


def reference_diloco(model, params, inner, outer, batches, steps, replicas, *, sync_every,
                     fragments=1, delay=0, mix=0.0, per_worker=PER_REPLICA, bits=None,
                     error_feedback=True, round_trip=None):
  """K workers on one device: inner steps, staggered fragment syncs, delayed outer steps.

  With `bits`, each worker sends its fragment's pseudo-gradient (plus its
  residual) as levels (`_round_trip`) and keeps what they missed; with
  `round_trip` (flat float32 -> what is decoded of it), as that encoding.
  Returns the workers, the outer parameters and the workers' residual leaves.
  """
  leaves, treedef = jax.tree.flatten(params)
  plan = diloco_lib.fragment_plan([leaf.size for leaf in leaves], fragments)
  offsets = [(p + 1) * sync_every // fragments % sync_every for p in range(fragments)]
  workers = [params] * replicas
  inner_states = [inner.init(params)] * replicas
  outer_leaves = list(leaves)
  outer_states = [outer.init([leaves[i] for i in frag]) for frag in plan]
  residuals = [[np.zeros(leaf.shape, np.float32) for leaf in leaves] for _ in range(replicas)]
  in_flight = {}
  for t in range(steps):
    s = t + 1
    x, y = batches[t % len(batches)]
    grads = _worker_grads(model, workers, x, y, per_worker)
    for k in range(replicas):
      updates, inner_states[k] = inner.update(grads[k], inner_states[k], workers[k])
      workers[k] = optax.apply_updates(workers[k], updates)
    for p, frag in enumerate(plan):
      if s % sync_every == offsets[p]:
        local = [jax.tree.leaves(w) for w in workers]
        sent = [[np.asarray(outer_leaves[i]) - np.asarray(w[i]) for i in frag] for w in local]
        if bits or round_trip:
          for k in range(replicas):
            x = np.concatenate([(d + residuals[k][i]).ravel() for d, i in zip(sent[k], frag)])
            decoded = round_trip(x) if round_trip else _round_trip(x, bits)
            cuts = np.cumsum([residuals[k][i].size for i in frag])[:-1]
            missed = np.split(x - decoded, cuts) if error_feedback else np.split(0 * x, cuts)
            sent[k] = [part.reshape(d.shape) for part, d in zip(np.split(decoded, cuts), sent[k])]
            for i, part in zip(frag, missed):
              residuals[k][i] = part.reshape(residuals[k][i].shape)
        in_flight[p] = [jnp.asarray(np.mean([sent[k][j] for k in range(replicas)], axis=0))
                        for j in range(len(frag))]
      if s - delay >= 1 and (s - delay) % sync_every == offsets[p]:
        mine = [outer_leaves[i] for i in frag]
        steps_p, outer_states[p] = outer.update(in_flight.pop(p), outer_states[p], mine)
        for i, new in zip(frag, optax.apply_updates(mine, steps_p)):
          outer_leaves[i] = new
          for k in range(replicas):
            local = jax.tree.leaves(workers[k])
            local[i] = mix * local[i] + (1.0 - mix) * new
            workers[k] = jax.tree.unflatten(treedef, local)
  return workers, jax.tree.unflatten(treedef, outer_leaves), residuals


def reference_local_sgd(model, params, inner, batches, steps, replicas, *, sync_every,
                        warmup_steps):
  workers = [params] * replicas
  inner_states = [inner.init(params)] * replicas
  for t in range(steps):
    x, y = batches[t % len(batches)]
    grads = _worker_grads(model, workers, x, y)
    if t < warmup_steps:
      grads = [_mean(grads)] * replicas
    for k in range(replicas):
      updates, inner_states[k] = inner.update(grads[k], inner_states[k], workers[k])
      workers[k] = optax.apply_updates(workers[k], updates)
    if t >= warmup_steps and (t + 1 - warmup_steps) % sync_every == 0:
      workers = [_mean(workers)] * replicas
  return workers


def _check_replicas(topo, replicated, workers, atol=1e-6):
  for device, replica in enumerate(topo.replica_indices):
    reference.assert_trees_close(jax.tree.map(lambda x: x[device], replicated),
                                 workers[replica], rtol=1e-5, atol=atol)


def check_encoded_run(topo, replicated, state, workers, outer_params, residuals):
  """A run with an error-feedback payload against `reference_diloco`'s: workers,
  outer parameters and every replica's residual; some residual is not zero."""
  _check_replicas(topo, replicated, workers, atol=1e-5)
  for device, replica in enumerate(topo.replica_indices):
    reference.assert_trees_close(jax.tree.map(lambda x: x[device], state.outer_params),
                                 outer_params, atol=1e-5)
    # Each replica keeps its own residual: what its last encodings missed.
    mine = jax.tree.leaves(jax.tree.map(lambda x: x[device], state.residual))
    for got, want in zip(mine, residuals[replica]):
      np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-6)
  assert any(np.abs(r).max() > 0 for r in residuals[0])


CASES = {
    "diloco": dict(sync_every=3),
    "streaming": dict(sync_every=4, fragments=2),
    "streaming_delay_mix": dict(sync_every=4, fragments=3, delay=1, mix=0.5),
    "delay": dict(sync_every=3, delay=2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_diloco_matches_emulated_workers(topo, case):
  model, params, batches = _setup(topo)
  inner = optax.adam(1e-2) if "streaming" in case else optax.sgd(0.1, momentum=0.9)
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  tx = jdist.diloco(inner, outer=outer, **CASES[case])
  replicated, state = reference.train_jdist(model, params, tx, batches, STEPS, topo,
                                            PER_REPLICA)
  workers, outer_params, _ = reference_diloco(model, params, inner, outer, batches, STEPS,
                                           topo.replica_count, **CASES[case])
  _check_replicas(topo, replicated, workers)
  # The outer parameters are the same on every replica and match the reference's.
  for device in range(topo.local_device_count):
    reference.assert_trees_close(jax.tree.map(lambda x: x[device], state.outer_params),
                                 outer_params)
  fragments = CASES[case].get("fragments", 1)
  expected_syncs = sum(1 for s in range(1, STEPS + 1) for o in
                       diloco_lib.sync_offsets(CASES[case]["sync_every"], fragments)
                       if s % CASES[case]["sync_every"] == o)
  assert np.all(np.asarray(state.syncs) == expected_syncs)


def test_diloco_default_outer_and_16bit_payload(topo):
  model, params, batches = _setup(topo, seed=3)
  inner = optax.sgd(0.1)
  tx = jdist.diloco(inner, sync_every=2, payload="bf16")
  replicated, _ = reference.train_jdist(model, params, tx, batches, 6, topo, PER_REPLICA)
  workers, _, _ = reference_diloco(model, params, inner, optax.sgd(0.7, momentum=0.9, nesterov=True),
                                batches, 6, topo.replica_count, sync_every=2)
  # bfloat16 keeps 8 bits of mantissa: the pseudo-gradient is off by up to 2^-8 of itself.
  for device, replica in enumerate(topo.replica_indices):
    reference.assert_trees_close(jax.tree.map(lambda x: x[device], replicated),
                                 workers[replica], rtol=2e-2, atol=2e-3)


QUANTIZED_CASES = {
    "int8": dict(sync_every=3, fragments=2, delay=1, mix=0.5),
    "int4": dict(sync_every=3),
}


@pytest.mark.parametrize("payload", sorted(QUANTIZED_CASES))
def test_quantized_payload_with_error_feedback_matches_emulated_workers(topo, payload):
  model, params, batches = _setup(topo, seed=5)
  inner, outer = optax.sgd(0.1, momentum=0.9), optax.sgd(0.7, momentum=0.9, nesterov=True)
  settings, bits = QUANTIZED_CASES[payload], int(payload[3:])
  tx = jdist.diloco(inner, outer=outer, payload=payload, **settings)
  steps = 6  # each fragment exchanges twice: the second adds the first's residual
  replicated, state = reference.train_jdist(model, params, tx, batches, steps, topo,
                                            PER_REPLICA)
  workers, outer_params, residuals = reference_diloco(
      model, params, inner, outer, batches, steps, topo.replica_count, bits=bits, **settings)
  check_encoded_run(topo, replicated, state, workers, outer_params, residuals)
  # Dropping the error feedback moves the workers 10x the tolerance above or
  # more, so the comparison fails if the residual is not carried.
  no_feedback, _, _ = reference_diloco(model, params, inner, outer, batches, steps,
                                       topo.replica_count, bits=bits, error_feedback=False,
                                       **settings)
  gap = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
            for a, b in zip(jax.tree.leaves(workers[0]), jax.tree.leaves(no_feedback[0])))
  assert gap > 1e-4


@pytest.mark.parametrize("warmup", [0, 3])
def test_local_sgd_matches_emulated_workers(topo, warmup):
  model, params, batches = _setup(topo, seed=1)
  inner = optax.sgd(0.1, momentum=0.9)
  tx = jdist.local_sgd(inner, sync_every=2, warmup_steps=warmup)
  replicated, state = reference.train_jdist(model, params, tx, batches, STEPS, topo,
                                            PER_REPLICA)
  workers = reference_local_sgd(model, params, inner, batches, STEPS, topo.replica_count,
                                sync_every=2, warmup_steps=warmup)
  _check_replicas(topo, replicated, workers)
  assert np.all(np.asarray(state.syncs) == (STEPS - warmup) // 2)


def _bytes_per_step(topo, tx, steps):
  model, params, batches = _setup(topo)
  replicated = jdist.replicate(params)
  opt_state = jdist.data_parallel(tx.init)(replicated)
  step = jdist.data_parallel(reference.train_step_fn(model, tx))
  sent = []
  for i in range(steps):
    x, y = batches[i % len(batches)]
    replicated, opt_state = step(replicated, opt_state,
                                 reference.local_slices(x, topo, PER_REPLICA),
                                 reference.local_slices(y, topo, PER_REPLICA))
    sent.append(float(jdist.wire_bytes(jdist.unreplicate(opt_state))))
  return sent


@pytest.mark.parametrize("fragments", [1, 2])
def test_bytes_per_inner_step_are_one_hth_of_plain(topo, fragments):
  sync_every = 4
  plain = _bytes_per_step(topo, jdist.dist_opt(optax.sgd(0.1)), 1)[0]
  sent = _bytes_per_step(topo, jdist.diloco(optax.sgd(0.1), sync_every=sync_every,
                                            fragments=fragments), 2 * sync_every)
  half = _bytes_per_step(topo, jdist.diloco(optax.sgd(0.1), sync_every=sync_every,
                                            payload="fp16"), sync_every)
  # 8/4-bit: checked with 2 fragments, each quantized on its own (fewer compiles).
  levels = {bits: _bytes_per_step(topo, jdist.diloco(optax.sgd(0.1), sync_every=sync_every,
                                                     fragments=fragments,
                                                     payload=f"int{bits}"), sync_every)
            for bits in ((8, 4) if fragments == 2 else ())}
  if topo.process_count == 1:  # nothing crosses processes
    assert plain == sum(sent) == sum(half) == sum(sum(b) for b in levels.values()) == 0
    return
  # Only sync steps send, each fragment once per H steps: the model once per H steps.
  assert sum(1 for b in sent if b) == 2 * fragments
  assert sum(sent) / len(sent) == pytest.approx(plain / sync_every, rel=1e-3)
  assert sum(half) / len(half) == pytest.approx(plain / sync_every / 2, rel=1e-2)
  # 8/4-bit: every replica's levels (1 or 1/2 byte per value, padded to blocks of
  # 256) and a float32 scale per block, all-gathered: each process receives the
  # other processes' devices' bytes. Plain all-reduces 2 (P - 1) / P * 4 bytes a value.
  # In H steps each fragment is sent once, quantized on its own.
  leaves = jax.tree.leaves(_setup(topo)[1])
  plan = diloco_lib.fragment_plan([leaf.size for leaf in leaves], fragments)
  blocks = [-(-sum(leaves[i].size for i in part) // 256) for part in plan]
  gathered = (topo.process_count - 1) * topo.local_device_count
  for bits, sent_q in levels.items():
    assert sum(1 for b in sent_q if b) == fragments
    assert sum(sent_q) == gathered * sum(b * 256 * bits // 8 + 4 * b for b in blocks)


def test_state_is_checkpointable_and_resumes_exactly(topo):
  model, params, batches = _setup(topo, seed=2)
  # With a 4-bit payload the state also holds the residual of error feedback.
  tx = jdist.diloco(optax.adam(1e-2), sync_every=3, fragments=2, delay=1, payload="int4")
  replicated, state = reference.train_jdist(model, params, tx, batches, 4, topo, PER_REPLICA)
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(state))
  assert any(np.abs(np.asarray(leaf)).max() > 0 for leaf in jax.tree.leaves(state.residual))
  restored = reference.checkpoint_round_trip(topo, {"params": replicated, "opt_state": state})
  step = jdist.data_parallel(reference.train_step_fn(model, tx))
  original, again = (replicated, state), (restored["params"], restored["opt_state"])
  for i in range(4, 8):  # through a sync and a delayed outer step
    x, y = (reference.local_slices(a, topo, PER_REPLICA) for a in batches[i % len(batches)])
    original, again = step(*original, x, y), step(*again, x, y)
  for a, b in zip(jax.tree.leaves(original), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_arguments_are_checked_when_built():
  sgd = optax.sgd(0.1)
  with pytest.raises(ValueError, match="sync_every=0"):
    jdist.diloco(sgd, sync_every=0)
  with pytest.raises(ValueError, match="fragments=5"):
    jdist.diloco(sgd, sync_every=4, fragments=5)
  with pytest.raises(ValueError, match="delay=4"):
    jdist.diloco(sgd, sync_every=4, delay=4)
  with pytest.raises(ValueError, match="mix=1.0"):
    jdist.diloco(sgd, sync_every=4, mix=1.0)
  with pytest.raises(ValueError, match="payload='int3' must be None or one of 'float32', "
                     "'bf16', 'fp16', 'int8', 'int4'"):
    jdist.diloco(sgd, sync_every=4, payload="int3")
  with pytest.raises(ValueError, match="payload=8"):
    jdist.diloco(sgd, sync_every=4, payload=8)
  with pytest.raises(ValueError, match="inner="):
    jdist.diloco("sgd", sync_every=4)
  with pytest.raises(ValueError, match="outer="):
    jdist.diloco(sgd, sync_every=4, outer=0.7)
  with pytest.raises(ValueError, match="warmup_steps=-1"):
    jdist.local_sgd(sgd, sync_every=2, warmup_steps=-1)
  with pytest.raises(ValueError, match="fragments=3 is more than the 2"):
    jdist.diloco(sgd, sync_every=4, fragments=3).init({"a": jnp.ones(2), "b": jnp.ones(3)})


def test_fragment_plan_and_offsets():
  assert diloco_lib.fragment_plan([2048, 32, 320, 10], 2) == [[0], [1, 2, 3]]
  assert diloco_lib.fragment_plan([5, 5, 5], 3) == [[0], [1], [2]]
  assert diloco_lib.sync_offsets(8, 1) == [0]
  assert diloco_lib.sync_offsets(8, 4) == [2, 4, 6, 0]


# `jdist train --diloco H` and `--local-sgd H` (the pattern of tests/test_cli.py).

@pytest.fixture
def rank0(monkeypatch):
  """Parses as the launcher's rank 0 (under mpirun, only rank 0 prints usage errors)."""
  monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")


@pytest.mark.parametrize("argv, message", [
    (["--diloco", "0"], r"diloco \(--diloco\)=0 must be an integer >= 1"),
    (["--diloco", "4", "--diloco-fragments", "5"], r"--diloco-fragments\)=5 must be <= --diloco 4"),
    (["--diloco-fragments", "2"], r"only apply with --diloco H"),
    (["--diloco-payload", "int8"], r"only apply with --diloco H"),
    (["--diloco-delay", "2"], r"--diloco-delay and --diloco-mix only apply with --diloco H"),
    (["--diloco", "4", "--diloco-delay", "4"],
     r"diloco_delay \(--diloco-delay\)=4 must be < --diloco 4"),
    (["--diloco", "4", "--diloco-delay", "-1"], r"\(--diloco-delay\)=-1 must be an integer >= 0"),
    (["--diloco", "4", "--diloco-mix", "1"],
     r"diloco_mix \(--diloco-mix\)=1.0 must be a number in \[0, 1\)"),
    (["--diloco", "4", "--diloco-payload", "int3"],
     r"--diloco-payload\)='int3' is not one of .*int8, int4, sparse or sparse:RATIO"),
    (["--diloco", "4", "--diloco-payload", "int4", "--half", "bf16"],
     r"--half bf16 and --diloco-payload int4 both set"),
    (["--diloco", "4", "--diloco-outer-lr", "0"], r"diloco_outer_lr \(--diloco-outer-lr\)=0.0"),
    (["--diloco", "4", "--diloco-outer-momentum", "1"],
     r"diloco_outer_momentum \(--diloco-outer-momentum\)=1.0 must be a number in \[0, 1\)"),
    (["--diloco-outer-momentum", "0.5"], r"--diloco-outer-momentum, --diloco-backoff, .* only "
     r"apply with --diloco H"),
    (["--diloco-backoff"], r"only apply with --diloco H"),
    (["--diloco", "4", "--powersgd", "2"], r"--diloco .* cannot be combined with --powersgd"),
    (["--diloco", "4", "--local-sgd", "2"], r"cannot be combined with --local-sgd"),
    (["--local-sgd", "2", "--half", "fp16"], r"--local-sgd .* cannot be combined with --half"),
    (["--local-sgd-warmup", "3"], r"only applies with --local-sgd H"),
])
def test_bad_flags_name_the_flag_and_exit_2(capsys, rank0, argv, message):
  from jdist.app import cli  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit) as stop:
    cli.parse_train_args(argv)
  assert stop.value.code == cli.EXIT_USAGE
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and err.startswith("jdist train: error: "), err
  assert re.search(message, err), err


def _train(topo, tmp_log, *flags):
  from jdist.app import cli  # pylint: disable=import-outside-toplevel
  from jdist.app import train as train_lib  # pylint: disable=import-outside-toplevel
  config, _ = cli.parse_train_args(
      ["--model", "mlp", "--epochs", "2", "--train-limit", "256", "--test-limit", "64",
       "--batch-size", str(64 // topo.replica_count), "--no-progress", "--log-file", tmp_log]
      + list(flags))
  return train_lib.train(config, return_state=True)


@pytest.mark.parametrize("flags, syncs", [
    (("--diloco", "4"), [1, 2]),
    (("--diloco", "4", "--diloco-fragments", "2", "--half", "bf16"), [2, 4]),
    (("--diloco", "4", "--diloco-payload", "int8"), [1, 2]),
    (("--local-sgd", "2", "--local-sgd-warmup", "2"), [1, 3]),
])
def test_jdist_train_reports_outer_syncs_and_bytes(topo, capsys, flags, syncs):
  log = tempfile.mktemp(suffix=".jsonl")
  plain = _train(topo, log)
  run = _train(topo, log, *flags)
  steps = plain["steps"] // 2  # per epoch: 256 examples in global batches of 64
  assert steps == 4 and run["steps"] == plain["steps"]
  assert [record["outer_syncs"] for record in run["epochs"]] == syncs
  assert all(np.isfinite(record["test_loss"]) for record in run["epochs"])
  printed = capsys.readouterr().out
  if topo.is_primary:
    assert f"{syncs[-1]} outer syncs so far" in printed
  bytes_plain = [record["wire_bytes_per_step"] for record in plain["epochs"]]
  bytes_run = [record["wire_bytes_per_step"] for record in run["epochs"]]
  if topo.process_count == 1:
    assert bytes_plain == bytes_run == [0.0, 0.0]
  else:
    # In 8 steps plain sends the model 8 times; diloco H=4 twice (in bf16: half the
    # bytes); local SGD twice in warm-up and 3 averagings. The loss sums are a few bytes.
    models = {"--diloco": 2 * (0.5 if "--half" in flags else 1.0), "--local-sgd": 5}[flags[0]]
    if "int8" in flags:  # all-gathered bytes: 1 a value + a 4-byte scale per 256, of
      # every other process's devices; plain's all-reduce, 2 (P - 1) / P * 4 a value.
      size = sum(leaf.size for leaf in jax.tree.leaves(run["state"]["params"]))
      blocks = -(-size // 256)
      models = 2 * ((topo.process_count - 1) * topo.local_device_count * 260 * blocks
                    / (2 * (topo.process_count - 1) / topo.process_count * 4 * size))
    assert sum(bytes_run) == pytest.approx(sum(bytes_plain) * models / 8, rel=0.01)
  # The model handed back is one model: the replicas' mean (checked by train itself).
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(run["state"]["params"]))


def test_diloco_in_a_global_jit_step(topo):
  # In a jit step over global arrays each process is one worker: XLA averages
  # the gradients over its devices, jdist's exchange runs between processes.
  model, params, batches = _setup(topo, seed=4)
  inner, outer = optax.sgd(0.1, momentum=0.9), optax.sgd(0.7, momentum=0.9, nesterov=True)
  settings = dict(sync_every=2, fragments=2, delay=1)
  tx = jdist.diloco(inner, outer=outer, **settings)
  step = jax.jit(reference.train_step_fn(model, tx))
  with jax.set_mesh(jdist.mesh()):
    state = jax.jit(tx.init)(params)
    local = params
    for i in range(5):
      x, y = batches[i % len(batches)]
      batch = jdist.shard_global_batch({"x": x, "y": y})
      local, state = step(local, state, batch["x"], batch["y"])
  rows = topo.local_device_count * PER_REPLICA  # one worker's rows: a process's
  workers, _, _ = reference_diloco(model, params, inner, outer, batches, 5, topo.process_count,
                                per_worker=rows, **settings)
  reference.assert_trees_close(jax.device_get(local), workers[topo.process_index])


# The divergence guard: DiLoCo's training loss rising across outer syncs.

def test_divergence_guard_alarms_when_the_windowed_loss_stays_up():
  from jdist.app.train_guard import DivergenceGuard  # pylint: disable=import-outside-toplevel
  # Windows of 3 periods: 1.17, 0.67, 0.5, then 0.83 and 1.17 are above 0.5 + max(50%, 0.25).
  means = [2.0, 1.0, 0.5, 0.5, 0.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]
  for repeat, want in ((False, [6]), (True, [6, 10])):
    guard, alarms = DivergenceGuard(2, repeat=repeat), []
    for period, mean in enumerate(means):  # two steps of 10 examples per period
      for step in (2 * period + 1, 2 * period + 2):
        if guard.observe(step, 10 * mean, 10.0):
          alarms.append(period)
    # An alarm clears the window: with repeat, the next needs 3 new periods, then 2
    # risen windows; without, none until the mean falls back under the threshold.
    assert alarms == want, (repeat, alarms)
  guard = DivergenceGuard(4)
  assert not any(guard.observe(step, 1.0, 1.0) for step in range(1, 40))  # flat: never
  # A healthy run's bumps at a low loss (a lucky 0.01 period, then 0.2s) stay under 0.25.
  guard, noisy = DivergenceGuard(1), [0.3, 0.1, 0.01, 0.05, 0.2, 0.2, 0.2, 0.05, 0.25, 0.2]
  assert not any(guard.observe(step + 1, mean, 1.0) for step, mean in enumerate(noisy))


def _diverging_run(topo, tmp_log, *flags):
  from jdist.app import cli  # pylint: disable=import-outside-toplevel
  from jdist.app import train as train_lib  # pylint: disable=import-outside-toplevel
  config, _ = cli.parse_train_args(
      ["--model", "mlp", "--epochs", "2", "--train-limit", "512", "--test-limit", "64",
       "--batch-size", str(32 // topo.replica_count), "--no-progress", "--log-file", tmp_log,
       "--diloco", "2", "--diloco-outer-lr", "3", "--diloco-outer-momentum", "0.9"]
      + list(flags))
  return train_lib.train(config, return_state=True)


@pytest.mark.parametrize("backoff", [False, True])
def test_a_diverging_outer_step_is_warned_and_backed_off(topo, capsys, backoff):
  """Outer lr 3, momentum 0.9 on an inner SGD with momentum 0.9: 300x the inner lr."""
  log = tempfile.mktemp(suffix=".jsonl")
  run = _diverging_run(topo, log, *(["--diloco-backoff"] if backoff else []))
  assert run["diverging_warnings"] >= 1
  printed = capsys.readouterr().out
  if topo.is_primary:
    warnings = [line for line in printed.splitlines()
                if "training loss is rising across outer syncs" in line]
    assert len(warnings) == run["diverging_warnings"], printed
    assert "--diloco-outer-lr" in warnings[0] and "--diloco-backoff" in warnings[0]
    if not backoff:
      assert "--diloco-outer-momentum (now 0.9)" in warnings[0]
    with open(log, encoding="utf-8") as stream:
      events = [line for line in stream if '"event": "diverging"' in line]
    assert len(events) == run["diverging_warnings"]
  if not backoff:
    assert run["outer_lr_backoffs"] == 0 and run["final_outer_lr"] == 3.0
    return
  # Each alarm halved the outer learning rate in the state, every replica alike.
  backoffs = run["outer_lr_backoffs"]
  assert backoffs == run["diverging_warnings"] >= 1
  assert run["final_outer_lr"] == pytest.approx(3.0 / 2 ** backoffs)
  states = [s for s in jax.tree.leaves(run["state"]["opt_state"],
                                       is_leaf=lambda x: isinstance(x, diloco_lib.DiLoCoState))
            if isinstance(s, diloco_lib.DiLoCoState)]
  lr = np.asarray(states[0].outer_states[0].hyperparams["learning_rate"])
  assert lr == pytest.approx(3.0 / 2 ** backoffs)
  if topo.is_primary:
    assert f"outer lr halved to {3.0 / 2 ** backoffs:g}" in printed


def test_scale_outer_lr_needs_the_rate_in_the_state():
  params = {"w": jnp.ones((3,))}
  plain = jdist.diloco(optax.sgd(0.1), sync_every=2)
  with pytest.raises(ValueError, match="inject_hyperparams"):
    diloco_lib.scale_outer_lr(plain.init(params), 0.5)
  with pytest.raises(ValueError, match="no jdist.diloco state"):
    diloco_lib.scale_outer_lr(optax.sgd(0.1).init(params), 0.5)
  outer = optax.inject_hyperparams(optax.sgd, static_args=("momentum", "nesterov"))(
      learning_rate=0.7, momentum=0.9, nesterov=True)
  state = jdist.diloco(optax.sgd(0.1), sync_every=2, outer=outer).init(params)
  state = state._replace(outer_states=tuple(
      s._replace(inner_state=jax.tree.map(jnp.ones_like, s.inner_state))
      for s in state.outer_states))
  halved = diloco_lib.scale_outer_lr(state, 0.5)
  assert float(halved.outer_states[0].hyperparams["learning_rate"]) == pytest.approx(0.35)
  assert all(float(jnp.abs(leaf).max()) == 0  # the outer momentum is cleared
             for leaf in jax.tree.leaves(halved.outer_states[0].inner_state))
