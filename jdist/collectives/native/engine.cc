// jdist's native exchange engine and its XLA FFI handler for CPU devices.
//
// Why it is shaped this way (see engine.h and docs/topologies.md):
//  * The FFI handler never blocks: it records its device's part and returns
//    an ffi::Future. XLA's CPU executor then runs other ready work on that
//    thread, so an exchange never holds up XLA's own collectives or another
//    exchange, whatever order the devices reach them in. That is what removes
//    the deadlock of blocking host callbacks, and the need for more XLA
//    threads than cores.
//  * The last local device to post reduces the local parts (plain compute)
//    segment by segment (4 MiB on the wire by default) and posts each
//    segment's non-blocking point-to-point MPI as soon as it is reduced:
//    reduce-scatter by direct sends, float32 adds for 16-bit payloads,
//    all-gather by direct sends. One engine thread progresses them. Messages
//    are tagged by the exchange's ordinal and segment, so exchanges that
//    become ready in a different order on two processes still pair up.
//  * A sum runs in device 0's buffer (XLA aliases a sum's output to its
//    input), so one device per process needs no copy at all; device 0
//    resumes only after the other devices copied the result out of it.
//  * Completions (copying the result to each device's output and completing
//    its future) run on a pool of threads that grows when all are busy: the
//    future's continuation runs the rest of the device's program on that
//    thread, which may block in an XLA collective until the other devices
//    arrive, so it must never be the engine thread or a thread another
//    completion waits for.

#include "engine.h"

#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ffi_types.h"
#include "halfs.h"
#include "pools.h"
#include "reduce.h"
#include "trace.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jdist {
namespace {

using Clock = std::chrono::steady_clock;

// Where an exchange's time goes, summed over exchanges when JDIST_NATIVE_PROFILE
// is set (printed by jdist_stop): for tuning, off the hot path otherwise.
struct Profile {
  std::atomic<int64_t> skew_ns{0}, local_ns{0}, first_ns{0}, add_ns{0},
      second_ns{0}, copy_ns{0}, count{0};
};
Profile profile;
const bool profiling = std::getenv("JDIST_NATIVE_PROFILE") != nullptr;
int64_t Ns(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count();
}


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
  std::atomic<int> segments_left{0};
  Clock::time_point ready_at, mpi_at;  // tracing: last local post, MPI start
};

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

class Engine {
 public:
  int Start(int comm_f, int devices, double timeout_s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (running_) return 0;
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) return Fail("MPI is not initialized");
    int provided = 0;
    MPI_Query_thread(&provided);
    if (provided != MPI_THREAD_MULTIPLE) return Fail("MPI lacks MPI_THREAD_MULTIPLE");
    MPI_Comm parent = MPI_Comm_f2c(comm_f);
    if (MPI_Comm_dup(parent, &comm_) != MPI_SUCCESS) return Fail("MPI_Comm_dup failed");
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
    segment_bytes_ = segment_env ? std::atoll(segment_env) : kDefaultSegmentBytes;
    devices_ = devices;
    timeout_s_ = timeout_s;
    next_seq_.assign(devices, {});
    stop_ = false;
    running_ = true;
    thread_ = std::thread([this] { Loop(); });
    return 0;
  }

  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!running_) return;
      stop_ = true;
      cv_.notify_all();
    }
    thread_.join();
    if (profiling && profile.count > 0) {
      double n = static_cast<double>(profile.count.load()) * 1e3;
      std::fprintf(stderr,
                   "jdist native profile, rank %d, %lld exchanges, mean us (segments summed): "
                   "device skew %.1f, local reduce %.1f, first phase %.1f, add %.1f, second "
                   "phase %.1f, copy-out per device %.1f\n",
                   rank_, static_cast<long long>(profile.count.load()), profile.skew_ns / n,
                   profile.local_ns / n, profile.first_ns / n, profile.add_ns / n,
                   profile.second_ns / n, profile.copy_ns / n / devices_);
    }
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    MPI_Comm_free(&comm_);
  }

  bool running() {
    std::lock_guard<std::mutex> lock(mu_);
    return running_;
  }
  const char* last_error() const { return error_.c_str(); }
  int64_t completed() const { return completed_.load(); }
  int64_t segments_completed() const { return segments_completed_.load(); }
  int64_t TakeTrace(int64_t* rows, int64_t max_rows) { return tracer_.Take(rows, max_rows); }
  int64_t SetSegmentBytes(int64_t bytes) { return segment_bytes_.exchange(bytes); }

  void Post(int device, int64_t ordinal, int kind, int elem, int64_t count, const void* in,
            void* out, JdistDone done, void* arg) {
    if (kind == JDIST_SUM && (elem == JDIST_F16 || elem == JDIST_BF16)) kind = JDIST_SUM16;
    std::shared_ptr<Exchange> ready;
    const char* error = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      error = Admit(device, ordinal, kind, elem, count, Part{in, out, done, arg}, &ready);
      if (ready) ++launching_;
    }
    // Outside the lock: completing a future runs the device's next work here,
    // which may post the next exchange.
    if (error) return done(arg, error);
    if (!ready) return;
    auto arrived = Clock::now();
    ready->ready_at = ready->mpi_at = arrived;
    if (profiling) {
      profile.skew_ns += Ns(ready->since, arrived);
      profile.count += 1;
    }
    Launch(ready);
  }

 private:
  static constexpr int kMaxSegments = 32;
  static constexpr int64_t kDefaultSegmentBytes = 4 << 20;

  // Records one device's part; sets `ready` when it completes the local
  // group. Returns an error message, or null. Called with mu_ held.
  const char* Admit(int device, int64_t ordinal, int kind, int elem, int64_t count,
                    const Part& part, std::shared_ptr<Exchange>* ready) {
    if (!running_ || stop_) return "jdist's native exchange engine is not running";
    if (device < 0 || device >= devices_) return "device index out of range";
    if (ordinal < 0 || 2 * (ordinal + 1) * max_segments_ - 1 > tag_ub_) {
      return "exchange ordinal beyond the MPI tag space (too many exchanges traced)";
    }
    uint64_t seq = next_seq_[device][ordinal]++;
    auto key = std::make_pair(ordinal, seq);
    auto& slot = forming_[key];
    if (!slot) {
      slot = std::make_shared<Exchange>();
      slot->ordinal = ordinal;
      slot->seq = seq;
      slot->kind = kind;
      slot->elem = elem;
      slot->count = count;
      slot->parts.resize(devices_);
      slot->present.assign(devices_, false);
      slot->since = Clock::now();
    } else if (slot->count != count || slot->elem != elem || slot->kind != kind ||
               slot->present[device]) {
      // The devices disagree on what exchange this is: a program error
      // that would otherwise mix unrelated buffers.
      return "local devices posted different exchanges under one ordinal";
    }
    slot->parts[device] = part;
    slot->present[device] = true;
    if (++slot->arrived == devices_) {
      *ready = slot;
      forming_.erase(key);
    }
    return nullptr;
  }

  int Fail(const char* why) {
    error_ = why;
    return -1;
  }

  size_t WireSize(const Exchange& e) const {
    return e.kind == JDIST_SUM16 ? 2 : ElemSize(e.elem);
  }

  int SegmentCount(const Exchange& e) const {
    const int64_t segment_bytes = segment_bytes_.load();
    if (e.kind == JDIST_GATHER || size_ == 1 || segment_bytes <= 0) return 1;
    int64_t bytes = e.count * static_cast<int64_t>(WireSize(e));
    // No empty segments: at most one per element.
    int64_t most = std::max<int64_t>(1, std::min<int64_t>(max_segments_, e.count));
    return static_cast<int>(
        std::clamp<int64_t>((bytes + segment_bytes - 1) / segment_bytes, 1, most));
  }

  int Tag(const Segment& s, int phase) const {
    return static_cast<int>(2 * (s.exchange->ordinal * max_segments_ + s.index) + phase);
  }

  // Elements [first, second) of segment `s` that `process` reduces.
  std::pair<int64_t, int64_t> Chunk(const Segment& s, int process) const {
    int64_t per = (s.count + size_ - 1) / size_;
    int64_t begin = std::min<int64_t>(s.count, per * process);
    return {s.begin + begin, s.begin + std::min<int64_t>(s.count, begin + per)};
  }

  // On the last local device's thread: reduces the local parts segment by
  // segment and posts each segment's MPI as soon as it is reduced (the
  // engine thread progresses it), so that the first segments are on the
  // wire while the last are still being added.
  void Launch(const std::shared_ptr<Exchange>& e) {
    const int segments = SegmentCount(*e);
    e->segments_left = segments;
    Prepare(*e);
    if (size_ == 1) {
      ReduceLocal(*e, 0, e->count);
      Finish(e);
      std::lock_guard<std::mutex> lock(mu_);
      --launching_;
      return;
    }
    const int64_t per = (e->count + segments - 1) / segments;
    for (int index = 0; index < segments; ++index) {
      auto segment = std::make_shared<Segment>();
      segment->exchange = e;
      segment->index = index;
      segment->begin = std::min<int64_t>(e->count, per * index);
      segment->count = std::min<int64_t>(e->count, segment->begin + per) - segment->begin;
      auto start = Clock::now();
      ReduceLocal(*e, segment->begin, segment->count);
      auto reduced = Clock::now();
      if (profiling) profile.local_ns += Ns(start, reduced);
      if (index == 0) e->mpi_at = reduced;
      Begin(*segment);
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(segment));
      if (index == segments - 1) --launching_;
      cv_.notify_one();
    }
  }

  // Where the exchange's result is assembled; gathers copy every part in.
  void Prepare(Exchange& e) {
    if (e.kind == JDIST_GATHER) {
      size_t block = e.count * ElemSize(e.elem);
      e.acc = pool_.Get(block * devices_ * size_);
      for (int i = 0; i < devices_; ++i) {
        std::memcpy(e.acc.get() + (rank_ * devices_ + i) * block, e.parts[i].in, block);
      }
      return;
    }
    // XLA aliases a sum's output to its input, so device 0's buffer can hold
    // the sum: the parts are added element by element (reading each before
    // writing it), and device 0 then needs no copy in or out (one device:
    // the exchange runs in place).
    const Part& first = e.parts[0];
    if (first.in == first.out) {
      e.acc = std::shared_ptr<char>(static_cast<char*>(first.out), [](char*) {});
    } else {
      e.acc = pool_.Get(e.count * WireSize(e));
    }
  }

  // Sums elements [begin, begin + n) of the local parts into the result.
  void ReduceLocal(Exchange& e, int64_t begin, int64_t n) {
    if (e.kind == JDIST_GATHER) return;  // copied in by Prepare
    const size_t w = WireSize(e);  // the element size too: 16-bit in, 16-bit out
    char* out = e.acc.get() + begin * w;
    std::vector<const char*> ins(devices_);
    for (int i = 0; i < devices_; ++i) ins[i] = static_cast<const char*>(e.parts[i].in) + begin * w;
    if (devices_ == 1 && ins[0] == out) return;  // in place
    if (e.kind == JDIST_SUM16) {
      std::vector<const void*> halves(ins.begin(), ins.end());
      Sum16(e.elem == JDIST_BF16, halves.data(), devices_, out, n);
      return;
    }
    SumParts(e.elem, ins, out, n);
  }

  // Sends to / receives from every peer; `send(p)` and `recv(p)` give the
  // (pointer, bytes) of each.
  template <typename S, typename R>
  void PostPhase(Segment& s, int phase, S send, R recv) {
    s.phase = phase;
    s.requests.clear();
    s.expected_bytes.clear();
    const int tag = Tag(s, phase);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      auto [ptr, bytes] = recv(p);
      MPI_Request request;
      MPI_Irecv(ptr, static_cast<int>(bytes), MPI_BYTE, p, tag, comm_, &request);
      s.requests.push_back(request);
      s.expected_bytes.push_back(static_cast<int>(bytes));
    }
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      auto [ptr, bytes] = send(p);
      MPI_Request request;
      MPI_Isend(ptr, static_cast<int>(bytes), MPI_BYTE, p, tag, comm_, &request);
      s.requests.push_back(request);
      s.expected_bytes.push_back(-1);
    }
  }

  void Begin(Segment& s) {
    if (profiling) s.mark = Clock::now();
    Exchange& e = *s.exchange;
    const size_t w = WireSize(e);
    char* acc = e.acc.get();
    if (e.kind == JDIST_GATHER) {
      size_t block = e.count * ElemSize(e.elem) * devices_;
      PostPhase(s, 1, [&](int) { return std::make_pair(acc + rank_ * block, block); },
                [&](int p) { return std::make_pair(acc + p * block, block); });
      return;
    }
    auto mine = Chunk(s, rank_);
    size_t mine_bytes = (mine.second - mine.first) * w;
    size_t per_bytes = ((s.count + size_ - 1) / size_) * w;
    s.recv = pool_.Get(per_bytes * size_);
    char* recv = s.recv.get();
    PostPhase(
        s, 0,
        [&](int p) {
          auto c = Chunk(s, p);
          return std::make_pair(acc + c.first * w, static_cast<size_t>(c.second - c.first) * w);
        },
        [&](int p) { return std::make_pair(recv + p * per_bytes, mine_bytes); });
  }

  // Called when every request of the segment's current phase completed.
  // Returns true when the segment is done.
  bool Advance(Segment& s) {
    Exchange& e = *s.exchange;
    if (profiling) {
      auto now = Clock::now();
      (e.kind == JDIST_GATHER || s.phase == 1 ? profile.second_ns : profile.first_ns) +=
          Ns(s.mark, now);
      s.mark = now;
    }
    if (e.kind == JDIST_GATHER || s.phase == 1) return true;
    const size_t w = WireSize(e);
    auto mine = Chunk(s, rank_);
    int64_t n = mine.second - mine.first;
    size_t per_bytes = ((s.count + size_ - 1) / size_) * w;
    char* acc = e.acc.get() + mine.first * w;
    if (e.kind == JDIST_SUM16) {
      std::vector<const void*> parts;
      parts.push_back(acc);
      for (int p = 0; p < size_; ++p) {
        if (p != rank_) parts.push_back(s.recv.get() + p * per_bytes);
      }
      Sum16(e.elem == JDIST_BF16, parts.data(), static_cast<int>(parts.size()), acc, n);
    } else {
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        SumParts(e.elem, {acc, s.recv.get() + p * per_bytes}, acc, n);
      }
    }
    s.recv.reset();
    if (profiling) {
      auto now = Clock::now();
      profile.add_ns += Ns(s.mark, now);
      s.mark = now;
    }
    char* base = e.acc.get();
    PostPhase(
        s, 1, [&](int) { return std::make_pair(acc, static_cast<size_t>(n) * w); },
        [&](int p) {
          auto c = Chunk(s, p);
          return std::make_pair(base + c.first * w, static_cast<size_t>(c.second - c.first) * w);
        });
    return false;
  }

  // Copies the result to every device's output (in parallel) and completes.
  void Finish(const std::shared_ptr<Exchange>& e, const char* error = nullptr) {
    size_t bytes = e->kind == JDIST_GATHER
                       ? e->count * ElemSize(e->elem) * devices_ * size_
                       : e->count * WireSize(*e);
    completed_.fetch_add(1);
    tracer_.Record(e->ordinal, e->seq, e->kind, static_cast<int64_t>(bytes), e->since,
                   e->ready_at, e->mpi_at, Clock::now());
    std::string message = error ? error : "";
    auto complete = [e, message](int d) {
      const Part& part = e->parts[d];
      if (part.done == nullptr) return;  // a device that never posted (stranded)
      part.done(part.arg, message.empty() ? nullptr : message.c_str());
    };
    // Where device 0's output holds the result (ReduceLocal), its program may
    // overwrite that buffer as soon as it resumes: it resumes once every other
    // device has copied from it, in a task of its own (a resumed device may
    // block in an XLA collective until the others resume too).
    const bool first_holds_result =
        devices_ > 1 && e->acc != nullptr && e->acc.get() == e->parts[0].out;
    auto copies_left = std::make_shared<std::atomic<int>>(devices_ - 1);
    for (int d = first_holds_result ? 1 : 0; d < devices_; ++d) {
      completions_.Run([this, e, d, bytes, message, complete, first_holds_result,
                        copies_left] {
        const Part& part = e->parts[d];
        if (part.done != nullptr && message.empty() && part.out != e->acc.get()) {
          auto start = Clock::now();
          std::memcpy(part.out, e->acc.get(), bytes);
          if (profiling) profile.copy_ns += Ns(start, Clock::now());
        }
        if (first_holds_result && copies_left->fetch_sub(1) == 1) {
          completions_.Run([complete] { complete(0); });
        }
        complete(d);
      });
    }
  }

  bool CheckReceives(Segment& s, std::vector<MPI_Status>& statuses, std::string* why) {
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

  [[noreturn]] void Abort(const std::string& what) {
    std::fprintf(stderr, "jdist: rank %d: %s. Aborting the job.\n", rank_, what.c_str());
    std::fflush(stderr);
    MPI_Abort(comm_, 1);
    std::abort();
  }

  void CheckDeadlines(const std::vector<std::shared_ptr<Segment>>& active) {
    auto now = Clock::now();
    auto too_old = [&](const Exchange& e) {
      return std::chrono::duration<double>(now - e.since).count() > timeout_s_;
    };
    for (auto& s : active) {
      const auto& e = s->exchange;
      if (too_old(*e)) {
        Abort("native exchange " + std::to_string(e->ordinal) + " (call " +
              std::to_string(e->seq) + ") waited over " + std::to_string(int(timeout_s_)) +
              " s for another process (stalled, or running a different program)");
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, e] : forming_) {
      if (too_old(*e)) {
        Abort("native exchange " + std::to_string(key.first) + " waited over " +
              std::to_string(int(timeout_s_)) + " s for " +
              std::to_string(devices_ - e->arrived) + " of this process's devices");
      }
    }
  }

  void Loop() {
    std::deque<std::shared_ptr<Exchange>> stranded;
    RunLoop(stranded);
    for (auto& e : stranded) Finish(e, "jdist's native exchange engine stopped (process exiting)");
  }

  void RunLoop(std::deque<std::shared_ptr<Exchange>>& stranded) {
    std::vector<std::shared_ptr<Segment>> active;
    std::vector<MPI_Status> statuses;
    int idle_polls = 0;
    auto last_check = Clock::now();
    while (true) {
      std::deque<std::shared_ptr<Segment>> fresh;
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (active.empty() && queue_.empty() && (!stop_ || launching_ > 0)) {
          cv_.wait_for(lock, std::chrono::milliseconds(200));
        }
        if (stop_ && active.empty() && queue_.empty() && launching_ == 0) {
          // Exchanges some local device never posted would leave the others
          // waiting forever: complete them with an error instead.
          for (auto& entry : forming_) stranded.push_back(entry.second);
          forming_.clear();
          break;
        }
        fresh.swap(queue_);  // segments whose MPI the launching thread posted
      }
      for (auto& s : fresh) active.push_back(std::move(s));
      bool progressed = !fresh.empty();
      for (size_t i = 0; i < active.size();) {
        Segment& s = *active[i];
        int flag = 0;
        statuses.resize(s.requests.size());
        MPI_Testall(static_cast<int>(s.requests.size()), s.requests.data(), &flag,
                    statuses.data());
        if (!flag) {
          ++i;
          continue;
        }
        progressed = true;
        std::string why;
        if (!CheckReceives(s, statuses, &why)) Abort(why);
        if (Advance(s)) {
          segments_completed_.fetch_add(1);
          if (s.exchange->segments_left.fetch_sub(1) == 1) Finish(s.exchange);
          active[i] = active.back();
          active.pop_back();
        } else {
          ++i;
        }
      }
      auto now = Clock::now();
      if (now - last_check > std::chrono::seconds(1)) {
        last_check = now;
        CheckDeadlines(active);
      }
      // Poll MPI eagerly while messages are moving, then back off: on a
      // machine with fewer cores than busy threads a spinning engine takes
      // the core the peer's work needs.
      if (progressed) {
        idle_polls = 0;
      } else if (!active.empty()) {
        ++idle_polls;
        if (idle_polls > 2000) {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        } else if (idle_polls > 200) {
          sched_yield();
        }
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool running_ = false;
  bool stop_ = false;
  std::string error_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  int tag_ub_ = 32767;
  int devices_ = 1;
  double timeout_s_ = 600;
  std::vector<std::map<int64_t, uint64_t>> next_seq_;
  std::map<std::pair<int64_t, uint64_t>, std::shared_ptr<Exchange>> forming_;
  std::deque<std::shared_ptr<Segment>> queue_;
  int launching_ = 0;  // exchanges whose segments are still being posted
  int max_segments_ = 1;  // segments per exchange at most (fixed at start: tags)
  std::atomic<int64_t> segment_bytes_{0};  // wire bytes per segment; <= 0: whole
  std::thread thread_;
  std::atomic<int64_t> completed_{0};
  std::atomic<int64_t> segments_completed_{0};  // pieces that crossed processes
  BufferPool pool_;
  Completions completions_;
  Tracer tracer_;
};

// Never destroyed: completion threads may outlive static destruction.
Engine& TheEngine() {
  static Engine* engine = new Engine();
  return *engine;
}

void CompletePromise(void* arg, const char* error) {
  auto* promise = static_cast<ffi::Promise*>(arg);
  if (error) {
    promise->SetError(ffi::Error::Internal(error));
  } else {
    promise->SetAvailable();
  }
  delete promise;
}

ffi::Future ExchangeOnHost(ffi::Buffer<ffi::S32> device, ffi::AnyBuffer x,
                           ffi::Result<ffi::AnyBuffer> y, int64_t ordinal, int32_t kind) {
  ffi::Promise promise;
  ffi::Future future(promise);
  int elem = ElemOf(x.element_type());
  if (elem < 0 || (kind == JDIST_SUM && elem == JDIST_U8)) {
    promise.SetError(ffi::Error::InvalidArgument("jdist: unsupported dtype for this exchange"));
    return future;
  }
  // Gathers move bytes: any element type, counted in bytes.
  int64_t count = x.element_count();
  if (kind == JDIST_GATHER) {
    count = static_cast<int64_t>(x.size_bytes());
    elem = JDIST_U8;
  }
  TheEngine().Post(device.typed_data()[0], ordinal, kind, elem, count, x.untyped_data(),
                   y->untyped_data(), &CompletePromise, new ffi::Promise(promise));
  return future;
}

// Returns its inputs, which XLA aliases to its outputs: nothing to do. Its
// use is the data dependency: every consumer of a step's reduced buckets
// reads them through one join, so XLA cannot schedule (and reuse memory for)
// an update between two exchanges, which would make the rest of the backward
// pass wait for the first exchange.
ffi::Error JoinOnHost(ffi::RemainingArgs, ffi::RemainingRets) { return ffi::Error::Success(); }

}  // namespace
}  // namespace jdist

extern "C" {

int jdist_start(int comm_f, int local_devices, double timeout_s) {
  return jdist::TheEngine().Start(comm_f, local_devices, timeout_s);
}
void jdist_stop(void) { jdist::TheEngine().Stop(); }
int jdist_running(void) { return jdist::TheEngine().running() ? 1 : 0; }
const char* jdist_last_error(void) { return jdist::TheEngine().last_error(); }
int64_t jdist_completed(void) { return jdist::TheEngine().completed(); }
int64_t jdist_trace_take(int64_t* rows, int64_t max_rows) {
  return jdist::TheEngine().TakeTrace(rows, max_rows);
}
int64_t jdist_segments_completed(void) { return jdist::TheEngine().segments_completed(); }
int64_t jdist_set_segment_bytes(int64_t bytes) {
  return jdist::TheEngine().SetSegmentBytes(bytes);
}
void jdist_post(int device, int64_t ordinal, int kind, int elem, int64_t count, const void* in,
                void* out, JdistDone done, void* arg) {
  jdist::TheEngine().Post(device, ordinal, kind, elem, count, in, out, done, arg);
}

}  // extern "C"

XLA_FFI_DEFINE_HANDLER_SYMBOL(JdistExchangeCpu, jdist::ExchangeOnHost,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("ordinal")
                                  .Attr<int32_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JdistJoinCpu, jdist::JoinOnHost,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
