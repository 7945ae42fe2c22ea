// Elementwise sums of the engine's element types (engine.h's JdistElem):
// local devices' parts into one buffer, and a peer's chunk into ours.
#ifndef JDIST_COLLECTIVES_NATIVE_REDUCE_H_
#define JDIST_COLLECTIVES_NATIVE_REDUCE_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "engine.h"

namespace jdist {

inline size_t ElemSize(int elem) {
  switch (elem) {
    case JDIST_F64: case JDIST_I64: return 8;
    case JDIST_F32: case JDIST_I32: case JDIST_U32: return 4;
    case JDIST_F16: case JDIST_BF16: return 2;
    default: return 1;
  }
}

// out[i] = sum over k of ins[k][i], i < n. `out` may be ins[0] (each element
// is read before it is written).
template <typename T>
void SumInto(const std::vector<const char*>& ins, char* out_raw, int64_t n) {
  T* out = reinterpret_cast<T*>(out_raw);
  const T* a = reinterpret_cast<const T*>(ins[0]);
  if (ins.size() == 1) {
    if (out != a) std::memcpy(out, a, n * sizeof(T));
    return;
  }
  const T* b = reinterpret_cast<const T*>(ins[1]);
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
  for (size_t k = 2; k < ins.size(); ++k) {
    const T* c = reinterpret_cast<const T*>(ins[k]);
    for (int64_t i = 0; i < n; ++i) out[i] += c[i];
  }
}

// SumInto for a runtime element type (every type but the 16-bit ones).
inline void SumParts(int elem, const std::vector<const char*>& ins, char* out, int64_t n) {
  switch (elem) {
    case JDIST_F32: SumInto<float>(ins, out, n); break;
    case JDIST_F64: SumInto<double>(ins, out, n); break;
    case JDIST_I32: SumInto<int32_t>(ins, out, n); break;
    case JDIST_I64: SumInto<int64_t>(ins, out, n); break;
    case JDIST_U32: SumInto<uint32_t>(ins, out, n); break;
    default: SumInto<uint8_t>(ins, out, n); break;
  }
}

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_REDUCE_H_
