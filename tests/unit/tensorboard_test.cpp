// TensorBoard event files (core/src/tensorboard.h): the CRC, the record framing and the Event
// bytes, each checked against what this file derives independently from the format's
// definition (TFRecord framing; tensorboard/compat/proto/event.proto and summary.proto).
// tools/check_tensorboard.py reads a real run's files with the tensorboard package itself.
#include "tensorboard.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "checkpoint_manager.h"
#include "mt/error.h"
#include "test_support.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

// CRC-32C bit by bit, straight from its definition (reflected polynomial 0x82F63B78).
uint32_t reference_crc32c(std::string_view s) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char c : s) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

uint32_t reference_mask(uint32_t crc) {
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

uint64_t le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(s[at + i])} << (8 * i);
  return v;
}

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int c : b) s += static_cast<char>(c);
  return s;
}

// The records of an event file, each checked against its framing.
std::vector<std::string> read_records(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  const std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  std::vector<std::string> out;
  size_t at = 0;
  while (at < s.size()) {
    EXPECT_GE(s.size() - at, 12u) << "a short record header at byte " << at;
    if (s.size() - at < 12) break;
    const uint64_t n = le(s, at, 8);
    EXPECT_EQ(le(s, at + 8, 4), reference_mask(reference_crc32c(s.substr(at, 8))))
        << "length CRC of the record at byte " << at;
    EXPECT_GE(s.size() - at - 12, n + 4) << "a short record at byte " << at;
    if (s.size() - at - 12 < n + 4) break;
    const std::string data = s.substr(at + 12, n);
    EXPECT_EQ(le(s, at + 12 + n, 4), reference_mask(reference_crc32c(data)))
        << "data CRC of the record at byte " << at;
    out.push_back(data);
    at += 12 + n + 4;
  }
  return out;
}

// A minimal protobuf reader: field number -> the values of that field (varints as their
// number, fixed64/fixed32 as their raw bytes, length-delimited as their bytes).
std::multimap<int, std::string> fields(const std::string& m) {
  std::multimap<int, std::string> out;
  size_t at = 0;
  auto varint = [&] {
    uint64_t v = 0;
    for (int shift = 0; at < m.size(); shift += 7) {
      const auto b = static_cast<unsigned char>(m[at++]);
      v |= uint64_t{b & 0x7fu} << shift;
      if (!(b & 0x80)) break;
    }
    return v;
  };
  while (at < m.size()) {
    const uint64_t key = varint();
    const int field = static_cast<int>(key >> 3);
    switch (key & 7) {
      case 0:
        out.emplace(field, std::to_string(varint()));
        break;
      case 1:
        out.emplace(field, m.substr(at, 8));
        at += 8;
        break;
      case 5:
        out.emplace(field, m.substr(at, 4));
        at += 4;
        break;
      case 2: {
        const auto n = static_cast<size_t>(varint());
        out.emplace(field, m.substr(at, n));
        at += n;
        break;
      }
      default:
        ADD_FAILURE() << "wire type " << (key & 7);
        return out;
    }
  }
  return out;
}

double as_double(const std::string& b) {
  const uint64_t bits = le(b, 0, 8);
  double d;
  std::memcpy(&d, &bits, 8);
  return d;
}

float as_float(const std::string& b) {
  const auto bits = static_cast<uint32_t>(le(b, 0, 4));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

class TensorBoard : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("mt_tensorboard_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST(TensorBoardCrc, MaskedCrc32cAsTFRecordHasIt) {
  // The standard check value of CRC-32C, from the reference above and from the CRC the writer
  // uses (checkpoint_test.cpp tests that one in depth).
  EXPECT_EQ(reference_crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(0, "123456789", 9), 0xE3069283u);
  // ((0xE3069283 >> 15) | (0xE3069283 << 17)) + 0xa282ead8, modulo 2^32.
  EXPECT_EQ(masked_crc32c("123456789"), 0xC78AB0E5u);
  EXPECT_EQ(masked_crc32c(""), 0xa282ead8u);  // CRC 0
  std::mt19937 rng(7);
  for (size_t n : {1, 3, 8, 13, 64, 1000}) {
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng());
    EXPECT_EQ(masked_crc32c(s), reference_mask(reference_crc32c(s))) << n << " bytes";
  }
}

// Bytes derived by hand from event.proto / summary.proto. wall_time 1.5 is the double
// 0x3FF8000000000000, simple_value 2.0 the float 0x40000000, both little-endian.
TEST(TensorBoardEvents, FileVersionEventBytes) {
  std::string expected;
  expected += bytes({0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F});  // field 1 (wall_time), fixed64
  expected += bytes({0x1A, 13}) + "brain.Event:2";          // field 3 (file_version), 13 bytes
  EXPECT_EQ(tensorboard::file_version_event(1.5), expected);
}

TEST(TensorBoardEvents, ScalarEventBytes) {
  std::string expected;
  expected += bytes({0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F});  // field 1 (wall_time), fixed64
  expected += bytes({0x10, 0xAC, 0x02});                    // field 2 (step), varint 300
  expected += bytes({0x2A, 10});                            // field 5 (summary), 10 bytes:
  expected += bytes({0x0A, 8});                             //   Summary.value (1), 8 bytes:
  expected += bytes({0x0A, 1, 'a'});                        //     Value.tag (1) "a"
  expected += bytes({0x15, 0, 0, 0, 0x40});                 //     Value.simple_value (2), fixed32
  EXPECT_EQ(tensorboard::scalars_event(1.5, 300, {{"a", 2.0}}), expected);
}

TEST(TensorBoardEvents, SessionStartEventBytes) {
  std::string expected;
  expected += bytes({0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F});  // field 1 (wall_time), fixed64
  expected += bytes({0x10, 5});                             // field 2 (step), varint 5
  expected += bytes({0x3A, 2});                             // field 7 (session_log), 2 bytes:
  expected += bytes({0x08, 1});                             //   SessionLog.status (1) START
  EXPECT_EQ(tensorboard::session_start_event(1.5, 5), expected);
}

TEST(TensorBoardEvents, RecordFraming) {
  const std::string r = tensorboard::record("hello");
  ASSERT_EQ(r.size(), 8 + 4 + 5 + 4u);
  EXPECT_EQ(le(r, 0, 8), 5u);
  EXPECT_EQ(le(r, 8, 4), reference_mask(reference_crc32c(r.substr(0, 8))));
  EXPECT_EQ(r.substr(12, 5), "hello");
  EXPECT_EQ(le(r, 17, 4), reference_mask(reference_crc32c("hello")));
}

TEST_F(TensorBoard, WritesAFileTensorBoardCanRead) {
  const auto before = std::chrono::system_clock::now();
  fs::path written;
  {
    TensorBoardWriter w(dir_ / "a" / "b");  // made if missing
    written = w.path();
    w.write_session_start(1);
    w.write_scalars(1, {{"learning/loss", 10.5}, {"perf/mfu", 0.25}});
    w.write_scalars(2, {{"learning/loss", 9.75}});
    // Each step is in the file at once, before the writer closes.
    EXPECT_EQ(read_records(written).size(), 4u);
  }
  EXPECT_EQ(written.parent_path(), dir_ / "a" / "b");
  const std::string name = written.filename().string();
  const std::string prefix = "events.out.tfevents.";
  ASSERT_EQ(name.rfind(prefix, 0), 0u) << name;
  const long long secs = std::stoll(name.substr(prefix.size(), 10));
  const long long now_s =
      std::chrono::duration_cast<std::chrono::seconds>(before.time_since_epoch()).count();
  EXPECT_NEAR(static_cast<double>(secs), static_cast<double>(now_s), 5.0) << name;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  EXPECT_EQ(name.substr(prefix.size() + 11), host) << name;

  const auto recs = read_records(written);
  ASSERT_EQ(recs.size(), 4u);
  auto first = fields(recs[0]);
  EXPECT_EQ(first.find(3)->second, "brain.Event:2");
  EXPECT_NEAR(as_double(first.find(1)->second), static_cast<double>(now_s), 5.0);
  EXPECT_EQ(first.count(2), 0u);

  auto start = fields(recs[1]);
  EXPECT_EQ(start.find(2)->second, "1");
  EXPECT_EQ(fields(start.find(7)->second).find(1)->second, "1");  // SessionLog.START

  auto step1 = fields(recs[2]);
  EXPECT_EQ(step1.find(2)->second, "1");
  auto values = fields(step1.find(5)->second);
  ASSERT_EQ(values.count(1), 2u);
  std::map<std::string, float> got;
  for (auto [it, end] = values.equal_range(1); it != end; ++it) {
    auto v = fields(it->second);
    got[v.find(1)->second] = as_float(v.find(2)->second);
  }
  EXPECT_EQ(got, (std::map<std::string, float>{{"learning/loss", 10.5f}, {"perf/mfu", 0.25f}}));
  auto step2 = fields(recs[3]);
  EXPECT_EQ(step2.find(2)->second, "2");
  EXPECT_GE(as_double(step2.find(1)->second), as_double(step1.find(1)->second));
}

TEST_F(TensorBoard, TwoWritersInOneSecondMakeTwoFiles) {
  TensorBoardWriter a(dir_), b(dir_);
  EXPECT_NE(a.path(), b.path());
  // TensorBoard reads a directory's files in name order: the later one sorts after (a later
  // second, or the same name with a suffix).
  EXPECT_LT(a.path().filename().string(), b.path().filename().string());
}

TEST_F(TensorBoard, AnUnwritableDirectoryIsAClearError) {
  fs::create_directories(dir_);
  std::ofstream(dir_ / "file") << "x";
  try {
    TensorBoardWriter w(dir_ / "file" / "tensorboard");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("Cannot create the TensorBoard directory '" +
                       (dir_ / "file" / "tensorboard").string() + "'"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("enable_tensorboard=false"), std::string::npos) << msg;
    EXPECT_EQ(e.exit_code(), 1);
  }
}

// The trainer's part: enable_tensorboard=true puts MaxText's tags, one event per step, in
// <run>/tensorboard/<run_name>/.
TEST_F(TensorBoard, TrainingRunWritesItsScalars) {
  const auto r = test::run_mt(
      "run --model=llama-test dataset_type=synthetic steps=3 "
      "eval_interval=3 eval_steps=1 log_period=1000 "
      "enable_tensorboard=true run_name=tb base_output_directory=" +
          dir_.string(),
      300);
  ASSERT_EQ(r.code, 0) << r.out;
  const fs::path tb = dir_ / "tb" / "tensorboard" / "tb";
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(tb)) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  const auto recs = read_records(files[0]);
  std::map<int64_t, std::map<std::string, float>> steps;
  for (const auto& rec : recs) {
    auto f = fields(rec);
    if (!f.count(5)) continue;
    auto values = fields(f.find(5)->second);
    for (auto [it, end] = values.equal_range(1); it != end; ++it) {
      auto v = fields(it->second);
      steps[std::stoll(f.find(2)->second)][v.find(1)->second] = as_float(v.find(2)->second);
    }
  }
  ASSERT_EQ(steps.size(), 3u);
  for (const char* tag :
       {"learning/loss", "learning/current_learning_rate", "learning/grad_norm",
        "learning/raw_grad_norm", "learning/total_weights", "perf/step_time_seconds",
        "perf/per_device_tokens_per_sec", "perf/per_device_tflops_per_sec", "perf/mfu"})
    for (int64_t s = 1; s <= 3; ++s) EXPECT_EQ(steps[s].count(tag), 1u) << tag << " step " << s;
  EXPECT_EQ(steps[1].count("eval/avg_loss"), 0u);
  EXPECT_EQ(steps[3].count("eval/avg_loss"), 1u);
  EXPECT_GT(steps[1]["learning/loss"], 0.f);
}

}  // namespace
}  // namespace mt
