// jdist's native exchange engine (engine.h's C interface): it collects each
// exchange's parts from the local devices, runs the local half (local.h) on
// the last device to post, progresses the cross-process half
// (point_to_point.h) on a thread of its own, and completes every device. The
// CPU FFI handler (ffi_cpu.cc) and the CUDA one (exchange_cuda.cc) post to it.
//
// Why it is shaped this way (see engine.h and docs/topologies.md):
//  * Posting never blocks: the last local device to post reduces the local
//    parts (plain compute) segment by segment (4 MiB on the wire by default)
//    and posts each segment's non-blocking MPI as soon as it is reduced; one
//    engine thread progresses them. Messages are tagged by the exchange's
//    ordinal and segment, so exchanges that become ready in a different order
//    on two processes still pair up.
//  * A sum runs in device 0's buffer (XLA aliases a sum's output to its
//    input), so one device per process needs no copy at all; device 0
//    resumes only after the other devices copied the result out of it.
//  * A background sum (JDIST_BACKGROUND: deferred.cc's starts) is paced
//    (pacing.h): its segments are small and cross one at a time, on a
//    communicator of their own, so a step's own exchanges pass between them.
//  * Completions (copying the result to each device's output and completing
//    its future) run on a pool of threads that grows when all are busy: the
//    future's continuation runs the rest of the device's program on that
//    thread, which may block in an XLA collective until the other devices
//    arrive, so it must never be the engine thread or a thread another
//    completion waits for.

#include "engine.h"

#include <mpi.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "exchange.h"
#include "flight.h"
#include "forming.h"
#include "local.h"
#include "pacing.h"
#include "point_to_point.h"
#include "pools.h"
#include "reduce.h"
#include "trace.h"

namespace jdist {
namespace {

class Engine {
 public:
  int Start(int comm_f, int devices, double timeout_s, const int* nodes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (running_) return 0;
    if (const char* error = wire_.Open(comm_f, nodes)) return Fail(error);
    devices_ = devices;
    timeout_s_ = timeout_s;
    forming_.Reset(devices);
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
    if (profiling) ReportProfile(wire_.rank(), devices_);
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    wire_.Close();
  }

  bool running() {
    std::lock_guard<std::mutex> lock(mu_);
    return running_;
  }
  const char* last_error() const { return error_.c_str(); }
  int64_t completed() const { return completed_.load(); }
  int64_t segments_completed() const { return segments_completed_.load(); }
  int64_t segments_posted() const { return segments_posted_.load(); }
  int64_t TakeTrace(int64_t* rows, int64_t max_rows) { return tracer_.Take(rows, max_rows); }
  int EnableTrace(int on) { return tracer_.SetEnabled(on != 0) ? 1 : 0; }
  int64_t FlightSnapshot(int64_t* rows, int64_t max_rows) {
    return flight_.Snapshot(rows, max_rows);
  }
  PointToPoint& wire() { return wire_; }  // its settings: segments, hierarchy
  Pacer& pacer() { return pacer_; }  // background sums' segments

  void Post(int device, int64_t ordinal, int kind, int elem, int64_t count, const void* in,
            void* out, JdistDone done, void* arg) {
    const bool background = (kind & JDIST_BACKGROUND) && wire_.size() > 1 && pacer_.on();
    kind &= ~JDIST_BACKGROUND;
    if (kind == JDIST_SUM && (elem == JDIST_F16 || elem == JDIST_BF16)) kind = JDIST_SUM16;
    std::shared_ptr<Exchange> ready;
    const char* error = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      error = Admit(device, ordinal, kind, elem, count, Part{in, out, done, arg}, &ready);
      if (ready && background && kind != JDIST_GATHER) {
        ready->background = true;
        pacer_.Enqueue(ready);  // in the order they become ready
      }
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
  // Records one device's part (forming.h); sets `ready` when it completes
  // the local group. Returns an error message, or null. Called with mu_ held.
  const char* Admit(int device, int64_t ordinal, int kind, int elem, int64_t count,
                    const Part& part, std::shared_ptr<Exchange>* ready) {
    if (!running_ || stop_) return "jdist's native exchange engine is not running";
    if (!wire_.TagsFit(ordinal)) {
      return "exchange ordinal beyond the MPI tag space (too many exchanges traced)";
    }
    return forming_.Admit(device, ordinal, kind, elem, count, part, &flight_, ready);
  }

  int Fail(const char* why) {
    error_ = why;
    return -1;
  }

  // On the last local device's thread: reduces the local parts segment by
  // segment and posts each segment's MPI as soon as it is reduced (the
  // engine thread progresses it), so that the first segments are on the
  // wire while the last are still being added.
  void Launch(const std::shared_ptr<Exchange>& e) {
    Prepare(*e, &pool_, wire_.rank(), wire_.size());
    if (e->background) {  // its lane posts its segments (pacing.h)
      ReduceLocal(*e, 0, e->count);
      auto first = pacer_.Reduced(*e);
      for (auto& s : first) BeginSegment(*s);
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& s : first) queue_.push_back(std::move(s));
      --launching_;
      cv_.notify_one();
      return;
    }
    const int segments = wire_.SegmentCount(*e);
    e->segments_left = segments;
    if (wire_.size() == 1) {
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
      if (profiling) profile.local_ns += Ns(start, Clock::now());
      BeginSegment(*segment);
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(segment));
      if (index == segments - 1) --launching_;
      cv_.notify_one();
    }
  }

  // Hands segment `s`'s first phase to MPI (the engine thread progresses it).
  void BeginSegment(Segment& s) {
    if (s.index == 0) {
      s.exchange->mpi_at = Clock::now();
      flight_.Advance(s.exchange->flight_id, kFlightStateWire, s.exchange->mpi_at);
    }
    segments_posted_.fetch_add(1);
    wire_.Begin(s);
  }

  // Copies the result to every device's output (in parallel) and completes.
  void Finish(const std::shared_ptr<Exchange>& e, const char* error = nullptr) {
    size_t bytes = e->kind == JDIST_GATHER
                       ? e->count * ElemSize(e->elem) * devices_ * wire_.size()
                       : e->count * WireSize(*e);
    completed_.fetch_add(1);
    auto finished = Clock::now();
    if (!error) flight_.Advance(e->flight_id, kFlightStateDone, finished);
    tracer_.Record(e->ordinal, e->seq, e->kind, static_cast<int64_t>(bytes), e->since,
                   e->ready_at, e->mpi_at, finished);
    Deliver(e, bytes, error, &completions_);
  }

  [[noreturn]] void Abort(const std::string& what) {
    std::fprintf(stderr, "jdist: rank %d: %s. Aborting the job.\n", wire_.rank(), what.c_str());
    std::fflush(stderr);
    MPI_Abort(wire_.comm(), 1);
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
    for (auto& [key, e] : forming_.exchanges()) {
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
          for (auto& e : forming_.TakeAll()) stranded.push_back(e);
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
        if (!wire_.CheckReceives(s, statuses, &why)) Abort(why);
        if (wire_.Advance(s)) {
          segments_completed_.fetch_add(1);
          std::vector<std::shared_ptr<Segment>> next;  // its lane's (pacing.h)
          if (s.exchange->background) next = pacer_.Crossed(s);
          if (s.exchange->segments_left.fetch_sub(1) == 1) Finish(s.exchange);
          active[i] = active.back();
          active.pop_back();
          for (auto& n : next) {
            BeginSegment(*n);
            active.push_back(std::move(n));
          }
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
  int devices_ = 1;
  double timeout_s_ = 600;
  Forming forming_;  // exchanges some local device has not posted yet
  std::deque<std::shared_ptr<Segment>> queue_;
  int launching_ = 0;  // exchanges whose segments are still being posted
  std::thread thread_;
  std::atomic<int64_t> completed_{0};
  std::atomic<int64_t> segments_completed_{0};  // pieces that crossed processes
  std::atomic<int64_t> segments_posted_{0};  // pieces handed to MPI
  BufferPool pool_;
  PointToPoint wire_{&pool_};
  Pacer pacer_;
  Completions completions_;
  Tracer tracer_;
  FlightRecorder flight_;
};

// Never destroyed: completion threads may outlive static destruction.
Engine& TheEngine() {
  static Engine* engine = new Engine();
  return *engine;
}

}  // namespace
}  // namespace jdist

extern "C" {

int jdist_start(int comm_f, int local_devices, double timeout_s, const int* nodes) {
  return jdist::TheEngine().Start(comm_f, local_devices, timeout_s, nodes);
}
int jdist_hierarchical(void) { return jdist::TheEngine().wire().hierarchical() ? 1 : 0; }
int jdist_set_hierarchical(int on) { return jdist::TheEngine().wire().SetHierarchical(on); }
void jdist_stop(void) { jdist::TheEngine().Stop(); }
int jdist_running(void) { return jdist::TheEngine().running() ? 1 : 0; }
const char* jdist_last_error(void) { return jdist::TheEngine().last_error(); }
int64_t jdist_completed(void) { return jdist::TheEngine().completed(); }
int64_t jdist_trace_take(int64_t* rows, int64_t max_rows) {
  return jdist::TheEngine().TakeTrace(rows, max_rows);
}
int jdist_trace_enable(int on) { return jdist::TheEngine().EnableTrace(on); }
int64_t jdist_flight_snapshot(int64_t* rows, int64_t max_rows) {
  return jdist::TheEngine().FlightSnapshot(rows, max_rows);
}
int64_t jdist_segments_completed(void) { return jdist::TheEngine().segments_completed(); }
int64_t jdist_set_segment_bytes(int64_t b) { return jdist::TheEngine().wire().SetSegmentBytes(b); }
int64_t jdist_segments_posted(void) { return jdist::TheEngine().segments_posted(); }
int64_t jdist_set_background_segment_bytes(int64_t b) {
  return jdist::TheEngine().pacer().SetSegmentBytes(b);
}
void jdist_post(int device, int64_t ordinal, int kind, int elem, int64_t count, const void* in,
                void* out, JdistDone done, void* arg) {
  jdist::TheEngine().Post(device, ordinal, kind, elem, count, in, out, done, arg);
}

}  // extern "C"
