// Recording a backend's work once and running it again (CUDA graphs): what a decode step needs
// when it is bound by launching many small kernels rather than by the kernels themselves.
//
// A backend that can do it answers Backend::extension(kWorkCapture) with a WorkCapture*. The
// caller records a sequence of ops between begin() and end(); nothing runs while recording.
// CapturedWork::replay() then runs the same kernels on the same tensors (their contents at the
// time of the replay: the caller updates its inputs in place with copy_from_host before each
// replay and reads the outputs after it).
#pragma once

#include <memory>

namespace mt {

inline constexpr const char* kWorkCapture = "mt.work_capture";

class CapturedWork {
 public:
  virtual ~CapturedWork() = default;
  // Runs the recorded work after everything queued before it. Bad inputs its kernels find
  // (DeviceChecks on CUDA) are thrown at the backend's next synchronisation, as for ops that
  // were not recorded.
  virtual void replay() = 0;
};

class WorkCapture {
 public:
  virtual ~WorkCapture() = default;
  // Starts recording the backend's ops. While recording, anything that cannot be recorded
  // throws mt::Error naming itself: copies to or from the host, synchronisation, ops whose
  // result comes back to the host (sum). The caller then calls abandon().
  virtual void begin() = 0;
  // Ends the recording and returns it. Every tensor the backend allocated while recording
  // belongs to the returned work until it is destroyed (a replay writes them), which must happen
  // before the backend is destroyed. Throws mt::Error if the backend could not record the work.
  virtual std::unique_ptr<CapturedWork> end() = 0;
  // Ends a recording that failed, keeping nothing of it; does nothing when none is under way.
  virtual void abandon() noexcept = 0;
};

}  // namespace mt
