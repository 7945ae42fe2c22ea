// Background sums yield to a step's own exchanges (engine.cc runs them).
//
// A sum posted with JDIST_BACKGROUND (deferred.cc's starts: DiLoCo's outer
// sync, on the wire across several inner steps) would otherwise hand all its
// bytes to MPI at once: a step's own small exchange posted after it then
// queues behind them in the link's queues (MPI's TCP connection, socket
// buffers, a shaped link's backlog) until the whole sum is through, which is
// head-of-line blocking (docs/diloco.md). Paced, it crosses in small
// segments ($JDIST_NATIVE_BACKGROUND_SEGMENT_BYTES, 64 KiB by default), a
// window of them at a time ($JDIST_NATIVE_BACKGROUND_WINDOW, 1 by default):
// the next is posted only when an earlier one crossed, so at most the
// window's bytes are queued ahead of an urgent exchange. In-step exchanges
// are never held back.
//
// The protocol stays deterministic whatever the local timing: background
// sums run on a communicator of their own (point_to_point.h), in one lane
// per ordinal, in the order they became ready (their call order, the same
// on every process), segment by segment, the next sum once the previous one
// crossed. Segments past the tag space's count per exchange (32 or more)
// reuse tags, that count apart; the window is at most 32, so never while
// one with the same tag is in flight, and MPI's non-overtaking rule pairs
// them. Lanes of different ordinals use different tags and never wait for
// each other, so no process waits on an order another one chose.
#ifndef JDIST_COLLECTIVES_NATIVE_PACING_H_
#define JDIST_COLLECTIVES_NATIVE_PACING_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "exchange.h"

namespace jdist {

class Pacer {
 public:
  Pacer() {
    const char* env = std::getenv("JDIST_NATIVE_BACKGROUND_SEGMENT_BYTES");
    segment_bytes_ = env ? std::atoll(env) : kDefaultSegmentBytes;
    const char* window = std::getenv("JDIST_NATIVE_BACKGROUND_WINDOW");
    window_ = std::clamp(window ? std::atoi(window) : 1, 1, 32);
  }

  // Whether background sums are paced; with <= 0 bytes they cross as any sum.
  bool on() const { return segment_bytes_.load() > 0; }
  int64_t SetSegmentBytes(int64_t bytes) { return segment_bytes_.exchange(bytes); }

  // Queues a background sum that just became ready on this process (call in
  // the order they do, under the engine's lock) and sets its segment count.
  void Enqueue(const std::shared_ptr<Exchange>& e) {
    const int64_t per = std::max<int64_t>(1, segment_bytes_.load() / WireSize(*e));
    e->segments_left = static_cast<int>(std::max<int64_t>(1, (e->count + per - 1) / per));
    e->segment_elems = per;
    std::lock_guard<std::mutex> lock(mu_);
    lanes_[e->ordinal].exchanges.push_back(e);
  }

  // `e` is reduced locally: returns its lane's segments to post now, if any
  // (else a completion of a segment in flight posts them).
  std::vector<std::shared_ptr<Segment>> Reduced(Exchange& e) {
    std::lock_guard<std::mutex> lock(mu_);
    e.reduced = true;
    return NextLocked(e.ordinal);
  }

  // Segment `s` of a background sum crossed: the segments of its lane to
  // post now, if any.
  std::vector<std::shared_ptr<Segment>> Crossed(const Segment& s) {
    std::lock_guard<std::mutex> lock(mu_);
    Lane& lane = lanes_[s.exchange->ordinal];
    --lane.in_flight;
    if (lane.in_flight == 0 && lane.next < 0) {  // its last segment crossed: the next sum
      lane.exchanges.pop_front();
      lane.next = 0;
    }
    return NextLocked(s.exchange->ordinal);
  }

 private:
  static constexpr int64_t kDefaultSegmentBytes = 64 << 10;

  // One ordinal's background sums, oldest first; `next`: the first one's next
  // segment (-1: all posted); `in_flight`: its segments on the wire.
  struct Lane {
    std::deque<std::shared_ptr<Exchange>> exchanges;
    int next = 0;
    int in_flight = 0;
  };

  // The lane's next segments, as many as its window has room for.
  std::vector<std::shared_ptr<Segment>> NextLocked(int64_t ordinal) {
    std::vector<std::shared_ptr<Segment>> ready;
    Lane& lane = lanes_[ordinal];
    while (lane.in_flight < window_ && lane.next >= 0 && !lane.exchanges.empty() &&
           lane.exchanges.front()->reduced) {
      ready.push_back(NextOf(lane));
    }
    return ready;
  }

  std::shared_ptr<Segment> NextOf(Lane& lane) {
    auto segment = std::make_shared<Segment>();
    segment->exchange = lane.exchanges.front();
    const Exchange& e = *segment->exchange;
    segment->index = lane.next++;
    segment->begin = std::min<int64_t>(e.count, e.segment_elems * segment->index);
    segment->count = std::min<int64_t>(e.count, segment->begin + e.segment_elems) - segment->begin;
    ++lane.in_flight;
    if (segment->begin + segment->count == e.count) lane.next = -1;  // its last
    return segment;
  }

  std::mutex mu_;
  std::map<int64_t, Lane> lanes_;
  std::atomic<int64_t> segment_bytes_{kDefaultSegmentBytes};
  int window_ = 1;  // segments of a lane on the wire at most
};

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_PACING_H_
