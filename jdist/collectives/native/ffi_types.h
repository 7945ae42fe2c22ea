// XLA FFI element types as the engine's element codes, shared by the CPU and
// CUDA handlers (ffi_cpu.cc, exchange_cuda.cc).

#ifndef JDIST_COLLECTIVES_NATIVE_FFI_TYPES_H_
#define JDIST_COLLECTIVES_NATIVE_FFI_TYPES_H_

#include "engine.h"
#include "xla/ffi/api/ffi.h"

namespace jdist {

// The engine's JdistElem for an FFI buffer's element type, or -1 if unknown.
inline int ElemOf(xla::ffi::DataType type) {
  switch (type) {
    case xla::ffi::DataType::F32: return JDIST_F32;
    case xla::ffi::DataType::F64: return JDIST_F64;
    case xla::ffi::DataType::S32: return JDIST_I32;
    case xla::ffi::DataType::S64: return JDIST_I64;
    case xla::ffi::DataType::U32: return JDIST_U32;
    case xla::ffi::DataType::F16: return JDIST_F16;
    case xla::ffi::DataType::BF16: return JDIST_BF16;
    case xla::ffi::DataType::U8: case xla::ffi::DataType::S8: case xla::ffi::DataType::PRED:
      return JDIST_U8;
    default: return -1;
  }
}

}  // namespace jdist

#endif  // JDIST_COLLECTIVES_NATIVE_FFI_TYPES_H_
