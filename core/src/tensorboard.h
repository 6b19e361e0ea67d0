// TensorBoard event files (enable_tensorboard): the scalars of each step, as MaxText writes them,
// for `tensorboard --logdir=<base_output_directory>`.
//
// An event file is a sequence of TFRecords, each a serialized tensorboard.Event:
//   uint64 length | uint32 masked_crc32c(length) | length bytes | uint32 masked_crc32c(bytes)
// all little-endian. The first Event names the format (file_version "brain.Event:2"); each
// later one carries a step's scalars (Summary.Value.simple_value).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mt {

// The CRC-32C of `data` (checkpoint_manager.h's crc32c) masked as TFRecord does: rotated right
// by 15 bits plus a constant, so that a CRC stored inside checksummed data does not checksum to
// a fixed value.
uint32_t masked_crc32c(std::string_view data);

namespace tensorboard {

using Scalars = std::vector<std::pair<std::string, double>>;

// Serialized Event messages (tensorboard/compat/proto/event.proto, summary.proto).
std::string file_version_event(double wall_time);
std::string scalars_event(double wall_time, int64_t step, const Scalars& scalars);
// Event.session_log {status: START}: TensorBoard drops the steps >= `step` read before it, which
// a run killed after its last checkpoint wrote and its resumed run writes again.
std::string session_start_event(double wall_time, int64_t step);
// `data` in its TFRecord frame.
std::string record(std::string_view data);

}  // namespace tensorboard

// Writes one event file. Every record goes to the kernel as it is written (no buffering in the
// process), so a run that is killed keeps the scalars of every step it finished.
class TensorBoardWriter {
 public:
  // Creates `dir` if needed and a new file events.out.tfevents.<unix seconds>.<hostname> in it,
  // the name TensorFlow's writers give (TensorBoard reads the files of a directory in name
  // order), and writes the file_version record. Throws mt::Error naming the path and why.
  explicit TensorBoardWriter(const std::filesystem::path& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // One Event holding `scalars` at `step`. Throws mt::Error when the write fails.
  void write_scalars(int64_t step, const tensorboard::Scalars& scalars);
  // A (re)start at `step`; see session_start_event.
  void write_session_start(int64_t step);

 private:
  void write_event(const std::string& event);

  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace mt
