// The engine's flight recorder, always on: the last kFlightSlots exchanges
// this process posted, each with its ordinal, call count, kind, bytes, state
// (posted by a first local device, on the wire, done) and the steady-clock
// times of those states. A ring: recording one costs a few stores under a
// mutex no exchange waits on. Read with jdist_flight_snapshot() (the
// watchdog puts the last rows in its abort report; jdist/runtime/
// flight_recorder.py merges them with the host exchanges).
#ifndef JDIST_COLLECTIVES_NATIVE_FLIGHT_H_
#define JDIST_COLLECTIVES_NATIVE_FLIGHT_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <mutex>

namespace jdist {

// Columns of one snapshot row, in order (flight_recorder.py's NATIVE_COLUMNS).
enum FlightColumn {
  kFlightId, kFlightOrdinal, kFlightSeq, kFlightKind, kFlightBytes, kFlightState,
  kFlightPosted, kFlightWire, kFlightDone, kFlightColumns
};

// States, in order (a later one implies the earlier ones).
enum FlightState { kFlightStatePosted = 0, kFlightStateWire = 1, kFlightStateDone = 2 };

class FlightRecorder {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr int64_t kFlightSlots = 256;

  // Records an exchange posted by its first local device; returns its id (>= 1).
  uint64_t Posted(int64_t ordinal, uint64_t seq, int kind, int64_t bytes, Clock::time_point t) {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t id = ++last_id_;
    int64_t* row = rows_[id % kFlightSlots];
    std::fill(row, row + kFlightColumns, 0);
    row[kFlightId] = static_cast<int64_t>(id);
    row[kFlightOrdinal] = ordinal;
    row[kFlightSeq] = static_cast<int64_t>(seq);
    row[kFlightKind] = kind;
    row[kFlightBytes] = bytes;
    row[kFlightState] = kFlightStatePosted;
    row[kFlightPosted] = Ns(t);
    return id;
  }

  // Moves exchange `id` to `state` at time `t` (ignored once its slot is reused).
  void Advance(uint64_t id, FlightState state, Clock::time_point t) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t* row = rows_[id % kFlightSlots];
    if (row[kFlightId] != static_cast<int64_t>(id)) return;
    row[kFlightState] = std::max<int64_t>(row[kFlightState], state);
    row[state == kFlightStateWire ? kFlightWire : kFlightDone] = Ns(t);
  }

  // Copies the newest `max_rows` rows, oldest first, into `out`; returns how many.
  int64_t Snapshot(int64_t* out, int64_t max_rows) {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t n = std::min<int64_t>({max_rows, kFlightSlots, static_cast<int64_t>(last_id_)});
    for (int64_t i = 0; i < n; ++i) {
      uint64_t id = last_id_ - n + 1 + i;
      std::copy(rows_[id % kFlightSlots], rows_[id % kFlightSlots] + kFlightColumns,
                out + i * kFlightColumns);
    }
    return n;
  }

 private:
  static int64_t Ns(Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
  }
  std::mutex mu_;
  uint64_t last_id_ = 0;
  int64_t rows_[kFlightSlots][kFlightColumns] = {};
};

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_FLIGHT_H_
