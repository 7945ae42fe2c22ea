// Exchanges that outlive their step (deferred.h): "start" copies this
// device's buffer into memory of its own, posts it to the engine and returns
// at once; "finish", in a later step, waits (an XLA future, no thread held)
// for that exchange and writes its result. Used by `jdist.diloco(delay=τ)`
// on the native route, so that a fragment's all-reduce is on the wire while
// the next τ inner steps compute.
//
// Started exchanges are kept per (ordinal, local device), by a call count of
// their own (`seq`). A finish names the exchange by the token its start
// returned, [ordinal, seq, session]; seq -1 takes the oldest unclaimed one
// (first in, first out). A finished exchange stays until the next start of
// its ordinal on that device, so a second finish of one token (a state
// restored from a checkpoint in the same process) reads the same result.

#include "deferred.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine.h"
#include "ffi_types.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jdist {
namespace {

// One device's part of a started exchange: its buffer, in and out.
struct Started {
  std::unique_ptr<char[]> buffer;
  size_t bytes = 0;
  bool done = false;
  bool claimed = false;  // a finish read it (or waits for it)
  std::string error;
  std::vector<std::pair<ffi::Promise*, void*>> waiters;  // finishes waiting: promise, output
};

using Key = std::pair<int64_t, int>;  // (ordinal, device)

std::mutex mu;
std::condition_variable all_done;
std::map<Key, std::map<int64_t, std::shared_ptr<Started>>> started;
std::map<Key, int64_t> next_seq;
int32_t session = 0;

void Deliver(const std::shared_ptr<Started>& s, ffi::Promise* promise, void* out) {
  if (s->error.empty()) {
    std::memcpy(out, s->buffer.get(), s->bytes);
    promise->SetAvailable();
  } else {
    promise->SetError(ffi::Error::Internal(s->error));
  }
  delete promise;
}

// The engine's completion of one device's part (engine.h's JdistDone).
void OnDone(void* arg, const char* error) {
  auto* holder = static_cast<std::shared_ptr<Started>*>(arg);
  std::shared_ptr<Started> s = std::move(*holder);
  delete holder;
  std::vector<std::pair<ffi::Promise*, void*>> waiters;
  {
    std::lock_guard<std::mutex> lock(mu);
    s->done = true;
    if (error) s->error = error;
    waiters.swap(s->waiters);
  }
  all_done.notify_all();
  for (auto& [promise, out] : waiters) Deliver(s, promise, out);
}

ffi::Error StartOnHost(ffi::Buffer<ffi::S32> device, ffi::AnyBuffer x,
                       ffi::Result<ffi::Buffer<ffi::S32>> token, int64_t ordinal) {
  const int elem = ElemOf(x.element_type());
  if (elem < 0 || elem == JDIST_U8) {
    return ffi::Error::InvalidArgument("jdist: unsupported dtype for a deferred sum");
  }
  const int d = device.typed_data()[0];
  auto s = std::make_shared<Started>();
  s->bytes = x.size_bytes();
  s->buffer.reset(new char[s->bytes > 0 ? s->bytes : 1]);
  std::memcpy(s->buffer.get(), x.untyped_data(), s->bytes);
  int64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto& mine = started[{ordinal, d}];
    seq = next_seq[{ordinal, d}]++;
    // Finished exchanges a finish already read are dropped at the next start.
    for (auto it = mine.begin(); it != mine.end();) {
      it = (it->second->claimed && it->second->done) ? mine.erase(it) : std::next(it);
    }
    mine[seq] = s;
  }
  int32_t* out = token->typed_data();
  out[0] = static_cast<int32_t>(ordinal);
  out[1] = static_cast<int32_t>(seq);
  out[2] = session;
  // The sum runs in the copy (input and output alike), which outlives the step;
  // a background sum, it yields to the steps' own exchanges (pacing.h).
  jdist_post(d, ordinal, JDIST_SUM | JDIST_BACKGROUND, elem, x.element_count(), s->buffer.get(),
             s->buffer.get(), &OnDone, new std::shared_ptr<Started>(s));
  return ffi::Error::Success();
}

ffi::Future FinishOnHost(ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::S32> token,
                         ffi::Result<ffi::AnyBuffer> y) {
  ffi::Promise promise;
  ffi::Future future(promise);
  const int d = device.typed_data()[0];
  const int64_t ordinal = token.typed_data()[0];
  const int64_t seq = token.typed_data()[1];
  std::shared_ptr<Started> s;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto found = started.find({ordinal, d});
    if (found != started.end() && !found->second.empty()) {
      auto& mine = found->second;
      if (seq < 0) {  // the oldest one not yet read
        for (auto& [_, entry] : mine) {
          if (!entry->claimed) {
            s = entry;
            break;
          }
        }
      } else if (mine.count(seq)) {
        s = mine[seq];
      }
    }
    if (!s) {
      why = "jdist: finish of deferred exchange " + std::to_string(ordinal) + " (call " +
            std::to_string(seq) + ") on device " + std::to_string(d) +
            ", which was never started in this process (or was dropped by drain)";
    } else if (s->bytes != y->size_bytes()) {
      why = "jdist: finish of deferred exchange " + std::to_string(ordinal) + " asks for " +
            std::to_string(y->size_bytes()) + " bytes; its start sent " +
            std::to_string(s->bytes);
    } else {
      s->claimed = true;
      if (!s->done) {
        s->waiters.emplace_back(new ffi::Promise(promise), y->untyped_data());
        return future;
      }
    }
  }
  if (!why.empty()) {
    promise.SetError(ffi::Error::InvalidArgument(why));
  } else {
    Deliver(s, new ffi::Promise(promise), y->untyped_data());
  }
  return future;
}

// 1 where `token` is this run's and its sum is still kept on this device, else 0.
ffi::Error HeldOnHost(ffi::Buffer<ffi::S32> device, ffi::Buffer<ffi::S32> token,
                      ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const int32_t* t = token.typed_data();
  std::lock_guard<std::mutex> lock(mu);
  auto found = started.find({t[0], device.typed_data()[0]});
  out->typed_data()[0] = t[2] == session && found != started.end() && found->second.count(t[1]);
  return ffi::Error::Success();
}

ffi::Error SessionOnHost(ffi::Result<ffi::Buffer<ffi::S32>> out) {
  out->typed_data()[0] = session;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jdist

extern "C" {

void jdist_deferred_set_session(int32_t value) { jdist::session = value; }

int64_t jdist_deferred_outstanding(void) {
  std::lock_guard<std::mutex> lock(jdist::mu);
  int64_t n = 0;
  for (auto& [_, mine] : jdist::started) {
    for (auto& [__, s] : mine) n += s->claimed ? 0 : 1;
  }
  return n;
}

int64_t jdist_deferred_drain(double timeout_s) {
  std::unique_lock<std::mutex> lock(jdist::mu);
  auto settled = [] {
    for (auto& [_, mine] : jdist::started) {
      for (auto& [__, s] : mine) {
        if (!s->done) return false;
      }
    }
    return true;
  };
  if (!jdist::all_done.wait_for(lock, std::chrono::duration<double>(timeout_s), settled)) {
    return -1;
  }
  int64_t dropped = 0;
  for (auto& [_, mine] : jdist::started) {
    for (auto& [__, s] : mine) dropped += s->claimed ? 0 : 1;
  }
  jdist::started.clear();
  return dropped;
}

}  // extern "C"

XLA_FFI_DEFINE_HANDLER_SYMBOL(JdistDeferredStartCpu, jdist::StartOnHost,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("ordinal"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JdistDeferredFinishCpu, jdist::FinishOnHost,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JdistDeferredHeldCpu, jdist::HeldOnHost,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JdistDeferredSessionCpu, jdist::SessionOnHost,
                              ffi::Ffi::Bind().Ret<ffi::Buffer<ffi::S32>>());
