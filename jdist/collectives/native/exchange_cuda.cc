// The CUDA variant of jdist's native exchange: an XLA FFI handler for GPU
// devices that stages each device's buffer through pinned host memory and
// hands it to the same engine as the CPU handler (ffi_cpu.cc); engine.cc
// reduces the local devices' parts and runs MPI across processes.
//
// Unlike the CPU handler it waits for the exchange inside the call: XLA:GPU
// launches a device's thunks one after the other from one host thread, in
// the compiled order, which is the same on every device, so every device
// reaches its exchanges in one order and a blocking wait cannot interleave
// them differently. Compiled by `python -m jdist.collectives.native.build`
// when a CUDA toolkit is found; it links to the CPU library for the engine.

#include <cuda_runtime.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <string>

#include "engine.h"
#include "ffi_types.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jdist {
namespace {

// Pinned host buffers per device, grown on demand and kept (pinning is slow).
struct Staging {
  void* in = nullptr;
  void* out = nullptr;
  size_t in_bytes = 0;
  size_t out_bytes = 0;
};

std::mutex staging_mu;
std::map<int, Staging>* staging = new std::map<int, Staging>();

cudaError_t Grow(void** buffer, size_t* have, size_t need) {
  if (*have >= need) return cudaSuccess;
  if (*buffer) cudaFreeHost(*buffer);
  *buffer = nullptr;
  *have = 0;
  cudaError_t status = cudaMallocHost(buffer, need);
  if (status == cudaSuccess) *have = need;
  return status;
}

struct Waiter {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string error;
};

void Wake(void* arg, const char* error) {
  auto* waiter = static_cast<Waiter*>(arg);
  std::lock_guard<std::mutex> lock(waiter->mu);
  if (error) waiter->error = error;
  waiter->done = true;
  waiter->cv.notify_all();
}

ffi::Error CudaFailure(const char* what, cudaError_t status) {
  return ffi::Error::Internal(std::string("jdist native exchange: ") + what + ": " +
                              cudaGetErrorString(status));
}

ffi::Error ExchangeOnGpu(cudaStream_t stream, int32_t device_ordinal, ffi::AnyBuffer device,
                         ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, int64_t ordinal,
                         int32_t kind) {
  (void)device;  // the CPU handler's device operand; GPUs know their ordinal
  int elem = ElemOf(x.element_type());
  if (elem < 0) return ffi::Error::InvalidArgument("jdist: unsupported dtype for this exchange");
  int64_t count = static_cast<int64_t>(x.element_count());
  if (kind == JDIST_GATHER) {
    count = static_cast<int64_t>(x.size_bytes());
    elem = JDIST_U8;
  }
  size_t in_bytes = x.size_bytes();
  size_t out_bytes = y->size_bytes();
  Staging* mine;
  {
    std::lock_guard<std::mutex> lock(staging_mu);
    mine = &(*staging)[device_ordinal];
  }
  cudaError_t status = Grow(&mine->in, &mine->in_bytes, in_bytes);
  if (status == cudaSuccess) status = Grow(&mine->out, &mine->out_bytes, out_bytes);
  if (status != cudaSuccess) return CudaFailure("cudaMallocHost", status);
  status = cudaMemcpyAsync(mine->in, x.untyped_data(), in_bytes, cudaMemcpyDeviceToHost, stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  if (status != cudaSuccess) return CudaFailure("copy to host", status);
  Waiter waiter;
  jdist_post(device_ordinal, ordinal, kind, elem, count, mine->in, mine->out, &Wake, &waiter);
  {
    std::unique_lock<std::mutex> lock(waiter.mu);
    waiter.cv.wait(lock, [&] { return waiter.done; });
  }
  if (!waiter.error.empty()) return ffi::Error::Internal(waiter.error);
  status = cudaMemcpyAsync(y->untyped_data(), mine->out, out_bytes, cudaMemcpyHostToDevice, stream);
  // The staging buffer is reused by the next exchange: wait for the copy.
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  if (status != cudaSuccess) return CudaFailure("copy to device", status);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jdist

XLA_FFI_DEFINE_HANDLER_SYMBOL(JdistExchangeCuda, jdist::ExchangeOnGpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("ordinal")
                                  .Attr<int32_t>("kind"));
