"""The watchdog's messages to the other ranks' watchdogs: status queries.

A helper of `jdist.runtime.watchdog`, on the watchdog's own communicator:
`query` asks every peer for its `Watchdog.status()` (answered by the peer's
watchdog thread, even while its main thread is stalled) and `answer`
replies to the peers' queries. A final query (the asking rank is about to
abort the job) first runs the peer's abort hooks (`flight_recorder.on_abort`:
`jdist.timeline` writes that rank's part of its trace).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from jdist.runtime import flight_recorder

QUERY_TAG = 7401
REPLY_TAG = 7402


class Peers:
  """Queries to and replies from the other ranks; sends never block.

  Args:
    comm: the watchdog's communicator.
    mpi: the `mpi4py.MPI` module.
  """

  def __init__(self, comm, mpi):
    self.comm, self._mpi = comm, mpi
    self.rank, self.size = comm.Get_rank(), comm.Get_size()
    self.pending: list[Any] = []  # sends not yet completed
    self._queries = 0

  def answer(self, status: Callable[[], dict[str, Any]]) -> None:
    """Replies `status()` to every query that has arrived."""
    mpi_status = self._mpi.Status()
    while self.comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=QUERY_TAG, status=mpi_status):
      source = mpi_status.Get_source()
      query = self.comm.recv(source=source, tag=QUERY_TAG)
      if isinstance(query, tuple):  # the querying rank is about to abort the job
        flight_recorder.run_abort_hooks()
      reply = dict(status(), query=query)
      self.pending.append(self.comm.isend(reply, dest=source, tag=REPLY_TAG))
    self.pending = [r for r in self.pending if not r.Test()]

  def query(self, status: Callable[[], dict[str, Any]], wait_s: float,
            final: bool = False) -> dict[int, dict[str, Any]]:
    """Every peer's status that arrives within `wait_s` seconds (answering theirs meanwhile).

    Args:
      status: this rank's status, for the queries it answers while it waits.
      wait_s: the longest wait for the replies.
      final: the peers run their abort hooks before they reply.
    """
    self._queries += 1
    query = (self._queries, "abort") if final else self._queries
    for peer in range(self.size):
      if peer != self.rank:
        self.pending.append(self.comm.isend(query, dest=peer, tag=QUERY_TAG))
    replies: dict[int, dict[str, Any]] = {}
    mpi_status = self._mpi.Status()
    deadline = time.monotonic() + wait_s
    while len(replies) < self.size - 1 and time.monotonic() < deadline:
      self.answer(status)
      while self.comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=REPLY_TAG, status=mpi_status):
        reply = self.comm.recv(source=mpi_status.Get_source(), tag=REPLY_TAG)
        if reply.get("query") == query:  # not a late answer to an earlier query
          replies[reply["rank"]] = reply
      time.sleep(0.02)
    return replies
