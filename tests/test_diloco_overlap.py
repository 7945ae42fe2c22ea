"""The Streaming DiLoCo overlap benchmark's worker, run in this session's topology."""

import types

import jdist
from benchmarks.sections import diloco_overlap


def _rows(topo):
  ctx = types.SimpleNamespace(
      quick=True, topo=topo, sync=lambda: None,
      options={"rounds": 2, "sync_every": 8, "fragments": 2, "delay": 2,
               "model": "mlp-small", "batch": 8})  # the logic, not the CNN's timing
  return {row["variant"]: row for row in diloco_overlap.run(ctx)}


def test_every_variant_is_timed_and_each_block_reads_what_it_started(topo):
  rows = _rows(topo)
  assert set(rows) == set(diloco_overlap.VARIANTS)
  for row in rows.values():
    assert row["block_s"] > 0 and row["step_s"] * 8 == row["block_s"]
    assert row["in_flight_at_block_end"] == 0  # blocks start past an apply step
  assert rows["compute"]["exposed_share"] == 0.0
  assert rows["compute"]["sync_share"] is None and rows["no_sync"]["sync_share"] == 0.0
  assert {row["payload"] for row in rows.values()} == {None}  # float32 unless --payload
  # The reference never syncs; the others did, in every round and the warm-up.
  assert rows["no_sync"]["outer_syncs"] == 0 and rows["no_sync"]["most_in_flight"] == 0
  for variant in ("in_step", "background"):
    assert rows[variant]["outer_syncs"] >= 2 * 2, rows[variant]["outer_syncs"]
  background = rows["background"]["most_in_flight"]
  if topo.process_count > 1 and jdist.collectives.route() == "native":
    # One fragment's sum at a time, on every local device, between sync and apply.
    assert background == topo.local_device_count
  else:  # exchanged inside the sync step: nothing is left in flight
    assert background == 0
  assert rows["in_step"]["most_in_flight"] == 0
