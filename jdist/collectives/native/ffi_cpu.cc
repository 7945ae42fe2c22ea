// jdist's XLA FFI handlers for CPU devices: each device posts its part to the
// engine (engine.h's C interface, engine.cc) and returns at once.
//
// The exchange handler never blocks: it returns an ffi::Future that the
// engine completes. XLA's CPU executor then runs other ready work on that
// thread, so an exchange never holds up XLA's own collectives or another
// exchange, whatever order the devices reach them in. That is what removes
// the deadlock of blocking host callbacks, and the need for more XLA threads
// than cores.

#include <cstdint>

#include "engine.h"
#include "ffi_types.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jdist {
namespace {

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
  jdist_post(device.typed_data()[0], ordinal, kind, elem, count, x.untyped_data(),
             y->untyped_data(), &CompletePromise, new ffi::Promise(promise));
  return future;
}

// Returns its inputs, which XLA aliases to its outputs: nothing to do. Its
// use is the data dependency: every consumer of a step's reduced buckets
// reads them through one join, so XLA cannot schedule (and reuse memory for)
// an update between two exchanges, which would make the rest of the backward
// pass wait for the first exchange.
// This process's index, set once by jdist_set_process_index at start.
int32_t process_index = 0;

// The process index as a run-time value: a literal in the program would make
// each process compile a different one (XLA folds 0 * k + i to i on rank 0
// only), whose schedules may order two exchanges differently.
ffi::Error ProcessIndexOnHost(ffi::Result<ffi::Buffer<ffi::S32>> out) {
  out->typed_data()[0] = process_index;
  return ffi::Error::Success();
}

ffi::Error JoinOnHost(ffi::RemainingArgs, ffi::RemainingRets) { return ffi::Error::Success(); }

}  // namespace
}  // namespace jdist

extern "C" void jdist_set_process_index(int index) { jdist::process_index = index; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JdistExchangeCpu, jdist::ExchangeOnHost,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("ordinal")
                                  .Attr<int32_t>("kind"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JdistJoinCpu, jdist::JoinOnHost,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JdistProcessIndexCpu, jdist::ProcessIndexOnHost,
                              ffi::Ffi::Bind().Ret<ffi::Buffer<ffi::S32>>());
