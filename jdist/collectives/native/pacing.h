// Background sums yield to a step's own exchanges (engine.cc runs them).
//
// A sum posted with JDIST_BACKGROUND (deferred.cc's starts: DiLoCo's outer
// sync, on the wire across several inner steps) would otherwise hand all its
// bytes to MPI at once: a step's own small exchange posted after it then
// queues behind them in the link's queues (MPI's TCP connection, socket
// buffers, a shaped link's backlog) until the whole sum is through, which is
// head-of-line blocking (docs/diloco.md). Paced, it crosses in small
// segments ($JDIST_NATIVE_BACKGROUND_SEGMENT_BYTES, 64 KiB by default), one
// at a time: the next is posted only when the last crossed, so at most one
// segment's bytes are queued ahead of an urgent exchange. In-step exchanges
// are never held back.
//
// The protocol stays deterministic whatever the local timing: background
// sums run on a communicator of their own (point_to_point.h), in one lane
// per ordinal, in the order they became ready (their call order, the same
// on every process), each segment after the previous one. Messages with the
// same tag (segments past the tag space's count reuse tags) are then posted
// in the same order on every process, which MPI's non-overtaking rule pairs
// correctly; lanes of different ordinals use different tags and never wait
// for each other, so no process waits on an order another one chose.
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

#include "exchange.h"

namespace jdist {

class Pacer {
 public:
  Pacer() {
    const char* env = std::getenv("JDIST_NATIVE_BACKGROUND_SEGMENT_BYTES");
    segment_bytes_ = env ? std::atoll(env) : kDefaultSegmentBytes;
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

  // `e` is reduced locally: returns its lane's next segment to post, if the
  // lane was idle (else the segment in flight's completion posts it).
  std::shared_ptr<Segment> Reduced(Exchange& e) {
    std::lock_guard<std::mutex> lock(mu_);
    e.reduced = true;
    return NextLocked(e.ordinal);
  }

  // Segment `s` of a background sum crossed: the next one of its lane to
  // post, or null.
  std::shared_ptr<Segment> Crossed(const Segment& s) {
    std::lock_guard<std::mutex> lock(mu_);
    lanes_[s.exchange->ordinal].busy = false;
    return NextLocked(s.exchange->ordinal);
  }

 private:
  static constexpr int64_t kDefaultSegmentBytes = 64 << 10;

  // One ordinal's background sums, oldest first; `next`: the first one's next
  // segment; `busy`: a segment is on the wire.
  struct Lane {
    std::deque<std::shared_ptr<Exchange>> exchanges;
    int next = 0;
    bool busy = false;
  };

  std::shared_ptr<Segment> NextLocked(int64_t ordinal) {
    auto found = lanes_.find(ordinal);
    if (found == lanes_.end()) return nullptr;
    Lane& lane = found->second;
    if (lane.busy || lane.exchanges.empty() || !lane.exchanges.front()->reduced) {
      return nullptr;
    }
    auto segment = std::make_shared<Segment>();
    segment->exchange = lane.exchanges.front();
    const Exchange& e = *segment->exchange;
    segment->index = lane.next++;
    segment->begin = std::min<int64_t>(e.count, e.segment_elems * segment->index);
    segment->count = std::min<int64_t>(e.count, segment->begin + e.segment_elems) - segment->begin;
    lane.busy = true;
    if (segment->begin + segment->count == e.count) {  // its last: the lane moves on
      lane.exchanges.pop_front();
      lane.next = 0;
    }
    return segment;
  }

  std::mutex mu_;
  std::map<int64_t, Lane> lanes_;
  std::atomic<int64_t> segment_bytes_{kDefaultSegmentBytes};
};

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_PACING_H_
