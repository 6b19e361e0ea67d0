// TensorBoard event files.
//
// Libraries, as issue 21 asks:
// - CRC-32C is the one the checkpoints already use (checkpoint_manager.h: SSE4.2 instructions
//   where the CPU has them, a table otherwise; tested against the standard check values).
//   Debian 12 has no package of Google's crc32c library (libcrc32c-dev is not in bookworm);
//   Boost.CRC (in libboost-dev) would fit, but a second CRC-32C in libmt_core buys nothing.
// - The protobuf messages are encoded here rather than with libprotobuf: mt writes three tiny
//   messages (an Event with a version string, one with a step and (tag, float) pairs, one with
//   a session status): a varint, field keys and length prefixes, about 40 lines. libprotobuf's
//   generated classes would need protoc (protobuf-compiler) and a generation step in CMake, a
//   .proto with the fields used, and libprotobuf as a new run-time dependency of libmt_core;
//   its wire writer alone (io::CodedOutputStream) would replace only put_varint and put_le.
//   tests/unit/tensorboard_test.cpp checks the bytes against ones derived by hand from
//   TensorBoard's event.proto and summary.proto, and tools/check_tensorboard.py reads a run's
//   files with the tensorboard package itself (its reader checks the CRCs).

#include "tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <system_error>

#include "checkpoint_manager.h"
#include "file_util.h"
#include "mt/error.h"

namespace fs = std::filesystem;

namespace mt {

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t crc = crc32c(0, data.data(), data.size());
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

namespace tensorboard {
namespace {

// Protobuf wire format: a field is a varint key (number << 3 | wire type) and its value.
enum Wire : uint32_t { varint = 0, fixed64 = 1, length_delimited = 2, fixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out += static_cast<char>((v & 0x7f) | 0x80);
  out += static_cast<char>(v);
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xff);
}

void put_key(std::string& out, uint32_t field, Wire wire) {
  put_varint(out, field << 3 | wire);
}

void put_double(std::string& out, uint32_t field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, fixed64);
  put_le(out, bits, 8);
}

void put_float(std::string& out, uint32_t field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, fixed32);
  put_le(out, bits, 4);
}

void put_int64(std::string& out, uint32_t field, int64_t v) {
  put_key(out, field, varint);
  put_varint(out, static_cast<uint64_t>(v));  // negative int64: ten bytes, as protobuf does
}

void put_bytes(std::string& out, uint32_t field, std::string_view v) {
  put_key(out, field, length_delimited);
  put_varint(out, v.size());
  out += v;
}

// Field numbers of tensorboard/compat/proto/event.proto and summary.proto.
constexpr uint32_t kEventWallTime = 1, kEventStep = 2, kEventFileVersion = 3, kEventSummary = 5,
                   kEventSessionLog = 7;
constexpr uint32_t kSummaryValue = 1, kValueTag = 1, kValueSimpleValue = 2;
constexpr uint32_t kSessionLogStatus = 1, kSessionLogStart = 1;

}  // namespace

std::string file_version_event(double wall_time) {
  std::string e;
  put_double(e, kEventWallTime, wall_time);
  put_bytes(e, kEventFileVersion, "brain.Event:2");
  return e;
}

std::string scalars_event(double wall_time, int64_t step, const Scalars& scalars) {
  std::string summary;
  for (const auto& [tag, v] : scalars) {
    std::string value;
    put_bytes(value, kValueTag, tag);
    put_float(value, kValueSimpleValue, static_cast<float>(v));
    put_bytes(summary, kSummaryValue, value);
  }
  std::string e;
  put_double(e, kEventWallTime, wall_time);
  put_int64(e, kEventStep, step);
  put_bytes(e, kEventSummary, summary);
  return e;
}

std::string session_start_event(double wall_time, int64_t step) {
  std::string log;
  put_key(log, kSessionLogStatus, varint);
  put_varint(log, kSessionLogStart);
  std::string e;
  put_double(e, kEventWallTime, wall_time);
  put_int64(e, kEventStep, step);
  put_bytes(e, kEventSessionLog, log);
  return e;
}

std::string record(std::string_view data) {
  std::string r;
  r.reserve(data.size() + 16);
  put_le(r, data.size(), 8);
  put_le(r, masked_crc32c(r), 4);
  r += data;
  put_le(r, masked_crc32c(data), 4);
  return r;
}

}  // namespace tensorboard

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw Error("Cannot create the TensorBoard directory " + quoted(dir) + ": " + ec.message() +
                ". Set base_output_directory= to a directory mt may write to, or "
                "enable_tensorboard=false.");
  const double t = now_seconds();
  const std::string base =
      "events.out.tfevents." + std::to_string(static_cast<long long>(t)) + "." + hostname();
  // A run resumed within the same second gets a name that sorts after the first one's.
  for (int n = 0; fd_ < 0; ++n) {
    path_ = dir / (n == 0 ? base : base + "." + std::to_string(n));
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    const int err = errno;
    if (fd_ < 0 && (err != EEXIST || n == 100))
      throw Error("Cannot create the TensorBoard event file " + quoted(path_) + ": " +
                  std::strerror(err) + ". Set enable_tensorboard=false to run without it.");
  }
  write_event(tensorboard::file_version_event(t));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardWriter::write_scalars(int64_t step, const tensorboard::Scalars& scalars) {
  write_event(tensorboard::scalars_event(now_seconds(), step, scalars));
}

void TensorBoardWriter::write_session_start(int64_t step) {
  write_event(tensorboard::session_start_event(now_seconds(), step));
}

void TensorBoardWriter::write_event(const std::string& event) {
  // One write per record: a run killed mid-write leaves at most a short last record, which
  // TensorBoard's reader takes for one still being written and skips.
  const std::string r = tensorboard::record(event);
  if (!write_all(fd_, r.data(), r.size())) {
    const int err = errno;
    throw Error("Cannot write TensorBoard events to " + quoted(path_) + ": " + std::strerror(err) +
                ". Set enable_tensorboard=false to run without it.");
  }
}

}  // namespace mt
