"""jdist.tracing.counters: the compression ratio and residual norm in a timeline.

A short top-K run (and a plain one) inside `jdist.timeline`: each recorded
step's "residual norm" and "compression ratio" counters must equal what the
step's optimizer state says, computed here on the host from the state
itself. Under mpirun (2x1, 2x2) the watchdog times the real steps; in one
process (1x4), which has no watchdog, the test reports the steps to the
recorder as the watchdog would.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jdist
from jdist.tracing import counters as timeline_counters
from jdist.runtime import flight_recorder
from jdist.runtime import host

STEPS = 4


def _params():
  return {"w": jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16), "b": jnp.zeros((16,))}


def _loss(params, x):
  return jnp.mean(jnp.square(jnp.tanh(x @ params["w"] + params["b"])))


def _run(tx, path):
  """STEPS steps of `tx` recorded into `path`; per step, the host's reference counters."""
  topo = jdist.init()

  @jdist.data_parallel
  def step(params, opt_state, x):
    grads = jax.grad(_loss)(params, x)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = jdist.replicate(_params())
  opt_state = jdist.data_parallel(tx.init)(params)
  devices = topo.local_device_count
  fake = topo.process_count == 1  # no watchdog: report the steps as it would
  expected = []
  recorder = jdist.timeline(path)
  try:
    for number in range(1, STEPS + 1):
      offset = topo.process_index * devices + np.arange(devices)
      x = jnp.asarray(np.cos(np.arange(devices * 4 * 8).reshape(devices, 4, 8)
                             + offset[:, None, None] + number), jnp.float32)
      if fake:
        flight_recorder.step_dispatched(number, "step", 0, number)
      params, opt_state = step(params, opt_state, x)
      recorder.observe(opt_state, params)
      if fake:
        flight_recorder.step_done(number, 1000 * number, 1000 * number + 500)
      expected.append(_reference(opt_state, topo))
    jax.block_until_ready(params)
    recorder.close()
  finally:
    if fake:
      flight_recorder.reset()
  return expected


def _reference(opt_state, topo):
  """(residual norm or None, dense bytes, sent bytes) from the state, on the host."""
  states = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(
      n, jdist.SparsifyState)) if isinstance(s, jdist.SparsifyState)]
  norm = None
  if states:  # root mean square over this process's replicas of each one's norm
    residual = np.asarray(states[0].residual, np.float64)  # [local devices, n]
    norm = float(np.sqrt(np.mean(np.sum(residual ** 2, axis=1))))
  p = topo.process_count
  dense = 2 * (p - 1) / p * sum(leaf.size * 4 for leaf in jax.tree.leaves(_params()))
  sent = float(np.asarray(jdist.unreplicate(jdist.wire_bytes(opt_state))))
  return norm, dense, sent


def _counters(path, rank):
  """Per counter name, its values in step order on `rank`."""
  events = json.load(open(path, encoding="utf-8"))["traceEvents"]
  out = {}
  for e in sorted((e for e in events if e["ph"] == "C" and e["pid"] == rank),
                  key=lambda e: e["ts"]):
    out.setdefault(e["name"], []).append(e["args"])
  return out


@pytest.mark.parametrize("scheme", ["topk", "plain"])
def test_counters_in_the_trace_equal_the_states(tmp_path, scheme):
  compressor = [jdist.topk(0.1)] if scheme == "topk" else []
  tx = optax.chain(*compressor, jdist.allreduce(), optax.sgd(0.5))
  jdist.init()
  path = str(host.allgather_object(str(tmp_path / "c.json"))[0])
  expected = _run(tx, path)
  gathered = host.allgather_object(expected)
  topo = jdist.get_topology()
  if topo.process_index != 0:
    return
  for rank, reference in enumerate(gathered):
    counters = _counters(path, rank)
    assert len(counters["step time (ms)"]) == STEPS
    norms = [n for n, _, _ in reference]
    if scheme == "topk":
      assert all(n > 0 for n in norms)  # top-10% holds most of the gradient back
      got = [c["l2"] for c in counters["residual norm"]]
      np.testing.assert_allclose(got, norms, rtol=1e-5)
    else:
      assert "residual norm" not in counters  # plain: no residual to count
    ratios = [dense / sent for _, dense, sent in reference if sent > 0]
    if topo.process_count > 1:
      got = [c["dense / sent"] for c in counters["compression ratio"]]
      np.testing.assert_allclose(got, ratios, rtol=1e-3)
      if scheme == "plain":
        np.testing.assert_allclose(got, 1.0, rtol=1e-3)  # a dense sum is what it sends
    else:
      assert not ratios and "compression ratio" not in counters  # nothing crosses processes


def test_residual_norm_finds_every_residual_and_nothing_else():
  state = (jdist.SparsifyState(jnp.full((4,), 3.0), jnp.zeros((0,)), 0, 0, 0),
           {"inner": jdist.QSGDState(jnp.full((9,), 4.0 / 3.0), jnp.zeros([], jnp.int32))},
           optax.ScaleByAdamState(jnp.zeros([]), {"w": jnp.full((4,), 100.0)},
                                  {"w": jnp.ones((4,))}))
  # sqrt(4 * 9 + 9 * 16 / 9) = sqrt(52); Adam's moments are not residuals.
  np.testing.assert_allclose(timeline_counters.residual_norm(state), np.sqrt(52.0), rtol=1e-6)
  assert timeline_counters.has_residual(state)
  plain = optax.sgd(0.1).init({"w": jnp.ones((3,))})
  assert not timeline_counters.has_residual(plain)
  assert float(timeline_counters.residual_norm(plain)) == 0.0


def test_summarize_reports_the_ratio_over_the_window_and_the_mean_residual(tmp_path, capsys):
  from jdist.tracing import chrome_trace as timeline_format  # pylint: disable=g-import-not-at-top
  from jdist.app import timeline_cli  # pylint: disable=g-import-not-at-top
  ms = 1_000_000
  steps = [("step", n, "train_step", 10 * n * ms, (10 * n + 8) * ms) for n in (1, 2, 3)]
  # A local step in between (DiLoCo-like: nothing sent) counts in the window's ratio.
  counters = [("c", 1, 2.0, 1000.0, 100.0), ("c", 2, 4.0, 1000.0, 0.0),
              ("c", 3, 6.0, 1000.0, 200.0)]
  part = {"steps": steps, "exchanges": [], "counters": counters,
          "wall_minus_mono_ns": 0, "host": "node", "dropped": 0}
  path = str(tmp_path / "t.json")
  timeline_format.write_atomically(path, timeline_format.chrome_trace({0: part}))
  assert timeline_cli.main(["summarize", path, "--plot", str(tmp_path / "t.png")]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].split()[-2:] == ["ratio", "residual"]
  ratio, residual = (float(v) for v in lines[1].split()[-2:])
  assert ratio == pytest.approx(3000 / 300, abs=0.01) and residual == pytest.approx(4.0)
  events = json.load(open(path, encoding="utf-8"))["traceEvents"]
  ratios = [e["args"]["dense / sent"] for e in events if e["name"] == "compression ratio"]
  assert ratios == [10.0, 5.0]  # the step that sent nothing has no ratio of its own
  assert (tmp_path / "t.png").stat().st_size > 1000
