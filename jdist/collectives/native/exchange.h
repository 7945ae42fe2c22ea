// What the engine (engine.cc) keeps per exchange and per segment, and where
// their time goes when profiling.
#ifndef JDIST_COLLECTIVES_NATIVE_EXCHANGE_H_
#define JDIST_COLLECTIVES_NATIVE_EXCHANGE_H_

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "engine.h"
#include "hierarchy.h"
#include "reduce.h"

namespace jdist {

using Clock = std::chrono::steady_clock;

inline int64_t Ns(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}

// Where an exchange's time goes, summed over exchanges when JDIST_NATIVE_PROFILE
// is set (printed by jdist_stop): for tuning, off the hot path otherwise.
struct Profile {
  std::atomic<int64_t> skew_ns{0}, local_ns{0}, first_ns{0}, add_ns{0},
      second_ns{0}, copy_ns{0}, count{0};
};
inline Profile profile;
inline const bool profiling = std::getenv("JDIST_NATIVE_PROFILE") != nullptr;

// Prints the profile's means per exchange to stderr (at engine stop).
inline void ReportProfile(int rank, int devices) {
  if (profile.count == 0) return;
  double n = static_cast<double>(profile.count.load()) * 1e3;
  std::fprintf(stderr,
               "jdist native profile, rank %d, %lld exchanges, mean us (segments summed): "
               "device skew %.1f, local reduce %.1f, first phase %.1f, add %.1f, second "
               "phase %.1f, copy-out per device %.1f\n",
               rank, static_cast<long long>(profile.count.load()), profile.skew_ns / n,
               profile.local_ns / n, profile.first_ns / n, profile.add_ns / n,
               profile.second_ns / n, profile.copy_ns / n / devices);
}

// One local device's part of an exchange, and how to tell it it is done.
struct Part {
  const void* in = nullptr;
  void* out = nullptr;
  JdistDone done = nullptr;
  void* arg = nullptr;
};

// What the local devices posted under one ordinal and call count.
struct Exchange {
  int64_t ordinal = 0;
  uint64_t seq = 0;
  int kind = 0;
  int elem = 0;
  int64_t count = 0;
  std::vector<Part> parts;
  std::vector<bool> present;
  int arrived = 0;
  Clock::time_point since;
  std::shared_ptr<char> acc;  // sums: count wire elements; gathers: all replicas
  const std::vector<Group>* levels = nullptr;  // sums: the groups it crosses in (hierarchy.h)
  std::atomic<int> segments_left{0};
  Clock::time_point ready_at, mpi_at;  // tracing: last local post, MPI start
  uint64_t flight_id = 0;  // its row in the flight recorder (flight.h)
  // Background sums (pacing.h): paced; reduced locally; elements per segment.
  bool background = false, reduced = false;
  int64_t segment_elems = 0;
};

// Bytes per element on the wire: 16-bit sums stay 16-bit.
inline size_t WireSize(const Exchange& e) {
  return e.kind == JDIST_SUM16 ? 2 : ElemSize(e.elem);
}

// A contiguous piece of an exchange that crosses processes on its own (a
// reduce-scatter by direct sends, then an all-gather), so that MPI moves one
// piece while the next is still being reduced locally. A gather is one.
struct Segment {
  std::shared_ptr<Exchange> exchange;
  int index = 0;
  int64_t begin = 0;  // first element of the exchange in this segment
  int64_t count = 0;
  std::shared_ptr<char> recv;  // sums: one chunk per peer
  std::vector<MPI_Request> requests;
  std::vector<int> expected_bytes;  // per request, receives only (else -1)
  int phase = 0;
  Clock::time_point mark;  // profiling: when the current stage started
};

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_EXCHANGE_H_
