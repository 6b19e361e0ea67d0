#include "host_copy.h"

#include <algorithm>
#include <cstring>

#include "kernels.h"

namespace mt::cuda {

HostCopier::HostCopier(cudaStream_t stream) : stream_(stream) {
  for (int i = 0; i < 2; ++i) {
    check(cudaHostAlloc(&buf_[i], kChunk, cudaHostAllocDefault), "init",
          "cudaHostAlloc of a pinned staging buffer");
    // Timing off: these events only order the CPU after the copy engine.
    check(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming), "init", "cudaEventCreate");
  }
}

HostCopier::~HostCopier() {
  // Teardown: errors cannot be reported; wait for transfers that still use the buffers.
  for (int i = 0; i < 2; ++i) {
    if (done_[i]) {
      static_cast<void>(cudaEventSynchronize(done_[i]));
      static_cast<void>(cudaEventDestroy(done_[i]));
    }
    if (buf_[i]) static_cast<void>(cudaFreeHost(buf_[i]));
  }
}

void HostCopier::to_device(void* dst, const void* src, size_t bytes, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  for (size_t off = 0, i = 0; off < bytes; off += kChunk, ++i) {
    const size_t n = std::min(kChunk, bytes - off);
    const size_t b = i % 2;
    // The buffer's previous transfer (this call's or an earlier one's) must be done before the
    // CPU overwrites it; an event never recorded counts as done.
    check(cudaEventSynchronize(done_[b]), what, "waiting for a staging buffer");
    std::memcpy(buf_[b], s + off, n);
    check(cudaMemcpyAsync(d + off, buf_[b], n, cudaMemcpyHostToDevice, stream_), what,
          "cudaMemcpyAsync host to device");
    check(cudaEventRecord(done_[b], stream_), what, "cudaEventRecord");
  }
}

void HostCopier::to_host(void* dst, const void* src, size_t bytes, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  const size_t chunks = (bytes + kChunk - 1) / kChunk;
  auto issue = [&](size_t i) {
    const size_t off = i * kChunk, n = std::min(kChunk, bytes - off);
    check(cudaMemcpyAsync(buf_[i % 2], s + off, n, cudaMemcpyDeviceToHost, stream_), what,
          "cudaMemcpyAsync device to host");
    check(cudaEventRecord(done_[i % 2], stream_), what, "cudaEventRecord");
  };
  // Both buffers may still feed transfers of an earlier to_device.
  for (int b = 0; b < 2; ++b)
    check(cudaEventSynchronize(done_[b]), what, "waiting for a staging buffer");
  if (chunks > 0) issue(0);
  for (size_t i = 0; i < chunks; ++i) {
    if (i + 1 < chunks) issue(i + 1);  // the other buffer was drained in the previous round
    const size_t off = i * kChunk, n = std::min(kChunk, bytes - off);
    check(cudaEventSynchronize(done_[i % 2]), what, "cudaEventSynchronize");
    std::memcpy(d + off, buf_[i % 2], n);
  }
}

}  // namespace mt::cuda
