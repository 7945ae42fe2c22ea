"""What the rig's links give: concurrent TCP streams between two nodes, both ways.

    with cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
      seconds = cluster_link.measure(rig, mbytes=8, streams=2)

`measure` runs a sink (`serve`) on each of nodes 0 and 1, then `streams` sources on
each node at once towards the other (node 0 -> 1 and 1 -> 0 concurrently, as
a node-aware sum's cross-node phases send), and returns the slowest stream's
time from its first byte to the sink's acknowledgement of its last. The
floor an all-reduce is held to uses the shaped rate; this is what TCP over
the shaped veths (`tc tbf` on both ends) actually reaches with these ranks'
CPUs busy only with the copy.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

_CHUNK = 1 << 20
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def serve(port: int, streams: int) -> None:
  """Accepts `streams` connections; drains each to EOF, then answers one byte."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(streams)
    print("ready", flush=True)
    connections = [listener.accept()[0] for _ in range(streams)]
    buffer = bytearray(_CHUNK)
    for connection in connections:  # every source sends at once; draining in turn is fine
      while connection.recv_into(buffer):
        pass
      connection.sendall(b"k")
      connection.close()


def send(host: str, port: int, nbytes: int) -> None:
  """Sends `nbytes` to a sink; prints the seconds until it acknowledged them."""
  payload = bytes(_CHUNK)
  for _ in range(50):  # the sink may still be starting
    try:
      connection = socket.create_connection((host, port))
      break
    except ConnectionRefusedError:
      time.sleep(0.05)
  else:
    raise ConnectionRefusedError(f"{host}:{port}")
  with connection:
    start = time.perf_counter()
    left = nbytes
    while left:
      left -= connection.send(payload[:min(left, _CHUNK)])
    connection.shutdown(socket.SHUT_WR)
    connection.recv(1)
    print(f"{time.perf_counter() - start:.6f}", flush=True)


def measure(rig, mbytes: float, streams: int = 1, port: int = 29701) -> float:
  """Seconds for `streams` x `mbytes` each way between nodes 0 and 1 at once (slowest stream)."""
  nbytes = int(mbytes * (1 << 20))
  env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))

  def run(index: int, call: str) -> subprocess.Popen:
    code = f"from benchmarks import cluster_link; cluster_link.{call}"
    return subprocess.Popen(rig.node_argv(index, [sys.executable, "-c", code]), env=env,
                            stdout=subprocess.PIPE, text=True)

  sinks = [run(i, f"serve({port}, {streams})") for i in (0, 1)]
  for sink in sinks:
    sink.stdout.readline()  # "ready"
  sources = [run(i, f"send({rig.nodes[1 - i].address!r}, {port}, {nbytes})")
             for i in (0, 1) for _ in range(streams)]
  times = [float(source.communicate(timeout=120)[0]) for source in sources]
  for sink in sinks:
    sink.wait(timeout=30)
  return max(times)
