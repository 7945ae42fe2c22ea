// The local half of an exchange (engine.cc runs it on the last local device
// to post): where its result is assembled, the sum of the local devices'
// parts, one segment at a time, and the result's delivery to every device.
#ifndef JDIST_COLLECTIVES_NATIVE_LOCAL_H_
#define JDIST_COLLECTIVES_NATIVE_LOCAL_H_

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"
#include "exchange.h"
#include "halfs.h"
#include "pools.h"
#include "reduce.h"

namespace jdist {

// Sets `e.acc`, where the exchange's result is assembled: for a gather,
// every process's blocks in replica order with this process's (`rank` of
// `processes`) copied in; for a sum, device 0's buffer where XLA aliased it.
inline void Prepare(Exchange& e, BufferPool* pool, int rank, int processes) {
  const int devices = static_cast<int>(e.parts.size());
  if (e.kind == JDIST_GATHER) {
    size_t block = e.count * ElemSize(e.elem);
    e.acc = pool->Get(block * devices * processes);
    for (int i = 0; i < devices; ++i) {
      std::memcpy(e.acc.get() + (rank * devices + i) * block, e.parts[i].in, block);
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
    e.acc = pool->Get(e.count * WireSize(e));
  }
}

// Sums elements [begin, begin + n) of the local parts into the result.
inline void ReduceLocal(Exchange& e, int64_t begin, int64_t n) {
  if (e.kind == JDIST_GATHER) return;  // copied in by Prepare
  const int devices = static_cast<int>(e.parts.size());
  const size_t w = WireSize(e);  // the element size too: 16-bit in, 16-bit out
  char* out = e.acc.get() + begin * w;
  std::vector<const char*> ins(devices);
  for (int i = 0; i < devices; ++i) ins[i] = static_cast<const char*>(e.parts[i].in) + begin * w;
  if (devices == 1 && ins[0] == out) return;  // in place
  if (e.kind == JDIST_SUM16) {
    std::vector<const void*> halves(ins.begin(), ins.end());
    Sum16(e.elem == JDIST_BF16, halves.data(), devices, out, n);
    return;
  }
  SumParts(e.elem, ins, out, n);
}

// Copies the result (`bytes` of it) to every device's output, in parallel on
// `completions`, and completes each device (with `error`, if not null).
inline void Deliver(const std::shared_ptr<Exchange>& e, size_t bytes, const char* error,
                    Completions* completions) {
  const int devices = static_cast<int>(e->parts.size());
  std::string message = error ? error : "";
  auto complete = [e, message](int d) {
    const Part& part = e->parts[d];
    if (part.done == nullptr) return;  // a device that never posted (stranded)
    part.done(part.arg, message.empty() ? nullptr : message.c_str());
  };
  // Where device 0's output holds the result (Prepare), its program may
  // overwrite that buffer as soon as it resumes: it resumes once every other
  // device has copied from it, in a task of its own (a resumed device may
  // block in an XLA collective until the others resume too).
  const bool first_holds_result =
      devices > 1 && e->acc != nullptr && e->acc.get() == e->parts[0].out;
  auto copies_left = std::make_shared<std::atomic<int>>(devices - 1);
  for (int d = first_holds_result ? 1 : 0; d < devices; ++d) {
    completions->Run([completions, e, d, bytes, message, complete, first_holds_result,
                      copies_left] {
      const Part& part = e->parts[d];
      if (part.done != nullptr && message.empty() && part.out != e->acc.get()) {
        auto start = Clock::now();
        std::memcpy(part.out, e->acc.get(), bytes);
        if (profiling) profile.copy_ns += Ns(start, Clock::now());
      }
      if (first_holds_result && copies_left->fetch_sub(1) == 1) {
        completions->Run([complete] { complete(0); });
      }
      complete(d);
    });
  }
}

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_LOCAL_H_
