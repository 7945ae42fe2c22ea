// The engine's exchange timeline, kept when JDIST_NATIVE_TRACE is set (or
// jdist_trace_enable(1): jdist.timeline turns it on for its window): one
// row per completed exchange with the steady-clock times (CLOCK_MONOTONIC,
// the clock of Python's time.monotonic_ns) at which its first local device
// posted it, the last one did, its MPI part started and it completed. Read
// with jdist_trace_take(); benchmarks use it to show which exchanges ran
// while the backward pass was still computing.
#ifndef JDIST_COLLECTIVES_NATIVE_TRACE_H_
#define JDIST_COLLECTIVES_NATIVE_TRACE_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace jdist {

// Columns of one row, in order.
enum TraceColumn {
  kTraceOrdinal, kTraceSeq, kTraceKind, kTraceBytes, kTraceFirstPost, kTraceLastPost,
  kTraceMpiStart, kTraceDone, kTraceColumns
};

class Tracer {
 public:
  using Clock = std::chrono::steady_clock;

  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  // Returns whether it was enabled.
  bool SetEnabled(bool on) { return enabled_.exchange(on); }

  void Record(int64_t ordinal, uint64_t seq, int kind, int64_t bytes, Clock::time_point first,
              Clock::time_point last, Clock::time_point mpi, Clock::time_point done) {
    if (!enabled()) return;
    int64_t row[kTraceColumns] = {ordinal, static_cast<int64_t>(seq), kind, bytes, Ns(first),
                                  Ns(last), Ns(mpi), Ns(done)};
    std::lock_guard<std::mutex> lock(mu_);
    if (rows_.size() >= kMaxRows * kTraceColumns) return;  // bounded: drop the newest
    rows_.insert(rows_.end(), row, row + kTraceColumns);
  }

  // Moves up to `max_rows` of the oldest rows into `out`; returns how many.
  int64_t Take(int64_t* out, int64_t max_rows) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = std::min<int64_t>(max_rows, rows_.size() / kTraceColumns);
    std::copy(rows_.begin(), rows_.begin() + n * kTraceColumns, out);
    rows_.erase(rows_.begin(), rows_.begin() + n * kTraceColumns);
    return n;
  }

 private:
  static constexpr size_t kMaxRows = 1 << 20;
  static int64_t Ns(Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  }
  std::atomic<bool> enabled_{std::getenv("JDIST_NATIVE_TRACE") != nullptr};
  std::mutex mu_;
  std::vector<int64_t> rows_;
};

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_TRACE_H_
