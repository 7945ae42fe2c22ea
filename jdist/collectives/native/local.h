// The local half of an exchange (engine.cc runs it on the last local device
// to post): where its result is assembled, and the sum of the local devices'
// parts, one segment at a time.
#ifndef JDIST_COLLECTIVES_NATIVE_LOCAL_H_
#define JDIST_COLLECTIVES_NATIVE_LOCAL_H_

#include <cstdint>
#include <cstring>
#include <memory>
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

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_LOCAL_H_
