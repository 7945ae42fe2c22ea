"""The rig's link probe (`benchmarks.cluster_link`): TCP streams between two nodes.

Builds its own rig as root (skips with the reason elsewhere, fails under CI);
its name holds "subprocess" so that it runs in the plain session only.
"""

from benchmarks import cluster
from benchmarks import cluster_link
from benchmarks import netns

RATE_MBIT = 100


def test_rig_subprocess_link_probe_is_held_to_the_shaped_rate(rig_ready):
  """Two streams each way at once: the node's shaped rate bounds them from below
  (all but the token bucket's burst, which leaves at line rate)."""
  mbytes, streams = 0.5, 2
  total_bytes = streams * mbytes * (1 << 20)
  tbf = netns.tbf_args(RATE_MBIT)
  burst_bytes = int(tbf[tbf.index("burst") + 1])
  floor_s = (total_bytes - burst_bytes) * 8 / (RATE_MBIT * 1e6)
  with cluster.Cluster(nodes=2, rate_mbit=RATE_MBIT) as rig:
    seconds = cluster_link.measure(rig, mbytes, streams)
  assert floor_s * 0.9 <= seconds < total_bytes * 8 / (RATE_MBIT * 1e6) * 20, (seconds, floor_s)
