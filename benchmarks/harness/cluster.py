"""A cluster of nodes on one machine: network namespaces on a bridge, launched by `mpirun --hostfile`.

    with cluster.Cluster(nodes=2, rate_mbit=1000) as rig:
      rig.popen(["python", "train.py"], processes_per_node=2)
      rig.link_down(1)        # faults: link_down, kill_node, partition

Needs root, iproute2 and `unshare` (`missing_requirements`); how it works: docs/multinode.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Sequence

from benchmarks.harness import jobs
from benchmarks.harness import netns

PREFIX = "jdc"  # interface and namespace names: jdc<pid>n<i>, jdc<pid>v<i>, jdc<pid>br
NODE_NAMES = "ABCDEFGHIJKLMNOP"
_SUBNETS = range(90, 250)
NETNS_ETC = "/etc/netns"  # per-namespace files `ip netns exec` mounts over /etc

# PRRTE notices a node whose link is gone in seconds instead of its default 8 minutes.
KEEPALIVE_ENV = {
    "PRTE_MCA_oob_tcp_keepalive_time": "1",
    "PRTE_MCA_oob_tcp_keepalive_intvl": "1",
    "PRTE_MCA_oob_tcp_keepalive_probes": "3",
}

# The ranks' environment on the rig: JAX's distributed runtime off (its coordinator address
# does not resolve on the rig yet); Open MPI yields the core while it waits (4 busy-polling
# ranks on 2 shared cores starve the ones they wait for: 1 MB all-reduce 150 ms against 22.5).
RANK_ENV = {"JDIST_JAX_DISTRIBUTED": "0", "OMPI_MCA_mpi_yield_when_idle": "1"}
FORWARDED = ("XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH", "PYTHONUNBUFFERED", "JDIST_TIMEOUT")


class ClusterError(RuntimeError):
  """The rig could not be built (the message says why)."""


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
  try:
    return netns._run(list(argv), check=check)  # pylint: disable=protected-access
  except netns.NamespaceError as err:
    raise ClusterError(str(err)) from None


def missing_requirements() -> list[str]:
  """What stops this machine from building the rig (empty: nothing)."""
  missing = netns.missing_tools(("ip", "tc", "bridge", "unshare"),
                                "network namespaces, bridges and tc")
  if missing:
    return missing
  try:
    with Cluster(nodes=2):
      pass
  except (ClusterError, OSError, subprocess.TimeoutExpired) as err:
    missing.append(f"cannot build a two-node rig here: {err}")
  return missing


@dataclasses.dataclass(frozen=True)
class Node:
  """One node of the rig: its namespace, hostname, address and veth ends."""
  index: int
  namespace: str
  hostname: str
  address: str
  outer_veth: str  # in the root namespace, a port of the bridge
  inner_veth: str = "eth0"


def _free_subnet() -> int:
  used = _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout
  for subnet in _SUBNETS:
    if f" 10.{subnet}." not in used:
      return subnet
  raise ClusterError("no free 10.x.0.0/24 subnet for the rig")


class Cluster:
  """`nodes` (2 to 16) network namespaces joined by a bridge, each link shaped to `rate_mbit`
  per direction (None: the veth's own speed); a context manager.
  """

  def __init__(self, nodes: int = 2, rate_mbit: float | None = None):
    if not 2 <= nodes <= len(NODE_NAMES):
      raise ValueError(f"nodes={nodes} must be between 2 and {len(NODE_NAMES)}.")
    if rate_mbit is not None and not rate_mbit > 0:
      raise ValueError(f"rate_mbit={rate_mbit!r} must be a positive rate or None.")
    self.rate_mbit = rate_mbit
    tag = f"{PREFIX}{os.getpid() % 100000}"
    self.bridge = f"{tag}br"
    self._subnet: int | None = None
    self._node_count = nodes
    self._tag = tag
    self.nodes: list[Node] = []
    self._workdir: str | None = None

  @property
  def subnet(self) -> str:
    return f"10.{self._subnet}.0.0/24"

  @property
  def bridge_address(self) -> str:
    return f"10.{self._subnet}.0.254"

  def __enter__(self) -> "Cluster":
    try:
      self._build()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _build(self) -> None:
    self._subnet = _free_subnet()
    self._workdir = tempfile.mkdtemp(prefix="jdist-cluster-")
    _run(["ip", "link", "add", "name", self.bridge, "type", "bridge"])
    _run(["ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge])
    _run(["ip", "link", "set", self.bridge, "up"])
    for index in range(self._node_count):
      node = Node(index=index, namespace=f"{self._tag}n{index}",
                  hostname=f"node{NODE_NAMES[index]}",
                  address=f"10.{self._subnet}.0.{index + 1}",
                  outer_veth=f"{self._tag}v{index}")
      self.nodes.append(node)
      _run(["ip", "netns", "add", node.namespace])
      inside = netns.exec_prefix(node.namespace)
      _run(["ip", "link", "add", node.outer_veth, "type", "veth", "peer", "name",
            node.inner_veth, "netns", node.namespace])
      _run(["ip", "link", "set", node.outer_veth, "master", self.bridge])
      _run(["ip", "link", "set", node.outer_veth, "up"])
      _run(inside + ["ip", "link", "set", "lo", "up"])
      _run(inside + ["ip", "addr", "add", f"{node.address}/24", "dev", node.inner_veth])
      _run(inside + ["ip", "link", "set", node.inner_veth, "up"])
      if self.rate_mbit is not None:
        self.shape(index, self.rate_mbit)
    self._write_hosts()
    self._write_agent()

  def _write_hosts(self) -> None:
    """Lets every node resolve every node's name (gloo needs it)."""
    try:
      with open("/etc/hosts", encoding="utf-8") as handle:
        base = handle.read()
    except OSError:
      base = "127.0.0.1 localhost\n"
    table = "".join(f"{node.address} {node.hostname}\n" for node in self.nodes)
    for node in self.nodes:
      directory = os.path.join(NETNS_ETC, node.namespace)
      os.makedirs(directory, exist_ok=True)
      with open(os.path.join(directory, "hosts"), "w", encoding="utf-8") as handle:
        handle.write(base.rstrip("\n") + "\n# jdist cluster rig\n" + table)

  def shape(self, index: int, rate_mbit: float) -> None:
    """Limits node `index`'s link to `rate_mbit` in each direction (both veth ends)."""
    node = self.nodes[index]
    tbf = netns.tbf_args(rate_mbit)
    _run(["tc", "qdisc", "replace", "dev", node.outer_veth, "root"] + tbf)
    _run(netns.exec_prefix(node.namespace) +
         ["tc", "qdisc", "replace", "dev", node.inner_veth, "root"] + tbf)

  def close(self) -> None:
    """Kills what runs on the nodes; deletes namespaces, veths, bridge and files."""
    for node in self.nodes:
      netns.delete(node.namespace)  # its inner veth goes with it, and so the pair
      shutil.rmtree(os.path.join(NETNS_ETC, node.namespace), ignore_errors=True)
      _run(["ip", "link", "delete", node.outer_veth], check=False)
    _run(["ip", "link", "delete", self.bridge], check=False)
    self.nodes = []
    if self._workdir is not None:
      shutil.rmtree(self._workdir, ignore_errors=True)
      self._workdir = None

  @property
  def agent(self) -> str:
    """The launch agent: runs `prted` on a node, as ssh would on a real one."""
    return os.path.join(self._workdir, "agent.sh")

  def _write_agent(self) -> None:
    cases = "\n".join(
        f"  {node.address}|{node.hostname}) ns={node.namespace}; name={node.hostname} ;;"
        for node in self.nodes)
    script = f"""#!/bin/sh
# Launch agent of a jdist cluster rig: `agent.sh [ssh options] HOST COMMAND...`.
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
case "$host" in
{cases}
  *) echo "jdist cluster agent: unknown host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $name; $*"
"""
    with open(self.agent, "w", encoding="utf-8") as handle:
      handle.write(script)
    os.chmod(self.agent, 0o755)

  def hostfile(self, processes_per_node: int) -> str:
    """Writes a hostfile with `processes_per_node` slots on every node; returns its path."""
    path = os.path.join(self._workdir, f"hosts-{processes_per_node}")
    with open(path, "w", encoding="utf-8") as handle:
      for node in self.nodes:
        handle.write(f"{node.address} slots={processes_per_node}\n")
    return path

  def mpi_env(self) -> dict[str, str]:
    """The environment `mpirun` needs on the rig (agent, interfaces, keepalive)."""
    return {
        "PRTE_MCA_plm_ssh_agent": self.agent,
        "PRTE_MCA_oob_tcp_if_include": self.subnet,
        "OMPI_MCA_pml": "ob1",
        "OMPI_MCA_btl": "tcp,sm,self",
        "OMPI_MCA_btl_tcp_if_include": self.subnet,
        **KEEPALIVE_ENV,
    }

  def mpirun_argv(self, command: Sequence[str], processes_per_node: int,
                  mpirun: str = "mpirun", extra: Sequence[str] = ()) -> list[str]:
    """The `mpirun --hostfile` command line for `command` on every node."""
    argv = [mpirun, "--hostfile", self.hostfile(processes_per_node),
            "-np", str(processes_per_node * len(self.nodes)), "--map-by", "slot"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
      argv.append("--allow-run-as-root")
    return argv + list(extra) + list(command)

  def popen(self, command: Sequence[str], processes_per_node: int, *,
            mpirun: str = "mpirun", extra: Sequence[str] = (),
            env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """Starts `command` on every node under mpirun; returns the mpirun process."""
    full_env = dict(os.environ, **self.mpi_env(), **(env or {}))
    return subprocess.Popen(self.mpirun_argv(command, processes_per_node, mpirun, extra),
                            env=full_env, **kwargs)

  def node_argv(self, index: int, command: Sequence[str]) -> list[str]:
    """`command` run on node `index` (its namespace and hostname), as the agent runs prted."""
    node = self.nodes[index]
    return netns.exec_prefix(node.namespace) + [
        "unshare", "--uts", "/bin/sh", "-c",
        f"hostname {node.hostname}; exec {' '.join(shlex.quote(arg) for arg in command)}"]

  def launch_argv(self, command: Sequence[str], processes_per_node: int,
                  launch_args: Sequence[str] = ()) -> list[str]:
    """`jdist launch` of `command` over every node's slots (this interpreter's tools)."""
    return [tool("jdist"), "launch", "--hostfile", self.hostfile(processes_per_node),
            "--mpirun", tool("mpirun"), *launch_args, "--", *command]

  def launch_env(self, env: dict[str, str]) -> dict[str, str]:
    """`env` plus the rig's mpirun settings, less the keepalive `jdist launch` sets itself."""
    full = dict(env, **self.mpi_env())
    for name in KEEPALIVE_ENV:
      full.pop(name, None)
    return full

  def link_down(self, index: int) -> None:
    """Takes node `index`'s link down from inside the node (its NIC fails)."""
    node = self.nodes[index]
    _run(netns.exec_prefix(node.namespace) + ["ip", "link", "set", node.inner_veth, "down"])

  def kill_node(self, index: int) -> None:
    """Kills every process on node `index` at once (a power loss)."""
    for pid in netns.namespace_pids(self.nodes[index].namespace):
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)

  def partition(self) -> None:
    """Cuts the nodes off from each other (isolated bridge ports); each still reaches mpirun."""
    for node in self.nodes:
      _run(["bridge", "link", "set", "dev", node.outer_veth, "isolated", "on"])

  def namespace_pids(self) -> list[int]:
    """Every process still running on any node."""
    return [pid for node in self.nodes for pid in netns.namespace_pids(node.namespace)]


def run_job(rig: Cluster, job: jobs.Job, *, quick: bool, timeout: float) -> dict:
  """`job` under `mpirun --hostfile`, its processes split over the rig's nodes."""
  env = {**jobs.environment(job), **RANK_ENV, **dict(job.env), **rig.mpi_env()}
  names = dict.fromkeys([*RANK_ENV, *dict(job.env), *FORWARDED])
  extra = [arg for key in names for arg in ("-x", key)]
  return jobs.collect(job, lambda prefix: jobs.launch([rig.mpirun_argv(
      jobs.program_argv(job, prefix, quick), job.processes // len(rig.nodes),
      jobs.binary("mpirun"), extra)], env, timeout))


def remove_stale() -> list[str]:
  """Deletes rigs whose creating process is gone (a SIGKILLed run); returns their names."""
  removed = []
  for name in netns.list_names():
    match = re.fullmatch(PREFIX + r"(\d+)n\d+", name)
    if match and not any(str(pid).endswith(match.group(1)) for pid in _live_pids(match.group(1))):
      netns.delete(name)
      shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
      removed.append(name)
  links = _run(["ip", "-o", "link", "show"], check=False).stdout
  for name in re.findall(r"\d+: (" + PREFIX + r"(\d+)(?:br|v\d+))[@:]", links):
    if not _live_pids(name[1]):
      _run(["ip", "link", "delete", name[0]], check=False)
      removed.append(name[0])
  return removed


def _live_pids(suffix: str) -> list[int]:
  """Live pids whose value modulo 100000 is `suffix` (the rig's tag)."""
  return [int(pid) for pid in os.listdir("/proc")
          if pid.isdigit() and int(pid) % 100000 == int(suffix)]


def tool(name: str) -> str:
  """A console script beside this interpreter (the venv's jdist, mpirun)."""
  return os.path.join(os.path.dirname(sys.executable), name)
