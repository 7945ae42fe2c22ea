// The cross-process half of an exchange (engine.cc holds the local half):
// each segment of a sum crosses as a reduce-scatter by direct sends, a
// float32 add (16-bit payloads stay 16-bit on the wire), and an all-gather by
// direct sends, among every process (flat) or in two levels, the node and
// then the same local rank across nodes (node-aware, hierarchy.h: four
// phases); a gather crosses in one all-gather. Non-blocking point-to-point
// MPI on a communicator of its own, tagged by the exchange's ordinal, segment
// and phase, so that exchanges that become ready in a different order on two
// processes still pair up.
#ifndef JDIST_COLLECTIVES_NATIVE_POINT_TO_POINT_H_
#define JDIST_COLLECTIVES_NATIVE_POINT_TO_POINT_H_

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "engine.h"
#include "exchange.h"
#include "halfs.h"
#include "hierarchy.h"
#include "pools.h"
#include "reduce.h"

namespace jdist {

class PointToPoint {
 public:
  explicit PointToPoint(BufferPool* pool) : pool_(pool) {}

  // Duplicates the communicator given by its Fortran handle; sums are
  // node-aware where `nodes` (each rank's node index) is given, else flat.
  // Returns an error message, or null.
  const char* Open(int comm_f, const int* nodes) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) return "MPI is not initialized";
    int provided = 0;
    MPI_Query_thread(&provided);
    if (provided != MPI_THREAD_MULTIPLE) return "MPI lacks MPI_THREAD_MULTIPLE";
    if (MPI_Comm_dup(MPI_Comm_f2c(comm_f), &comm_) != MPI_SUCCESS) return "MPI_Comm_dup failed";
    MPI_Comm_dup(comm_, &background_comm_);  // background sums' (pacing.h)
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    void* tag_ub = nullptr;
    int found = 0;
    MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_ub, &found);
    tag_ub_ = found ? *static_cast<int*>(tag_ub) : 32767;
    // Each segment of an exchange has tags of its own; an MPI with few tags
    // (the standard's minimum is 32767) keeps exchanges whole.
    max_segments_ = tag_ub_ >= (1 << 24) ? kMaxSegments : 1;
    const char* segment_env = std::getenv("JDIST_NATIVE_SEGMENT_BYTES");
    SetSegmentBytes(segment_env ? std::atoll(segment_env) : kAutoSegments);
    flat_ = FlatLevels(rank_, size_);
    node_levels_.clear();
    const char* error = nodes ? NodeLevels(rank_, size_, nodes, &node_levels_) : nullptr;
    if (error) Close();
    use_nodes_ = !node_levels_.empty();
    return error;
  }

  void Close() {
    MPI_Comm_free(&comm_);
    MPI_Comm_free(&background_comm_);
  }

  MPI_Comm comm() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  bool hierarchical() const { return use_nodes_.load(); }

  // Makes the next sums node-aware (1) or flat (0), between steps on every
  // process alike; returns the previous setting, or -1 (and changes nothing)
  // where no node map was given at start.
  int SetHierarchical(int on) {
    if (node_levels_.empty()) return on ? -1 : 0;
    return use_nodes_.exchange(on != 0) ? 1 : 0;
  }

  // Whether every tag of exchange `ordinal` fits in the MPI's tag space.
  bool TagsFit(int64_t ordinal) const {
    return ordinal >= 0 && kPhases * (ordinal + 1) * max_segments_ - 1 <= tag_ub_;
  }

  // Wire bytes per segment; 0: whole; negative (kAutoSegments): the default
  // of the groups a sum crosses in. Returns the previous setting.
  int64_t SetSegmentBytes(int64_t bytes) {
    return segment_bytes_.exchange(bytes < 0 ? kAutoSegments : bytes);
  }

  // How many segments exchange `e` crosses in; fixes the groups a sum crosses
  // in (every segment crosses in the same ones). Node-aware sums default to
  // small segments: a segment's shared-memory phases then overlap the other
  // segments' bytes on the node's link instead of adding to them (16 MB on
  // the rig at 1 Gbit/s: 4 MiB segments ~200 ms, 256 KiB ~160 ms).
  int SegmentCount(Exchange& e) {
    if (e.kind != JDIST_GATHER && e.levels == nullptr) {
      e.levels = use_nodes_.load() ? &node_levels_ : &flat_;
    }
    int64_t segment_bytes = segment_bytes_.load();
    if (segment_bytes == kAutoSegments) {
      segment_bytes = e.levels == &node_levels_ ? kNodeSegmentBytes : kDefaultSegmentBytes;
    }
    if (e.kind == JDIST_GATHER || size_ == 1 || segment_bytes <= 0) return 1;
    int64_t bytes = e.count * static_cast<int64_t>(WireSize(e));
    // No empty segments: at most one per element.
    int64_t most = std::max<int64_t>(1, std::min<int64_t>(max_segments_, e.count));
    return static_cast<int>(
        std::clamp<int64_t>((bytes + segment_bytes - 1) / segment_bytes, 1, most));
  }

  // Posts the segment's first phase, once its elements are reduced locally.
  void Begin(Segment& s) {
    if (profiling) s.mark = Clock::now();
    Exchange& e = *s.exchange;
    char* acc = e.acc.get();
    if (e.kind == JDIST_GATHER) {  // one all-gather of whole blocks among every process
      size_t block = e.count * ElemSize(e.elem) * e.parts.size();
      PostPhase(s, 0, flat_[0], [&](int) { return std::make_pair(acc + rank_ * block, block); },
                [&](int p) { return std::make_pair(acc + p * block, block); });
      return;
    }
    // Every segment of a sum crosses in the groups SegmentCount chose.
    if (e.levels == nullptr) e.levels = use_nodes_.load() ? &node_levels_ : &flat_;
    PostStep(s, 0);
  }

  // Called when every request of the segment's current phase completed: adds
  // the peers' chunks after a reduce-scatter, and posts the next phase.
  // Returns true when the segment is done.
  bool Advance(Segment& s) {
    Exchange& e = *s.exchange;
    const int levels = e.levels ? static_cast<int>(e.levels->size()) : 0;  // gathers: none
    const bool scattered = e.kind != JDIST_GATHER && s.phase < levels;
    if (profiling) {
      auto now = Clock::now();
      (scattered ? profile.first_ns : profile.second_ns) += Ns(s.mark, now);
      s.mark = now;
    }
    if (e.kind == JDIST_GATHER || s.phase == 2 * levels - 1) return true;
    if (scattered) AddReceived(s);
    PostStep(s, s.phase + 1);
    return false;
  }

  // Whether every receive of the completed phase got the bytes expected;
  // otherwise says why in `why` (the processes run different programs).
  bool CheckReceives(const Segment& s, const std::vector<MPI_Status>& statuses,
                     std::string* why) const {
    for (size_t i = 0; i < s.requests.size(); ++i) {
      if (s.expected_bytes[i] < 0) continue;
      int got = 0;
      MPI_Get_count(&statuses[i], MPI_BYTE, &got);
      if (got != s.expected_bytes[i]) {
        *why = "exchange " + std::to_string(s.exchange->ordinal) + ": rank " +
               std::to_string(statuses[i].MPI_SOURCE) + " sent " + std::to_string(got) +
               " bytes where " + std::to_string(s.expected_bytes[i]) +
               " were expected: the processes run different exchanges (different "
               "programs or shapes)";
        return false;
      }
    }
    return true;
  }

 private:
  static constexpr int kMaxSegments = 64;
  static constexpr int kPhases = 4;  // tags per segment: two levels of two phases at most
  static constexpr int64_t kDefaultSegmentBytes = 4 << 20;  // flat sums
  static constexpr int64_t kNodeSegmentBytes = 256 << 10;   // node-aware sums
  static constexpr int64_t kAutoSegments = -1;  // segment_bytes_: by the groups

  // Background sums' segments past max_segments_ reuse tags, never two with
  // one tag in flight (pacing.h), so MPI's message order pairs them.
  int Tag(const Segment& s, int phase) const {
    return static_cast<int>(kPhases * (s.exchange->ordinal * max_segments_ +
                                       s.index % max_segments_) + phase);
  }

  // The range of segment `s` that level `level` splits among its group: the
  // whole segment, then this process's chunk of each level above.
  std::pair<int64_t, int64_t> Range(const Segment& s, int level) const {
    int64_t begin = s.begin, count = s.count;
    for (int i = 0; i < level; ++i) {
      const Group& g = (*s.exchange->levels)[i];
      auto c = ChunkOf(begin, count, g.size(), g.me);
      begin = c.first;
      count = c.second - c.first;
    }
    return {begin, count};
  }

  // Posts sum phase `phase`: a reduce-scatter at level `phase` (into s.recv,
  // one chunk per member), or, past the last level, the all-gather that
  // mirrors one.
  void PostStep(Segment& s, int phase) {
    const std::vector<Group>& plan = *s.exchange->levels;
    const int levels = static_cast<int>(plan.size());
    const bool scatter = phase < levels;
    const Group& g = plan[scatter ? phase : 2 * levels - 1 - phase];
    auto [begin, count] = Range(s, scatter ? phase : 2 * levels - 1 - phase);
    const size_t w = WireSize(*s.exchange);
    char* acc = s.exchange->acc.get();
    auto piece = [&, begin = begin, count = count](int j) {
      auto c = ChunkOf(begin, count, g.size(), j);
      return std::make_pair(acc + c.first * w, static_cast<size_t>(c.second - c.first) * w);
    };
    const auto mine = piece(g.me);
    if (!scatter) {
      PostPhase(s, phase, g, [&](int) { return mine; }, piece);
      return;
    }
    const size_t per_bytes = ((count + g.size() - 1) / g.size()) * w;
    s.recv = pool_->Get(per_bytes * g.size());
    char* recv = s.recv.get();
    PostPhase(s, phase, g, piece,
              [&](int j) { return std::make_pair(recv + j * per_bytes, mine.second); });
  }

  // After the reduce-scatter of phase `s.phase`: adds the members' chunks
  // (in s.recv) into this process's chunk.
  void AddReceived(Segment& s) {
    Exchange& e = *s.exchange;
    const Group& g = (*e.levels)[s.phase];
    auto [begin, count] = Range(s, s.phase);
    auto mine = ChunkOf(begin, count, g.size(), g.me);
    const int64_t n = mine.second - mine.first;
    const size_t w = WireSize(e);
    const size_t per_bytes = ((count + g.size() - 1) / g.size()) * w;
    char* acc = e.acc.get() + mine.first * w;
    std::vector<const char*> parts{acc};
    for (int j = 0; j < g.size(); ++j) {
      if (j != g.me) parts.push_back(s.recv.get() + j * per_bytes);
    }
    if (e.kind == JDIST_SUM16) {
      std::vector<const void*> halves(parts.begin(), parts.end());
      Sum16(e.elem == JDIST_BF16, halves.data(), static_cast<int>(halves.size()), acc, n);
    } else {
      SumParts(e.elem, parts, acc, n);
    }
    s.recv.reset();
    if (profiling) {
      auto now = Clock::now();
      profile.add_ns += Ns(s.mark, now);
      s.mark = now;
    }
  }

  // Sends to / receives from every other member of `g`; `send(j)` and
  // `recv(j)` give the (pointer, bytes) for member j.
  template <typename S, typename R>
  void PostPhase(Segment& s, int phase, const Group& g, S send, R recv) {
    s.phase = phase;
    s.requests.clear();
    s.expected_bytes.clear();
    const int tag = Tag(s, phase);
    MPI_Comm comm = s.exchange->background ? background_comm_ : comm_;
    // Receives are posted first, so a peer's send finds its buffer ready.
    for (bool receive : {true, false}) {
      for (int j = 0; j < g.size(); ++j) {
        if (j == g.me) continue;
        auto [ptr, bytes] = receive ? recv(j) : send(j);
        MPI_Request request;
        if (receive) {
          MPI_Irecv(ptr, static_cast<int>(bytes), MPI_BYTE, g.ranks[j], tag, comm, &request);
        } else {
          MPI_Isend(ptr, static_cast<int>(bytes), MPI_BYTE, g.ranks[j], tag, comm, &request);
        }
        s.requests.push_back(request);
        s.expected_bytes.push_back(receive ? static_cast<int>(bytes) : -1);
      }
    }
  }

  BufferPool* pool_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm background_comm_ = MPI_COMM_NULL;  // background sums' (pacing.h)
  int rank_ = 0;
  int size_ = 1;
  int tag_ub_ = 32767;
  int max_segments_ = 1;  // segments per exchange at most (fixed at open: tags)
  std::atomic<int64_t> segment_bytes_{kAutoSegments};  // wire bytes per segment; 0: whole
  // A sum's reduce-scatter groups, outermost first: one of every process (also
  // for gathers), or the node's and then the local rank's across nodes.
  std::vector<Group> flat_, node_levels_;
  std::atomic<bool> use_nodes_{false};
};

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_POINT_TO_POINT_H_
