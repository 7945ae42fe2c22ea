"""A communicator that survives lost processes: Open MPI's ULFM, for `--shrink`.

Under `mpirun --with-ft ulfm` (what `jdist launch --shrink` runs), a process
that dies does not end the job: an MPI call that involves it returns
`MPI_ERR_PROC_FAILED` (or `MPI_ERR_REVOKED` once a peer revoked the
communicator) to the others. `ShrinkableComm` turns that into `PeerLost`;
`shrink()` then revokes the communicator (every survivor leaves whatever
call it was in), builds the survivors' communicator (`MPIX_Comm_shrink`)
and says who was lost. `start_growth()` starts new processes in their
place (`MPI_Comm_spawn`), which get ready while the members go on;
`growth_verdict()` tells the members, alike, once they are, and `take_in()`
makes one communicator with them (`MPI_Intercomm_merge`). A process started
so joins with `ShrinkableComm.joined()`.

Only host buffers cross it (numpy): jdist's native engine and mpi4jax call
`MPI_Abort` on any MPI error, so a step that ran them would end the job
(measured: "MPI_Allreduce returned error code 75: MPI_ERR_PROC_FAILED ...
aborting"). This module is the only one of the `--shrink` mode that knows
about MPI.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from typing import NamedTuple

import numpy as np

from jdist import errors

_MAX_SHRINK_TRIES = 8  # a shrink interrupted by yet another failure is tried again
STALL_EXIT = 1  # the exit status of a process that gave up waiting (`StallGuard`)


class StallGuard:
  """Ends this process when one of its MPI calls waits longer than a deadline.

  ULFM reports a member's death only where MPI learns of it. A started
  process that dies before it joins (killed while starting, measured) is
  never reported: members waiting in `MPI_Intercomm_merge` for it wait
  forever, and revoking the communicator does not wake them (tried). The
  members now merge only with processes that said they are ready
  (`growth_verdict`), but a wait MPI cannot end remains possible (a death
  between that word and the merge, `MPI_Init`, a started process's own
  waits). Past the deadline (`jdist train --timeout`), this process leaves,
  as a lost one: the others see a death MPI does report and shrink past it,
  or, if every member waited, the job ends, with this message instead of a
  hang (and `jdist launch --max-restarts` starts it again from its
  checkpoints). One thread watches every call; a call pays a clock read.

  Args:
    deadline_s: the longest wait; None: never give up.
    on_stall: called with the message instead of leaving (tests).
  """

  def __init__(self, deadline_s: float | None = None, on_stall=None):
    self.deadline_s = deadline_s
    self.on_stall = on_stall or _leave_stalled
    self._waiting: tuple[str, float] | None = None
    self._thread: threading.Thread | None = None

  @contextlib.contextmanager
  def waiting(self, what: str):
    """Marks an MPI call (`what`) for the watch while the block runs."""
    if self.deadline_s is None:
      yield
      return
    if self._thread is None:
      self._thread = threading.Thread(target=self._watch, name="jdist-shrink-stall",
                                      daemon=True)
      self._thread.start()
    self._waiting = (what, time.monotonic())
    try:
      yield
    finally:
      self._waiting = None

  def _watch(self) -> None:
    period = min(1.0, self.deadline_s / 4)
    while True:
      time.sleep(period)
      waiting = self._waiting
      if waiting is not None and time.monotonic() - waiting[1] > self.deadline_s:
        self.on_stall(f"waited over {self.deadline_s:g} s in {waiting[0]} for the other "
                      f"processes (--timeout): a process that died where MPI cannot see it "
                      f"(one killed while it was being started) leaves the others waiting "
                      f"forever, so this one leaves; the others shrink past it, or the job "
                      f"ends (with jdist launch --max-restarts, it starts again from its "
                      f"checkpoints)")
        return


def _leave_stalled(message: str) -> None:
  sys.stderr.write(f"jdist train --shrink: rank {_launch_rank()}: {message}.\n")
  leave(STALL_EXIT)


def _launch_rank() -> str:
  return os.environ.get("OMPI_COMM_WORLD_RANK", "?")


STALLS = StallGuard()  # the process's watch (`jdist train --shrink` sets its deadline)


class PeerLost(errors.JdistError):
  """A process of the job failed, or a peer revoked the communicator after one did."""


class Shrunk(NamedTuple):
  """What one `ShrinkableComm.shrink()` changed.

  Attributes:
    lost_ranks: the launch ranks (MPI_COMM_WORLD ranks) no longer in the job.
    lost_hosts: the hosts those ranks ran on, sorted, without repeats.
    size: the number of processes left.
  """
  lost_ranks: tuple[int, ...]
  lost_hosts: tuple[str, ...]
  size: int


class Grown(NamedTuple):
  """What one `ShrinkableComm.take_in()` changed.

  Attributes:
    new_ranks: the launch ranks given to the started processes (never reused).
    size: the number of processes now.
  """
  new_ranks: tuple[int, ...]
  size: int


class Starting(NamedTuple):
  """Processes `start_growth()` started, not yet taken in.

  Attributes:
    inter: the intercommunicator to them (MPI_Comm_spawn's).
    count: how many.
    began: when they were started (time.monotonic()).
    ready: those that said they are ready (their ranks among them; filled
      at the member that heard them, rank 0, the only one that talks to them).
  """
  inter: object
  count: int
  began: float
  ready: set


# What `growth_verdict()` says, and the words between members and started processes.
READY, WAIT, GIVE_UP = "ready", "wait", "give up"
_READY, _WAIT = 1, 2  # rank 0's flags in the agreement
_READY_TAG, _GO_TAG = 7101, 7102
_JOIN, _LEAVE = "join", "leave"
_POLL_S = 0.005  # a started process's wait for the members' word: no busy MPI wait
_ANY = -1  # MPI_ANY_SOURCE
_TELL_S = 2.0  # the members' longest wait for a word to leave (`_tell`)


# A started Python process runs this first: MPI_Init (which the members'
# MPI_Comm_spawn waits for) before the program's own imports (JAX: seconds),
# so the members wait for an interpreter's start, not the program's. Within
# the deadline (argv[1]; as `spawned()`: one killed while starting would
# leave the others in MPI_Init), then the program as `python ARGS` runs it.
_MPI_FIRST = """
import faulthandler, os, runpy, sys
deadline, args = float(sys.argv[1]), sys.argv[2:]
if deadline > 0:
  faulthandler.dump_traceback_later(deadline, exit=True)
from mpi4py import MPI
faulthandler.cancel_dump_traceback_later()
sys.orig_argv = [sys.executable, *args]  # what the program reads to start others in turn
if args[0] == "-m":
  sys.argv = args[1:]
  runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
  sys.argv, sys.path[0] = args, os.path.dirname(os.path.abspath(args[0]))
  runpy.run_path(args[0], run_name="__main__")
"""


def _starting_mpi_first(command: list[str]) -> tuple[str, list[str]]:
  """`command` (program, args) as MPI_Comm_spawn runs it: a Python program starts MPI first."""
  if command[0] != sys.executable or not command[1:] or (
      command[1].startswith("-") and command[1] != "-m"):
    return command[0], list(command[1:])  # not a plain `python script|-m module ...`
  return sys.executable, ["-c", _MPI_FIRST, f"{STALLS.deadline_s or 0:g}", *command[1:]]


def _hear(mpi, starting: "Starting") -> None:
  """Takes in every "ready" the started processes sent so far (rank 0)."""
  status = mpi.Status()
  with contextlib.suppress(mpi.Exception):  # a started process died: not ready
    while starting.inter.Iprobe(source=_ANY, tag=_READY_TAG, status=status):
      starting.inter.recv(source=status.Get_source(), tag=_READY_TAG)
      starting.ready.add(status.Get_source())


def _tell(mpi, starting: "Starting", word: str) -> None:
  """Sends `word` to the started processes that said they are ready, waiting at most `_TELL_S`.

  Only to those (see `dismiss`); a send not done by then is left behind.
  """
  requests = []
  for child in sorted(starting.ready):
    with contextlib.suppress(mpi.Exception):
      requests.append(starting.inter.isend(word, dest=child, tag=_GO_TAG))
  deadline = time.monotonic() + _TELL_S
  while requests and time.monotonic() < deadline:
    with contextlib.suppress(mpi.Exception):
      requests = [r for r in requests if not r.Test()]
    time.sleep(_POLL_S)


def _wait_for_word(parent) -> str:
  """A started process's wait for the members' word (polled, within `STALLS`'s deadline)."""
  with STALLS.waiting("the members' word (joining)"):
    while not parent.Iprobe(source=_ANY, tag=_GO_TAG):
      time.sleep(_POLL_S)
    return parent.recv(source=_ANY, tag=_GO_TAG)


class GrowFailed(errors.JdistError):
  """New processes could not be started (no free slot, no host); the members go on as they were."""


class ShrinkableComm:
  """The job's processes on a communicator that shrinks when some of them die.

  Every method is collective over the current members. `rank` and `size`
  change after `shrink()`; `launch_rank` (the rank mpirun gave) never does.
  """

  def __init__(self, comm=None, launch_rank: int | None = None,
               members: tuple[int, ...] | None = None):
    from mpi4py import MPI  # pylint: disable=import-outside-toplevel
    self._mpi = MPI
    with STALLS.waiting("Comm_dup"):
      self._comm = comm if comm is not None else MPI.COMM_WORLD.Dup()
    self._comm.Set_errhandler(MPI.ERRORS_RETURN)
    self.launch_rank = MPI.COMM_WORLD.Get_rank() if launch_rank is None else launch_rank
    self.members = members or tuple(range(self._comm.Get_size()))  # launch ranks, rank order
    # {launch rank: host}, of every process the job ever had
    self.hosts = dict(zip(self.members, self.allgather_object(MPI.Get_processor_name())))

  @classmethod
  def joined(cls) -> "ShrinkableComm":
    """The job's communicator in a process that `start_growth()` started, once prepared.

    Says it is ready (to the members' rank 0, the one that talks to started
    processes), then waits for their word: join (the merge, once every
    process started with it is ready) or leave (they gave up on it, lost a
    member meanwhile and start others, or finished).

    Raises:
      PeerLost: a member failed meanwhile, or the members sent it away (this
        process then leaves; the others go on).
    """
    from mpi4py import MPI  # pylint: disable=import-outside-toplevel
    parent = MPI.Comm.Get_parent()
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    try:
      with STALLS.waiting("telling the members it is ready"):
        parent.send(None, dest=0, tag=_READY_TAG)
      word = _wait_for_word(parent)
    except MPI.Exception as err:
      raise PeerLost(f"a started process: {err}") from err
    if word != _JOIN:
      raise PeerLost("the members did not take this started process in (they gave up on "
                     "it, or lost a member meanwhile)")
    with STALLS.waiting("Merge (joining)"):
      merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    members, hosts = _agreed(MPI, merged, merged.bcast, None, root=0)
    joined = cls(merged, members[merged.Get_rank()], members)
    joined.hosts = {**hosts, **joined.hosts}
    return joined

  @property
  def rank(self) -> int:
    return self._comm.Get_rank()

  @property
  def size(self) -> int:
    return self._comm.Get_size()

  def _call(self, fn, *args, **kwargs):
    try:
      with STALLS.waiting(getattr(fn, "__name__", "an MPI call")):
        return fn(*args, **kwargs)
    except self._mpi.Exception as err:
      raise PeerLost(f"rank {self.launch_rank}: {err}") from err

  def sum(self, array: np.ndarray) -> np.ndarray:
    """The element-wise sum of every member's `array` (same shape and dtype).

    Raises:
      PeerLost: a member failed (here or in a peer, which then revoked).
    """
    array = np.ascontiguousarray(array)
    total = np.empty_like(array)
    self._call(self._comm.Allreduce, array, total, op=self._mpi.SUM)
    return total

  def confirm(self) -> None:
    """Returns only if every member completed what came before; else raises PeerLost everywhere.

    A collective that a member's death interrupts may return success with a
    wrong result at some survivors (measured on the rig, Open MPI 5.0.11:
    rank 3 of 4 SIGKILLed during a step's allreduce across 2 nodes, every
    survivor's `Allreduce` returned, each with different numbers). The
    agreement (`MPIX_Comm_agree`) is uniform: every member gets the same
    answer, and it fails at all of them while a failed member is in the
    communicator. So a result is used only once `confirm()` returned.

    Raises:
      PeerLost: a member failed (at every survivor alike).
    """
    self._call(self._comm.Agree, 1)

  def minimum(self, array: np.ndarray) -> np.ndarray:
    """The element-wise minimum over the members (float64). Raises PeerLost."""
    array = np.ascontiguousarray(array, np.float64)
    low = np.empty_like(array)
    self._call(self._comm.Allreduce, array, low, op=self._mpi.MIN)
    return low

  def bcast(self, array: np.ndarray, root: int = 0) -> np.ndarray:
    """`root`'s `array` on every member. Raises PeerLost."""
    array = np.ascontiguousarray(array)
    self._call(self._comm.Bcast, array, root=root)
    return array

  def shrink(self) -> Shrunk:
    """Revokes the communicator and goes on with the members still alive.

    Collective over the survivors: each calls it once it caught `PeerLost`
    (the revoke makes every survivor's pending or next call raise it).
    """
    for _ in range(_MAX_SHRINK_TRIES):
      try:
        self._comm.Revoke()
      except self._mpi.Exception:
        pass  # already revoked by a peer
      with STALLS.waiting("Shrink"):
        survivors = self._comm.Shrink()
      survivors.Set_errhandler(self._mpi.ERRORS_RETURN)
      self._comm = survivors
      try:
        with STALLS.waiting("allgather (after a shrink)"):
          members = tuple(survivors.allgather(self.launch_rank))
      except self._mpi.Exception:
        continue  # another member failed during the shrink: shrink again
      lost = tuple(sorted(set(self.members) - set(members)))
      self.members = members
      return Shrunk(lost, tuple(sorted({self.hosts[rank] for rank in lost})), len(members))
    raise PeerLost(f"rank {self.launch_rank}: the communicator could not be shrunk in "
                   f"{_MAX_SHRINK_TRIES} tries (members kept failing)")


  def start_growth(self, count: int, command: list[str],
                   hosts: tuple[str, ...] = ()) -> "Starting":
    """Starts `count` processes running `command`; they prepare while the members go on.

    Collective over the members. The new processes get ready on their own
    (imports, data, compilation) and call `ShrinkableComm.joined()`; the
    members ask `growth_verdict()` at their step boundaries and take them in
    with `take_in()` once they are ready, so their start costs the members
    no step. The new processes come last in rank order, with launch ranks
    above every one the job had.

    Args:
      count: how many processes to start.
      command: the program and its arguments (the new processes' argv).
      hosts: where to start them (MPI's "host" key; empty: where mpirun places them).

    Raises:
      PeerLost: a member failed meanwhile.
      GrowFailed: MPI could not start them; the communicator is as it was.
    """
    info = self._mpi.Info.Create()
    if hosts:
      info.Set("host", ",".join(hosts))
    program, args = _starting_mpi_first(command)
    try:
      with STALLS.waiting("Spawn"):
        inter = self._comm.Spawn(program, args=args, maxprocs=count, root=0, info=info)
    except self._mpi.Exception as err:
      self.confirm()  # PeerLost if a member died; else the start itself failed
      raise GrowFailed(f"rank {self.launch_rank}: could not start {count} process(es): "
                       f"{err}") from err
    finally:
      info.Free()
    inter.Set_errhandler(self._mpi.ERRORS_RETURN)  # a started process may die: not fatal here
    return Starting(inter, count, time.monotonic(), set())

  def growth_verdict(self, starting: "Starting", give_up: bool) -> str:
    """READY, WAIT or GIVE_UP for `starting`, the same at every member (collective).

    Rank 0 reads whether the started processes said they are ready; the
    agreement (`MPIX_Comm_agree`, a bitwise AND of every member's flags)
    hands its verdict to all, and fails everywhere alike if a member failed,
    which also confirms every collective before it. `give_up` (rank 0's):
    they took too long; they are told to leave.

    Raises:
      PeerLost: a member failed (at every member alike).
    """
    flags = _READY | _WAIT
    if self.rank == 0:
      _hear(self._mpi, starting)
      ready = len(starting.ready) == starting.count
      flags = _READY if ready else (0 if give_up else _WAIT)
    verdict = self._call(self._comm.Agree, flags)
    if verdict & _READY:
      return READY
    if not verdict & _WAIT:
      self.dismiss(starting)
      return GIVE_UP
    return WAIT

  def dismiss(self, starting: "Starting") -> None:
    """Tells the started processes that said they are ready to leave (rank 0 does).

    Only those: the first message to a process that died while it started
    waited for good (in PMIx_Get, measured). The others leave on their own
    past their deadline (`--timeout`), or when their word finds no member.
    """
    if self.rank == 0:
      _hear(self._mpi, starting)
      _tell(self._mpi, starting, _LEAVE)

  def take_in(self, starting: "Starting") -> Grown:
    """Merges the ready processes of `starting` into the job (collective with them).

    Raises:
      PeerLost: a member failed meanwhile.
      GrowFailed: a started process failed in the merge; the communicator is as it was.
    """
    if self.rank == 0:
      _tell(self._mpi, starting, _JOIN)
    try:
      merged = self._call(starting.inter.Merge, high=False)
    except PeerLost as err:  # MPI reported a failure in the merge
      self.confirm()  # PeerLost if a member died; else the new processes did
      raise GrowFailed(f"rank {self.launch_rank}: the started process(es) did not join: "
                       f"{err}") from err
    merged.Set_errhandler(self._mpi.ERRORS_RETURN)
    first = max(self.hosts) + 1
    new_ranks = tuple(range(first, first + starting.count))
    _agreed(self._mpi, merged, merged.bcast, (self.members + new_ranks, self.hosts), root=0)
    grown = ShrinkableComm(merged, self.launch_rank, self.members + new_ranks)
    self._comm, self.members = grown._comm, grown.members  # pylint: disable=protected-access
    self.hosts.update(grown.hosts)
    return Grown(new_ranks, len(self.members))

  def allgather_object(self, value) -> list:
    """Every member's picklable `value`, in rank order, once all agreed. Raises PeerLost."""
    return _agreed(self._mpi, self._comm, self._comm.allgather, value)

  def bcast_object(self, value, root: int = 0):
    """`root`'s picklable `value` on every member, once all agreed. Raises PeerLost."""
    return _agreed(self._mpi, self._comm, self._comm.bcast, value, root=root)


def _agreed(mpi, comm, collective, *args, **kwargs):
  """`collective(...)`'s result once every member agreed that none failed.

  A collective that a death cuts short can hand a survivor garbage (see
  `ShrinkableComm.confirm`); for a pickled object, one that does not load.
  So a torn result is held until the agreement says whether a member
  failed (PeerLost, everywhere alike) or not (the error itself).
  """
  try:
    with STALLS.waiting(getattr(collective, "__name__", "a collective")):
      result, problem = collective(*args, **kwargs), None
  except mpi.Exception as err:
    raise PeerLost(f"{err}") from err
  except Exception as err:  # pylint: disable=broad-except
    result, problem = None, err
  try:
    with STALLS.waiting("Agree"):
      comm.Agree(1)
  except mpi.Exception as err:
    raise PeerLost(f"{err}") from err
  if problem is not None:
    raise problem
  return result


def spawned() -> bool:
  """Whether this process was started by `ShrinkableComm.start_growth()` (it must call `joined()`).

  The first call starts MPI (`MPI_Init`, which waits for every process of
  the launch: one killed while starting left the others there for good, in
  a chaos run). `MPI_Init` runs inside mpi4py's import, which holds the
  GIL, so `STALLS`'s thread cannot act there: faulthandler's watchdog,
  which needs no GIL, ends the process past the deadline instead, with
  every thread's traceback.
  """
  if STALLS.deadline_s is not None:
    faulthandler.dump_traceback_later(STALLS.deadline_s, exit=True)
  try:
    from mpi4py import MPI  # pylint: disable=import-outside-toplevel
  finally:
    if STALLS.deadline_s is not None:
      faulthandler.cancel_dump_traceback_later()
  return MPI.Comm.Get_parent() != MPI.COMM_NULL


def leave(code: int) -> None:
  """Ends this process with `code`, without MPI_Finalize.

  After a shrink, MPI_Finalize waits forever for the lost processes
  (measured: the survivors of a finished run sat in `ompi_mpi_finalize`'s
  sleep loop for minutes), so a `--shrink` run leaves without it once its
  survivors are done.
  """
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)  # pylint: disable=protected-access
