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
  if (recording_) {
    std::vector<Message>& m = recording_->messages;
    if (m.size() == kSlots)
      throw Error("cuda: recorded work with more than " + std::to_string(kSlots) +
                  " launches that check their inputs on the device cannot be recorded");
    m.push_back(std::move(message));
    return static_cast<unsigned long long*>(recording_->words.data()) + (m.size() - 1);
  }
  if (pending_.size() == kSlots) {
    check(cudaStreamSynchronize(stream_), "device checks", "stream synchronize");
    report();
  }
  pending_.push_back(std::move(message));
  return static_cast<unsigned long long*>(words_.data()) + (pending_.size() - 1);
}

void DeviceChecks::begin_recording(Tensor words) {
  MT_CHECK(!recording_ && words.nbytes() >= kSlots * sizeof(unsigned long long),
           "cuda device checks: a recording is already under way, or its slots are too few");
  check(cudaMemsetAsync(words.data(), 0xff, kSlots * sizeof(unsigned long long), stream_),
        "device checks", "clearing the slots");
  recording_ = std::make_shared<Recorded>();
  recording_->words = std::move(words);
}

std::shared_ptr<DeviceChecks::Recorded> DeviceChecks::end_recording() {
  return std::move(recording_);
}

void DeviceChecks::replayed(const std::shared_ptr<Recorded>& r) {
  if (r->messages.empty()) return;
  for (const auto& x : replays_)
    if (x == r) return;  // read once: each slot keeps the lowest failure
  replays_.push_back(r);
}

void DeviceChecks::report() {
  if (pending_.empty() && replays_.empty()) return;
  // Every group of slots read back in one synchronisation, then cleared: the eager launches'
  // and each replayed recording's.
  struct Group {
    unsigned long long* words;
    const std::vector<Message>* messages;
    std::vector<unsigned long long> got;
  };
  std::vector<Group> groups;
  std::vector<std::shared_ptr<Recorded>> replays;
  replays.swap(replays_);
  std::vector<Message> pending;
  pending.swap(pending_);
  for (const auto& r : replays)
    groups.push_back({static_cast<unsigned long long*>(r->words.data()), &r->messages, {}});
  if (!pending.empty())
    groups.push_back({static_cast<unsigned long long*>(words_.data()), &pending, {}});
  for (Group& g : groups) {
    g.got.resize(g.messages->size());
    check(cudaMemcpyAsync(g.got.data(), g.words, g.got.size() * sizeof(unsigned long long),
                          cudaMemcpyDeviceToHost, stream_),
          "device checks", "reading the slots");
  }
  check(cudaStreamSynchronize(stream_), "device checks", "stream synchronize");
  for (Group& g : groups)
    check(cudaMemsetAsync(g.words, 0xff, g.got.size() * sizeof(unsigned long long), stream_),
          "device checks", "clearing the slots");
  for (Group& g : groups)
    for (size_t i = 0; i < g.got.size(); ++i) {
      if (g.got[i] == kClear) continue;
      const auto position = static_cast<int64_t>(g.got[i] >> 32);
      const auto value = static_cast<int64_t>(static_cast<int32_t>(g.got[i] & 0xffffffffull));
      throw Error((*g.messages)[i](position, value) +
                  " (found on the device, reported at the first synchronisation after the call)");
    }
}

}  // namespace mt::cuda
