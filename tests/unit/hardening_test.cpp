// Issue 24 (hardening), seen from the command line: each test is a reproducer of a defect found
// by trying mt as an adversary would, and fails (or hangs, bounded by `timeout`) without its fix.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "run_lock.h"
#include "test_support.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

// With a time limit: a hang is a failure (exit code 124), not a stuck suite.
test::MtResult mt_cmd(const std::string& args, int seconds = 120, const std::string& env = "") {
  return test::run_mt(args, seconds, env);
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::vector<std::string> lines_of(const fs::path& p) {
  std::ifstream f(p);
  std::vector<std::string> out;
  for (std::string l; std::getline(f, l);)
    if (!l.empty()) out.push_back(l);
  return out;
}

// A short llama-test run on synthetic data in the test's directory.
constexpr const char* kRun =
    "run --model=llama-test dataset_type=synthetic eval_interval=-1 log_period=1000 ";

class Hardening : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("mt_hardening_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add, ec);
    fs::remove_all(dir_, ec);
  }
  std::string out_dir() const { return "base_output_directory=" + dir_.string(); }
  fs::path dir_;
};

// Item 4: a width whose parameter sizes overflow is refused before anything is allocated (it
// hung: the allocator's size rounding doubled past 2^63 to 0 and looped).
TEST_F(Hardening, OverflowingShapesAreRefusedAtConfigTime) {
  auto r = mt_cmd("run --model=llama-test dataset_type=synthetic steps=1 " + out_dir() +
                      " base_emb_dim=9223372036854775807",
                  60);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "cannot be built") && has(r.out, "9223372036854775807")) << r.out;
  r = mt_cmd("run --model=llama-test dataset_type=synthetic steps=1 " + out_dir() +
                 " vocab_size=4611686018427387904",
             60);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "'embedding'")) << r.out;
}

// Item 6: a bare word is refused (`steps 5` trained the default 300 steps and exited 0).
TEST_F(Hardening, BareWordsAreRefused) {
  auto r = mt_cmd("run --model=llama-test dataset_type=synthetic " + out_dir() + " steps 5");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "'steps' is not an option of mt run") &&
              has(r.out, "did you mean steps=5?"))
      << r.out;
  EXPECT_FALSE(fs::exists(dir_ / "default")) << "the run started";
  r = mt_cmd("config --model=llama-test -v");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "'-v' is not an option of mt config")) << r.out;
  // mt bench takes exactly one word, what to measure.
  r = mt_cmd("bench train extra --model=llama-test steps=3");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "'extra' is not an option of mt bench")) << r.out;
}

// Item 8: one writer per run directory. A run whose directory is locked (here by this test
// process, as a concurrent `mt run` would) is refused with the holder's PID, touching nothing.
TEST_F(Hardening, ASecondRunInTheSameDirectoryIsRefused) {
  auto r = mt_cmd(std::string(kRun) + "steps=2 " + out_dir());
  ASSERT_EQ(r.code, 0) << r.out;
  const auto before = lines_of(dir_ / "default" / "metrics.jsonl");
  {
    RunLock held(dir_ / "default");
    r = mt_cmd(std::string(kRun) + "steps=4 " + out_dir());
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_TRUE(has(r.out, "PID " + std::to_string(::getpid())) && has(r.out, "run_name="))
        << r.out;
    EXPECT_EQ(lines_of(dir_ / "default" / "metrics.jsonl"), before) << "the refused run wrote";
    // Another run name is another directory.
    r = mt_cmd(std::string(kRun) + "steps=2 run_name=other " + out_dir());
    EXPECT_EQ(r.code, 0) << r.out;
  }
  // Released with its holder (the kernel drops a flock when the descriptor closes, kill -9 too).
  r = mt_cmd(std::string(kRun) + "steps=4 " + out_dir());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(lines_of(dir_ / "default" / "metrics.jsonl").size(), 4u);
}

// Item 9: each metrics record reaches the file when it is made. The fault hook ends the process
// in the middle of the step-2 save as kill -9 would; step 1's line was lost in the stream's buffer.
TEST_F(Hardening, MetricsSurviveAKill) {
  auto r = mt_cmd(
      std::string(kRun) + "steps=4 checkpoint_period=2 async_checkpointing=false " + out_dir(), 120,
      "MT_CHECKPOINT_CRASH=after_params");
  EXPECT_EQ(r.code, 137) << r.out;
  const auto lines = lines_of(dir_ / "default" / "metrics.jsonl");
  ASSERT_EQ(lines.size(), 1u) << r.out;
  EXPECT_TRUE(has(lines[0], "\"step\": 1,")) << lines[0];
}

// Item 9: a newer checkpoint that is incomplete is passed over with a warning saying which and
// why (it was silent), while the run resumes from the newest complete one.
TEST_F(Hardening, SkippedCheckpointsAreNamed) {
  auto r = mt_cmd(std::string(kRun) + "steps=4 checkpoint_period=2 async_checkpointing=false " +
                  out_dir());
  ASSERT_EQ(r.code, 0) << r.out;
  const fs::path ckpt = dir_ / "default" / "checkpoints";
  fs::resize_file(ckpt / "4" / "params.safetensors", 100);
  r = mt_cmd(std::string(kRun) + "steps=6 checkpoint_period=2 async_checkpointing=false " +
             out_dir());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "checkpoint step 4") && has(r.out, "is skipped") &&
              has(r.out, "params.safetensors' is 100 bytes") && has(r.out, "resumed from step 2"))
      << r.out;
  fs::remove(ckpt / "6" / "metadata.json");
  r = mt_cmd(std::string(kRun) + "steps=6 checkpoint_period=2 async_checkpointing=false " +
             out_dir());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "checkpoint step 6") && has(r.out, "metadata.json")) << r.out;
}

// Item 11: run_name cannot leave base_output_directory, and a directory that cannot be made is
// named with the reason (it was "internal error: filesystem error").
TEST_F(Hardening, OutputDirectoryErrorsAreSentences) {
  for (const std::string name : {"../escaped", "/tmp/abs", "..", "a/b"}) {
    auto r = mt_cmd(std::string(kRun) + "steps=1 run_name=" + name + " " + out_dir());
    EXPECT_EQ(r.code, 2) << name << ": " << r.out;
    EXPECT_TRUE(has(r.out, "run_name") && has(r.out, "plain directory name")) << r.out;
  }
  EXPECT_FALSE(fs::exists(dir_.parent_path() / "escaped"));
  // A parent that is a file stands in for a read-only or missing place (tests run as root,
  // which permissions do not stop).
  std::ofstream(dir_ / "file") << "x";
  auto r = mt_cmd(std::string(kRun) + "steps=1 base_output_directory=" + (dir_ / "file").string());
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_TRUE(has(r.out, "Cannot create the run directory") && has(r.out, "Not a directory") &&
              !has(r.out, "internal error"))
      << r.out;
}

}  // namespace
}  // namespace mt
