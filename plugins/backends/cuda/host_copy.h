// Host <-> device copies through pinned staging memory. Copies from pageable memory run at a
// fraction of the bus bandwidth and make the driver stage them anyway; here two pinned buffers
// take turns, so the CPU fills (or drains) one while the copy engine moves the other, and an
// event per buffer says when its transfer is done.
//
// to_device returns once `src` has been read (the caller may reuse it at once) without waiting
// for the transfer, which is ordered on the stream before any later kernel; to_host returns with
// `dst` filled.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <string>

namespace mt::cuda {

class HostCopier {
 public:
  static constexpr size_t kChunk = size_t{8} << 20;  // bytes per staging buffer

  explicit HostCopier(cudaStream_t stream);
  ~HostCopier();
  HostCopier(const HostCopier&) = delete;
  HostCopier& operator=(const HostCopier&) = delete;

  // `what` names the copy in error messages.
  void to_device(void* dst, const void* src, size_t bytes, const std::string& what);
  void to_host(void* dst, const void* src, size_t bytes, const std::string& what);

 private:
  cudaStream_t stream_;
  void* buf_[2] = {nullptr, nullptr};
  cudaEvent_t done_[2] = {nullptr, nullptr};
  std::mutex mu_;  // one copy at a time: the buffers are shared
};

}  // namespace mt::cuda
