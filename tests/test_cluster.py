"""Across nodes: a two-node rig of network namespaces (`benchmarks.harness.cluster`).

Every job here crosses a (virtual) machine boundary: two hostnames, a link
per node, shared memory within a node and TCP between nodes. The tests build
the rig themselves as root; without root or iproute2 they skip with the
reason (under CI they fail instead: CI runs as root and must run them).
They launch their own mpirun jobs, so they run only in the plain session
(their names hold "subprocess" or start with "test_fault").
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks.harness import cluster
from benchmarks.sections import faults as cluster_faults
from tests import launch

PROCESSES_PER_NODE = 2
TRAIN = ["--model", "cnn", "--dataset", "digits", "--epochs", "2", "--batch-size", "8",
         "--train-limit", "256", "--test-limit", "64", "--no-progress", "--seed", "3"]




def _run_on_rig(rig, command, *, timeout=240, extra=()):
  env = launch.clean_env(1)
  process = rig.popen(command, PROCESSES_PER_NODE, mpirun=launch.mpirun_binary(),
                      extra=list(extra), env=env, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True, cwd=launch.REPO)
  try:
    stdout, stderr = process.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    raise
  return process.returncode, stdout, stderr


def _losses(path):
  with open(path) as log:
    records = [json.loads(line) for line in log]
  return np.array([r["train_loss"] for r in records if r["event"] == "epoch"])


def test_rig_subprocess_topology_reports_nodes_and_local_ranks(rig_ready):
  script = ("import json, jdist; t = jdist.init(); print(json.dumps(dict(rank=t.process_index, "
            "node=t.node_index, nodes=t.node_count, host=t.hostname, local=t.local_rank, "
            "local_count=t.local_process_count)), flush=True)")
  with cluster.Cluster(nodes=2) as rig:
    code, stdout, stderr = _run_on_rig(rig, [sys.executable, "-c", script])
  assert code == 0, stderr[-3000:]
  rows = sorted((json.loads(line) for line in stdout.splitlines() if line.startswith("{")),
                key=lambda row: row["rank"])
  assert [row["rank"] for row in rows] == [0, 1, 2, 3]
  assert [row["host"] for row in rows] == ["nodeA", "nodeA", "nodeB", "nodeB"]
  assert [row["node"] for row in rows] == [0, 0, 1, 1]
  assert {row["nodes"] for row in rows} == {2}
  assert [row["local"] for row in rows] == [0, 1, 0, 1]
  assert {row["local_count"] for row in rows} == {2}


def _forget_host_names(rig):
  """Back to the machine's own /etc/hosts in every node: nodeA and nodeB become unknown names."""
  for node in rig.nodes:
    os.remove(os.path.join(cluster.NETNS_ETC, node.namespace, "hosts"))
  probe = "import socket; socket.gethostbyname(socket.gethostname())"
  code, _, stderr = _run_on_rig(rig, [sys.executable, "-c", probe], timeout=120)
  assert code != 0 and "gaierror" in stderr  # the names really do not resolve


@pytest.mark.parametrize("devices,names_resolve", [(1, True), (2, False)],
                         ids=["1-device", "2-devices-names-unresolved"])
def test_rig_subprocess_train_across_nodes_matches_one_process(rig_ready, tmp_path, devices,
                                                                names_resolve):
  """2 nodes x 2 processes x `devices` trains like one process on every replica.

  With two devices the nodes' host names do not resolve on each other (a
  cluster without DNS entries for its nodes): the job must start and train
  as MPI does. JAX's Gloo collectives resolved the host name and failed on
  every rank there ("Unable to initialize backend 'cpu' ... device.cc:99");
  jdist gives XLA no cross-process collectives, and its coordinator is
  reached by address.
  """
  replicas = 2 * PROCESSES_PER_NODE * devices
  reference = launch.run_own_session(
      [cluster.tool("jdist"), "train", *TRAIN, "--cpu-devices", str(replicas),
       "--log-file", str(tmp_path / "one.jsonl")], launch.clean_env(1), timeout=240)
  assert reference.returncode == 0, reference.stderr[-3000:]
  with cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
    if not names_resolve:
      _forget_host_names(rig)
    code, stdout, stderr = _run_on_rig(
        rig, [cluster.tool("jdist"), "train", *TRAIN, "--cpu-devices", str(devices),
              "--log-file", str(tmp_path / "rig.jsonl")])
  assert code == 0, stderr[-3000:]
  assert "on 2 nodes" in stdout
  assert "Gloo" not in stdout + stderr
  one, rig_losses = _losses(tmp_path / "one.jsonl"), _losses(tmp_path / "rig.jsonl")
  assert len(one) == len(rig_losses) == 2
  # The same math; only the order of float32 sums differs across processes.
  np.testing.assert_allclose(rig_losses, one, rtol=2e-5)


@pytest.mark.parametrize("fault", cluster_faults.FAULTS)
def test_fault_rig_lost_node_ends_the_job_and_names_the_host(rig_ready, fault):
  """Under `jdist launch` every process is gone within timeout + 15 s of the fault."""
  timeout_s = 10
  with cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
    run = cluster_faults.run_fault(rig, fault, timeout_s, launch.clean_env(1))
  assert run.exit_status not in (0, None), run.output[-3000:]
  assert run.seconds <= timeout_s + 15, (run.seconds, run.output[-3000:])
  assert "jdist launch: the job failed: lost host" in run.output, run.output[-3000:]
  assert run.names_host, run.output[-3000:]
  assert run.leftover == 0
