// The CUDA backend's error checks and device-side input checks (kernels.h): check() and
// DeviceChecks, shared by every launcher.
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"
#include "mt/error.h"

namespace mt::cuda {

void check(cudaError_t e, const std::string& op, const std::string& what,
           const std::string& shapes) {
  if (e == cudaSuccess) return;
  static_cast<void>(cudaGetLastError());  // clear a non-sticky error so the next op can run
  throw Error("cuda " + op + ": " + what + " failed: " + cudaGetErrorName(e) + ": " +
              cudaGetErrorString(e) + (shapes.empty() ? "" : " (" + shapes + ")"));
}

void check(cublasStatus_t s, const std::string& op, const std::string& what,
           const std::string& shapes) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw Error("cuda " + op + ": " + what + " failed: " + cublasLtGetStatusName(s) + ": " +
              cublasLtGetStatusString(s) + (shapes.empty() ? "" : " (" + shapes + ")"));
}
DeviceChecks::DeviceChecks(Tensor words, cudaStream_t stream)
    : words_(std::move(words)), stream_(stream) {
  MT_CHECK(words_.defined() && words_.nbytes() >= kSlots * sizeof(unsigned long long),
           "cuda device checks: the slots need " + std::to_string(kSlots * 8) + " bytes");
  check(cudaMemsetAsync(words_.data(), 0xff, kSlots * sizeof(unsigned long long), stream_),
        "device checks", "clearing the slots");
}

unsigned long long* DeviceChecks::slot(Message message) {
  if (pending_.size() == kSlots) {
    check(cudaStreamSynchronize(stream_), "device checks", "stream synchronize");
    report();
  }
  pending_.push_back(std::move(message));
  return static_cast<unsigned long long*>(words_.data()) + (pending_.size() - 1);
}

void DeviceChecks::report() {
  if (pending_.empty()) return;
  const size_t n = pending_.size();
  std::vector<unsigned long long> got(n);
  std::vector<Message> messages;
  messages.swap(pending_);
  check(cudaMemcpyAsync(got.data(), words_.data(), n * sizeof(unsigned long long),
                        cudaMemcpyDeviceToHost, stream_),
        "device checks", "reading the slots");
  check(cudaStreamSynchronize(stream_), "device checks", "stream synchronize");
  check(cudaMemsetAsync(words_.data(), 0xff, n * sizeof(unsigned long long), stream_),
        "device checks", "clearing the slots");
  for (size_t i = 0; i < n; ++i) {
    if (got[i] == kClear) continue;
    const auto position = static_cast<int64_t>(got[i] >> 32);
    const auto value = static_cast<int64_t>(static_cast<int32_t>(got[i] & 0xffffffffull));
    throw Error(messages[i](position, value) +
                " (found on the device, reported at the first synchronisation after the call)");
  }
}

}  // namespace mt::cuda
