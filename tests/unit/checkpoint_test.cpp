#include "checkpoint_manager.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mt/comm.h"
#include "mt/error.h"
#include "safetensors.h"
#include "test_support.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using test::cpu;

// A pid no process can have (above the kernel's pid_max), for "left by a dead process".
constexpr const char* kDeadPid = "2147483646";

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void write_all(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << s;
}

// The raw bytes of a tensor, for bit-exact comparisons of any dtype.
std::vector<unsigned char> bytes_of(const Tensor& t) {
  std::vector<unsigned char> b(t.nbytes());
  t.backend()->copy_to_host(t, b.data());
  return b;
}

// Bit-level CRC-32C, the definition itself, to check the fast paths against.
uint32_t crc32c_reference(const unsigned char* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::temp_directory_path() /
            ("mt_checkpoint_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
    dir_ = root_ / "run" / "checkpoints";
    rng_.seed(test::seed());
  }
  void TearDown() override { fs::remove_all(root_); }

  Tensor rand_tensor(const Shape& shape, DType dt = DType::f32) {
    return test::from_vector(cpu(), shape, test::randn(shape_numel(shape), rng_), dt);
  }

  // A small model's state: f32 and bf16 parameters, f32 moments, awkward strings.
  TrainState make_state(int64_t step, bool with_opt = true, int64_t rows = 4) {
    TrainState s;
    s.step = step;
    s.params["embedding"] = rand_tensor({rows, 8});
    s.params["layers.0.wq"] = rand_tensor({8, 8}, DType::bf16);
    s.params["norm"] = rand_tensor({8});
    if (with_opt) {
      for (const auto& [name, t] : s.params) {
        s.opt_m[name] = rand_tensor(t.shape());
        s.opt_v[name] = rand_tensor(t.shape());
      }
    }
    s.data_state = "{\"shard\": 3, \"offset\": " + std::to_string(step * 17) + "}";
    s.rng_state = "seed=7\tcounter=" + std::to_string(step) + "\r\n\x01\x7f";
    s.config_yaml =
        "model_name: \"llama2-7b\"\nrun_name: 'it''s'\npath: C:\\tmp\\x\nunicode: "
        "\xc3\xa9\xe2\x82\xac"
        "\n# \"quoted\" \\ backslash\n";
    return s;
  }

  // Same names, shapes and dtypes as `s`, zero-filled: what a trainer holds before restore.
  static TrainState blank_like(const TrainState& s) {
    TrainState b;
    auto blank = [](const std::map<std::string, Tensor>& src, std::map<std::string, Tensor>& dst) {
      for (const auto& [name, t] : src) dst[name] = cpu().zeros(t.shape(), t.dtype());
    };
    blank(s.params, b.params);
    blank(s.opt_m, b.opt_m);
    blank(s.opt_v, b.opt_v);
    return b;
  }

  static void expect_same(const TrainState& a, const TrainState& b) {
    EXPECT_EQ(a.step, b.step);
    EXPECT_EQ(a.data_state, b.data_state);
    EXPECT_EQ(a.rng_state, b.rng_state);
    EXPECT_EQ(a.config_yaml, b.config_yaml);
    auto same = [](const std::map<std::string, Tensor>& x, const std::map<std::string, Tensor>& y) {
      ASSERT_EQ(x.size(), y.size());
      for (const auto& [name, t] : x) {
        ASSERT_TRUE(y.count(name)) << name;
        EXPECT_EQ(t.dtype(), y.at(name).dtype()) << name;
        EXPECT_EQ(bytes_of(t), bytes_of(y.at(name))) << name;
      }
    };
    same(a.params, b.params);
    same(a.opt_m, b.opt_m);
    same(a.opt_v, b.opt_v);
  }

  // Expects `f` to throw mt::Error whose message contains every one of `parts`; returns it.
  template <class F>
  static std::string expect_error(F&& f, const std::vector<std::string>& parts) {
    try {
      f();
    } catch (const Error& e) {
      std::string msg = e.what();
      for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << p << "\n" << msg;
      return msg;
    }
    ADD_FAILURE() << "no mt::Error thrown";
    return {};
  }

  fs::path root_, dir_;
  std::mt19937_64 rng_;
};

TEST(Crc32c, KnownValuesAndIncremental) {
  const char* check = "123456789";
  EXPECT_EQ(crc32c(0, check, 9), 0xE3069283u);
  std::vector<unsigned char> zeros(32, 0);
  EXPECT_EQ(crc32c(0, zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4
  EXPECT_EQ(crc32c(0, nullptr, 0), 0u);
  // Every length and misalignment against the bit-level definition, and split anywhere.
  std::mt19937 rng(1);
  std::vector<unsigned char> buf(300);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (size_t off = 0; off < 9; ++off) {
    for (size_t n = 0; n + off <= buf.size(); n += 7) {
      uint32_t want = crc32c_reference(buf.data() + off, n);
      ASSERT_EQ(crc32c(0, buf.data() + off, n), want) << off << " " << n;
      ASSERT_EQ(crc32c_portable(0, buf.data() + off, n), want) << off << " " << n;
      size_t cut = n / 3;
      ASSERT_EQ(crc32c(crc32c(0, buf.data() + off, cut), buf.data() + off + cut, n - cut), want);
    }
  }
}

TEST(Crc32c, LargeBuffersAndFiles) {
  // Long enough for the interleaved lanes of the hardware path, with ragged ends.
  std::mt19937 rng(2);
  std::vector<unsigned char> buf((1 << 20) + 13);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (size_t off : {size_t{0}, size_t{3}}) {
    for (size_t n : {size_t{12288}, size_t{12289}, size_t{40000}, buf.size() - off}) {
      uint32_t want = crc32c_reference(buf.data() + off, n);
      ASSERT_EQ(crc32c(0, buf.data() + off, n), want) << off << " " << n;
      ASSERT_EQ(crc32c_portable(0, buf.data() + off, n), want) << off << " " << n;
      size_t cut = n / 2 + 5;
      ASSERT_EQ(crc32c(crc32c(0, buf.data() + off, cut), buf.data() + off + cut, n - cut), want);
    }
  }
  fs::path p = fs::temp_directory_path() / ("mt_crc_" + std::to_string(::getpid()));
  write_all(p, std::string(reinterpret_cast<const char*>(buf.data()), buf.size()));
  EXPECT_EQ(crc32c_file(p), crc32c_reference(buf.data(), buf.size()));
  fs::remove(p);
  EXPECT_THROW(crc32c_file(p), Error);
}

TEST_F(Checkpoint, RoundTripSync) {
  CheckpointManager ckpt(dir_, /*async=*/false, 0, cpu());
  EXPECT_EQ(ckpt.latest_step(), -1);
  TrainState s = make_state(5);
  ckpt.save(s);
  ckpt.wait();
  EXPECT_EQ(ckpt.latest_step(), 5);
  EXPECT_TRUE(fs::exists(dir_ / "5" / "params.safetensors"));
  EXPECT_TRUE(fs::exists(dir_ / "5" / "opt_m.safetensors"));
  EXPECT_TRUE(fs::exists(dir_ / "5" / "opt_v.safetensors"));
  std::string meta = read_all(dir_ / "5" / "metadata.json");
  EXPECT_NE(meta.find("\"complete\": true"), std::string::npos) << meta;
  EXPECT_NE(meta.find("\"checksum\": \"crc32c\""), std::string::npos) << meta;
  EXPECT_GT(ckpt.last_blocking_seconds(), 0.0);
  EXPECT_GT(ckpt.last_write_bytes(), 0u);

  TrainState r = blank_like(s);
  CheckpointManager reader(dir_, false, 0, cpu());
  reader.restore(5, r);
  expect_same(s, r);
  // The files are ordinary safetensors the ecosystem can read.
  SafeTensorsFile f(dir_ / "5" / "params.safetensors");
  EXPECT_EQ(f.info("layers.0.wq").dtype, "BF16");
}

TEST_F(Checkpoint, RoundTripAsyncReusesBuffers) {
  CheckpointManager ckpt(dir_, /*async=*/true, 0, cpu());
  TrainState s1 = make_state(10);
  ckpt.save(s1);
  // The snapshot was taken: changing the live tensors now must not change step 10.
  TrainState s2 = make_state(20);
  for (auto& [name, t] : s1.params) cpu().fill(t, 42.f);
  ckpt.save(s2);  // waits for step 10, reuses its host buffers
  ckpt.wait();
  EXPECT_EQ(ckpt.complete_steps(), (std::vector<int64_t>{10, 20}));

  TrainState r2 = blank_like(s2);
  ckpt.restore(20, r2);
  expect_same(s2, r2);
  TrainState r1 = blank_like(s1);
  ckpt.restore(10, r1);
  for (const auto& [name, t] : r1.params)
    for (float v : test::to_vector(t)) ASSERT_NE(v, 42.f) << name;
  EXPECT_EQ(r1.step, 10);
}

TEST_F(Checkpoint, ParameterOnly) {
  CheckpointManager ckpt(dir_, false, 0, cpu());
  TrainState s = make_state(3, /*with_opt=*/false);
  ckpt.save(s);
  EXPECT_FALSE(fs::exists(dir_ / "3" / "opt_m.safetensors"));
  EXPECT_EQ(ckpt.latest_step(), 3);
  TrainState r = blank_like(s);
  ckpt.restore(3, r);
  expect_same(s, r);
  // A state that wants moments cannot be restored from it.
  TrainState full = blank_like(make_state(3, true));
  expect_error([&] { ckpt.restore(3, full); }, {"parameter-only", "load_parameters_path"});
  // A full checkpoint restores into a parameter-only state (the moments are not read).
  CheckpointManager ckpt2(root_ / "other", false, 0, cpu());
  TrainState s2 = make_state(4, true);
  ckpt2.save(s2);
  TrainState p = blank_like(make_state(4, false));
  ckpt2.restore(4, p);
  EXPECT_EQ(bytes_of(p.params.at("norm")), bytes_of(s2.params.at("norm")));
}

TEST_F(Checkpoint, ConvertsDtypes) {
  CheckpointManager ckpt(dir_, false, 0, cpu());
  TrainState s = make_state(1, false);
  ckpt.save(s);
  // bf16 on disk into f32, f32 on disk into bf16.
  TrainState r;
  r.params["embedding"] = cpu().zeros({4, 8}, DType::bf16);
  r.params["layers.0.wq"] = cpu().zeros({8, 8}, DType::f32);
  r.params["norm"] = cpu().zeros({8}, DType::f32);
  ckpt.restore(1, r);
  EXPECT_EQ(test::to_vector(r.params["layers.0.wq"]), test::to_vector(s.params["layers.0.wq"]));
  std::vector<float> want = test::to_vector(s.params["embedding"]);
  for (auto& v : want) v = bf16_to_f32(f32_to_bf16(v));
  EXPECT_EQ(test::to_vector(r.params["embedding"]), want);
}

TEST_F(Checkpoint, LatestStepIgnoresTmpAndIncomplete) {
  CheckpointManager ckpt(dir_, false, 0, cpu());
  ckpt.save(make_state(1));
  ckpt.save(make_state(2));
  // A crash mid-save of step 3 (complete-looking content, but still under its temporary name).
  fs::path tmp = dir_ / (std::string("3.tmp-") + kDeadPid);
  fs::copy(dir_ / "2", tmp);
  // Step 4 whose metadata never said complete.
  fs::copy(dir_ / "2", dir_ / "4");
  std::string meta = read_all(dir_ / "4" / "metadata.json");
  size_t at = meta.find(",\n  \"complete\": true");
  ASSERT_NE(at, std::string::npos);
  meta.erase(at, std::strlen(",\n  \"complete\": true"));
  std::string step4 = meta;
  size_t sp = step4.find("\"step\": 2");
  ASSERT_NE(sp, std::string::npos);
  step4.replace(sp, 9, "\"step\": 4");
  write_all(dir_ / "4" / "metadata.json", step4);
  // Step 6 with "complete": false, step 7 with unparseable metadata, and unrelated entries.
  fs::copy(dir_ / "2", dir_ / "6");
  std::string m6 = read_all(dir_ / "2" / "metadata.json");
  m6.replace(m6.find("\"step\": 2"), 9, "\"step\": 6");
  m6.replace(m6.find("\"complete\": true"), 16, "\"complete\": false");
  write_all(dir_ / "6" / "metadata.json", m6);
  fs::copy(dir_ / "2", dir_ / "7");
  write_all(dir_ / "7" / "metadata.json", "{\"format\": ");
  fs::create_directories(dir_ / "notes");
  write_all(dir_ / "99", "a file, not a checkpoint");
  // A step directory whose metadata names another step (copied by hand) is not trusted either.
  fs::copy(dir_ / "2", dir_ / "8");

  EXPECT_EQ(ckpt.latest_step(), 2);
  EXPECT_EQ(ckpt.complete_steps(), (std::vector<int64_t>{1, 2}));
  TrainState r = blank_like(make_state(0));
  expect_error([&] { ckpt.restore(4, r); }, {"corrupt", "complete", "step 2"});

  // The next save removes the dead process's temporary directory, and nothing else.
  ckpt.save(make_state(5));
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_TRUE(fs::exists(dir_ / "4"));
  EXPECT_TRUE(fs::exists(dir_ / "notes"));
  EXPECT_EQ(ckpt.latest_step(), 5);
}

// A leftover whose pid names a live process is another writer's, unless the run's lock is held
// (claim_directory): then no other process saves here, and the pid is an unrelated process's
// (pid reuse, a reboot). Before, such a leftover (a whole step's shards) was kept forever.
TEST_F(Checkpoint, ClaimedDirectoryDropsLeftoversOfLivePids) {
  CheckpointManager ckpt(dir_, false, 0, cpu());
  ckpt.save(make_state(1));
  const std::string live = std::to_string(::getppid());  // alive, and not this process
  const fs::path tmp = dir_ / ("2.tmp-" + live), old = dir_ / ("1.old-" + live);
  fs::copy(dir_ / "1", tmp);
  fs::copy(dir_ / "1", old);
  ckpt.save(make_state(2));
  EXPECT_TRUE(fs::exists(tmp));  // unclaimed: maybe a live writer's
  EXPECT_TRUE(fs::exists(old));
  CheckpointManager owner(dir_, false, 0, cpu());
  owner.claim_directory();
  owner.save(make_state(3));
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_FALSE(fs::exists(old));
  EXPECT_EQ(owner.complete_steps(), (std::vector<int64_t>{1, 2, 3}));
}

TEST_F(Checkpoint, RetentionKeepsNewest) {
  CheckpointManager ckpt(dir_, true, /*max_to_keep=*/2, cpu());
  for (int64_t step = 1; step <= 5; ++step) ckpt.save(make_state(step));
  ckpt.wait();
  EXPECT_EQ(ckpt.complete_steps(), (std::vector<int64_t>{4, 5}));
  for (const auto& e : fs::directory_iterator(dir_)) {
    std::string n = e.path().filename().string();
    EXPECT_TRUE(n == "4" || n == "5") << "leftover " << n;
  }
  // The step just saved stays even when higher steps exist (an older run's).
  CheckpointManager again(dir_, false, 2, cpu());
  again.save(make_state(3));
  EXPECT_EQ(again.complete_steps(), (std::vector<int64_t>{3, 5}));
}

TEST_F(Checkpoint, FlippedByteIsDetected) {
  CheckpointManager ckpt(dir_, false, 0, cpu());
  TrainState s1 = make_state(1);
  ckpt.save(s1);
  ckpt.save(make_state(2));
  fs::path p = dir_ / "2" / "params.safetensors";
  std::string bytes = read_all(p);
  // One byte in the tensor data, then (separately) one in the JSON header.
  for (size_t pos : {bytes.size() - 5, size_t{20}}) {
    std::string bad = bytes;
    bad[pos] = static_cast<char>(bad[pos] ^ 0x10);
    write_all(p, bad);
    EXPECT_EQ(ckpt.latest_step(), 2);  // listing checks sizes only
    TrainState r = blank_like(s1);
    std::vector<unsigned char> before = bytes_of(r.params.at("norm"));
    expect_error([&] { ckpt.restore(2, r); },
                 {"params.safetensors", "corrupt", "CRC-32C", "checkpoint is step 1"});
    EXPECT_EQ(bytes_of(r.params.at("norm")), before);  // nothing was loaded
    EXPECT_EQ(r.step, 0);
  }
  write_all(p, bytes);
  TrainState ok = blank_like(s1);
  ckpt.restore(2, ok);
  EXPECT_EQ(ok.step, 2);
}

TEST_F(Checkpoint, TruncatedFileIsSkipped) {
  CheckpointManager ckpt(dir_, false, 0, cpu());
  ckpt.save(make_state(1));
  ckpt.save(make_state(2));
  fs::path p = dir_ / "2" / "opt_v.safetensors";
  fs::resize_file(p, fs::file_size(p) - 3);
  EXPECT_EQ(ckpt.latest_step(), 1);
  TrainState r = blank_like(make_state(0));
  expect_error([&] { ckpt.restore(2, r); }, {"opt_v.safetensors", "corrupt", "truncated"});
  // A missing file is no better.
  fs::remove(dir_ / "1" / "opt_m.safetensors");
  EXPECT_EQ(ckpt.latest_step(), -1);
  // A reader given the directory says which step it looked at and what it lacks (before: "holds
  // no complete checkpoint" alone, as for an empty directory).
  std::map<std::string, Tensor> params = blank_like(make_state(0)).params;
  expect_error([&] { load_parameters(dir_.parent_path(), params); },
               {"holds no complete checkpoint", "its newest step directory", "/2", "opt_v"});
}

TEST_F(Checkpoint, MetadataWithoutCompleteIsSkipped) {
  CheckpointManager ckpt(dir_, false, 0, cpu());
  ckpt.save(make_state(1));
  ckpt.save(make_state(2));
  fs::path m = dir_ / "2" / "metadata.json";
  std::string meta = read_all(m);
  size_t at = meta.find(",\n  \"complete\": true");
  ASSERT_NE(at, std::string::npos);
  meta.erase(at, std::strlen(",\n  \"complete\": true"));
  write_all(m, meta);
  EXPECT_EQ(ckpt.latest_step(), 1);
  TrainState r = blank_like(make_state(0));
  expect_error([&] { ckpt.restore(2, r); }, {"metadata.json", "complete", "step 1"});
  // A metadata file that is not JSON at all.
  write_all(m, "{\"format\": \"mt-checkpoint\", \"version\": [}");
  expect_error([&] { ckpt.restore(2, r); }, {"metadata.json", "corrupt"});
  expect_error([&] { ckpt.restore(9, r); }, {"no checkpoint for step 9"});
}

TEST_F(Checkpoint, MismatchedNamesAndShapes) {
  CheckpointManager ckpt(dir_, false, 0, cpu());
  TrainState s = make_state(1);
  ckpt.save(s);

  TrainState names = blank_like(s);
  names.params.erase("norm");
  names.params["layers.0.wk"] = cpu().zeros({8, 8}, DType::f32);
  std::vector<unsigned char> before = bytes_of(names.params.at("embedding"));
  expect_error([&] { ckpt.restore(1, names); }, {"params.safetensors", "missing tensors",
                                                 "'layers.0.wk'", "unexpected tensors", "'norm'"});
  EXPECT_EQ(bytes_of(names.params.at("embedding")), before);

  TrainState shapes = blank_like(make_state(1, true, /*rows=*/6));
  expect_error([&] { ckpt.restore(1, shapes); },
               {"params.safetensors", "'embedding'", "[4, 8]", "[6, 8]"});

  TrainState opt = blank_like(s);
  opt.opt_v.erase("norm");
  expect_error([&] { ckpt.restore(1, opt); }, {"opt_v.safetensors", "'norm'"});
}

TEST_F(Checkpoint, AsyncErrorIsReportedByWait) {
  // The checkpoint directory would be under a regular file: every write fails (even as root).
  write_all(root_ / "blocker", "x");
  fs::path bad = root_ / "blocker" / "checkpoints";
  CheckpointManager ckpt(bad, /*async=*/true, 0, cpu());
  ckpt.save(make_state(1));  // returns: the failure happens on the worker
  expect_error([&] { ckpt.wait(); }, {"step 1", bad.string()});
  ckpt.wait();  // reported once
  // The next save() reports a failure it has not yet been told about, and starts nothing.
  ckpt.save(make_state(2));
  expect_error([&] { ckpt.save(make_state(3)); }, {"step 2"});
  ckpt.wait();

  // Sync mode throws from save() itself.
  CheckpointManager sync(bad, false, 0, cpu());
  expect_error([&] { sync.save(make_state(1)); }, {"step 1", "blocker"});
}

TEST_F(Checkpoint, FailedSaveKeepsExisting) {
  CheckpointManager ckpt(dir_, true, 1, cpu());
  TrainState s = make_state(1);
  ckpt.save(s);
  ckpt.wait();
  std::string before = read_all(dir_ / "1" / "params.safetensors");
  // A name the safetensors writer refuses: the write fails after the temporary directory exists.
  TrainState bad = make_state(2);
  bad.params["__metadata__"] = rand_tensor({2});
  ckpt.save(bad);
  expect_error([&] { ckpt.wait(); }, {"step 2", "__metadata__", "not modified"});
  EXPECT_EQ(ckpt.complete_steps(), (std::vector<int64_t>{1}));
  EXPECT_EQ(read_all(dir_ / "1" / "params.safetensors"), before);
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_EQ(e.path().filename().string(), "1") << "leftover";
  // Saving the same step again replaces it atomically.
  TrainState again = make_state(1);
  ckpt.save(again);
  ckpt.wait();
  TrainState r = blank_like(again);
  ckpt.restore(1, r);
  expect_same(again, r);
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_EQ(e.path().filename().string(), "1") << "leftover";
}

// A write that runs out of space (a file size limit stands in for a full disk): the save reports
// it, removes its partial files, and the existing checkpoint survives.
TEST_F(Checkpoint, OutOfSpaceKeepsExisting) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  CheckpointManager ckpt(dir_, true, 1, cpu());
  TrainState s = make_state(1);
  ckpt.save(s);
  ckpt.wait();
  TrainState big = make_state(2, true, /*rows=*/64 * 1024);  // 2 MiB per tensor
  // Checked in a child process (this test run again from its start, in its own directory), so the
  // limit does not outlive the test.
  EXPECT_EXIT(
      {
        ::signal(SIGXFSZ, SIG_IGN);  // writes past the limit fail with EFBIG instead
        rlimit lim;
        lim.rlim_cur = lim.rlim_max = 1 << 20;
        ::setrlimit(RLIMIT_FSIZE, &lim);
        ckpt.save(big);
        bool reported = false;
        try {
          ckpt.wait();
        } catch (const Error& e) {
          reported = std::string(e.what()).find("File too large") != std::string::npos;
        }
        std::vector<std::string> names;
        for (const auto& e : fs::directory_iterator(dir_))
          names.push_back(e.path().filename().string());
        bool clean = names == std::vector<std::string>{"1"};
        std::fprintf(stderr, "reported=%d clean=%d\n", reported, clean);
        fs::remove_all(root_);
        std::_Exit(reported && clean ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "reported=1 clean=1");
  TrainState r = blank_like(s);
  ckpt.restore(1, r);
  expect_same(s, r);
}

TEST_F(Checkpoint, DestructorWaitsAndBlockingIsMeasured) {
  // Over 24 MiB of parameters and moments.
  TrainState s = make_state(7, true, /*rows=*/256 * 1024);
  {
    CheckpointManager ckpt(dir_, true, 0, cpu());
    ckpt.save(s);
    double blocked = ckpt.last_blocking_seconds();
    EXPECT_GT(blocked, 0.0);
    EXPECT_EQ(ckpt.total_blocking_seconds(), blocked);
    ckpt.wait();
    std::printf("async save of %.1f MB: blocked %.4f s, write %.4f s\n",
                ckpt.last_write_bytes() / 1e6, blocked, ckpt.last_write_seconds());
    EXPECT_GT(ckpt.last_write_seconds(), 0.0);
    EXPECT_GT(ckpt.last_write_bytes(), size_t{24} << 20);
    s.step = 8;
    ckpt.save(s);
    EXPECT_GT(ckpt.total_blocking_seconds(), blocked);
    // Destroyed with step 8 in flight.
  }
  CheckpointManager reader(dir_, false, 0, cpu());
  EXPECT_EQ(reader.latest_step(), 8);
  TrainState r = blank_like(s);
  reader.restore(8, r);
  expect_same(s, r);
}

TEST_F(Checkpoint, LoadParameters) {
  CheckpointManager ckpt(dir_, false, 0, cpu());
  TrainState s1 = make_state(1);
  TrainState s2 = make_state(2);
  ckpt.save(s1);
  ckpt.save(s2);
  auto load = [&](const fs::path& p) {
    std::map<std::string, Tensor> params = blank_like(s1).params;
    load_parameters(p, params);
    return params;
  };
  auto same = [&](const std::map<std::string, Tensor>& a, const TrainState& s) {
    for (const auto& [name, t] : s.params) EXPECT_EQ(bytes_of(a.at(name)), bytes_of(t)) << name;
  };
  same(load(dir_ / "1"), s1);                         // a step directory
  same(load(dir_), s2);                               // a checkpoints directory: its latest step
  same(load(dir_.parent_path()), s2);                 // a run directory
  same(load(dir_ / "1" / "params.safetensors"), s1);  // a bare safetensors file
  fs::create_directories(root_ / "empty");
  expect_error([&] { load(root_ / "empty"); }, {"no complete checkpoint"});
  expect_error([&] { load(root_ / "missing"); }, {"does not exist"});
  // Corruption is caught here too.
  fs::path p = dir_ / "2" / "params.safetensors";
  std::string bytes = read_all(p);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 1);
  write_all(p, bytes);
  expect_error([&] { load(dir_ / "2"); }, {"params.safetensors", "corrupt", "step 1"});

  // A bare file of other floating widths (numpy's float64, float16 exports) converts, as the
  // Hugging Face reader's does: F64 of f32 values gives the same bits, F16 its rounding; an
  // integer tensor is refused with the types that convert (before: F64 and F16 were said to be
  // types that "cannot be converted").
  std::vector<std::vector<double>> wide;
  std::vector<std::vector<uint16_t>> half;
  std::vector<SafeTensorsEntry> f64, f16;
  for (const auto& [name, t] : s1.params) {
    const std::vector<float> v = test::to_vector(t);
    wide.emplace_back(v.begin(), v.end());
    f64.emplace_back(name, std::string("F64"), t.shape(), wide.back().data());
    half.emplace_back();
    for (const float x : v) {  // exactly representable halves: multiples of 1/1024 in [-2, 2)
      const float h = std::round(std::clamp(x, -2.f, 1.99f) * 1024.f) / 1024.f;
      uint16_t bits = 0;
      if (h != 0.f) {
        int e = 0;
        const float m = std::frexp(std::fabs(h), &e);  // |h| = m 2^e, m in [0.5, 1)
        bits =
            static_cast<uint16_t>(((e + 14) << 10) | (static_cast<int>(std::ldexp(m, 11)) & 0x3ff));
        if (e + 14 <= 0) bits = static_cast<uint16_t>(std::ldexp(std::fabs(h), 24));  // subnormal
        if (h < 0) bits |= 0x8000;
      }
      half.back().push_back(bits);
    }
    f16.emplace_back(name, std::string("F16"), t.shape(), half.back().data());
  }
  write_safetensors(root_ / "f64.safetensors", f64);
  same(load(root_ / "f64.safetensors"), s1);
  write_safetensors(root_ / "f16.safetensors", f16);
  const auto got16 = load(root_ / "f16.safetensors");
  for (const auto& [name, t] : s1.params) {
    const std::vector<float> want = test::to_vector(t), got = test::to_vector(got16.at(name));
    for (size_t i = 0; i < want.size(); ++i) {
      const float h = std::round(std::clamp(want[i], -2.f, 1.99f) * 1024.f) / 1024.f;
      const float tol = t.dtype() == DType::bf16 ? std::fabs(h) / 128.f : 0.f;  // bf16's rounding
      ASSERT_LE(std::fabs(got[i] - h), tol) << name << " " << i;
    }
  }
  std::vector<int32_t> ints(64);
  write_safetensors(root_ / "i32.safetensors", {{"embedding", DType::i32, {4, 8}, ints.data()},
                                                {"layers.0.wq", DType::i32, {8, 8}, ints.data()},
                                                {"norm", DType::i32, {8}, ints.data()}});
  expect_error([&] { load(root_ / "i32.safetensors"); },
               {"'embedding' is stored as I32, not a floating type that converts to float32 "
                "(F16, BF16, F32 or F64)"});
}

TEST_F(Checkpoint, LoadFullState) {
  CheckpointManager ckpt(dir_, false, 0, cpu());
  TrainState s = make_state(4);
  ckpt.save(make_state(3));
  ckpt.save(s);
  TrainState r = blank_like(s);
  load_full_state(dir_.parent_path(), r);  // a run directory: its latest step
  expect_same(s, r);
  TrainState r3 = blank_like(s);
  load_full_state(dir_ / "3", r3);
  EXPECT_EQ(r3.step, 3);
  expect_error([&] { load_full_state(root_ / "nothing", r3); }, {"load_full_state_path"});
}

// A process killed in the middle of a save (the fault hook _exits like SIGKILL would): the
// previous checkpoint stays the latest, and the next save cleans up the partial one.
TEST_F(Checkpoint, CrashMidSaveKeepsPreviousAndIsCleanedUp) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  {
    CheckpointManager ckpt(dir_, false, 0, cpu());
    ckpt.save(make_state(1));
  }
  // The child is this binary run again (threadsafe death tests) from the start of this test, so
  // it has its own pid and test directory: it learns the parent's from the environment (the
  // child inherits it, and must not overwrite it) and removes its own.
  ::setenv("MT_CHECKPOINT_TEST_DIR", dir_.c_str(), /*overwrite=*/0);
  for (const char* point : {"after_params", "before_rename"}) {
    EXPECT_EXIT(
        {
          fs::remove_all(root_);
          ::setenv("MT_CHECKPOINT_CRASH", point, 1);
          CheckpointManager ckpt(std::getenv("MT_CHECKPOINT_TEST_DIR"), true, 0, cpu());
          ckpt.save(make_state(2));
          ckpt.wait();
        },
        ::testing::ExitedWithCode(137), "exiting mid-save");
    CheckpointManager ckpt(dir_, false, 0, cpu());
    EXPECT_EQ(ckpt.latest_step(), 1) << point;
    bool partial = false;
    for (const auto& e : fs::directory_iterator(dir_))
      partial |= e.path().filename().string().rfind("2.tmp-", 0) == 0;
    EXPECT_TRUE(partial) << point << ": the child left no temporary directory";
  }
  ::unsetenv("MT_CHECKPOINT_TEST_DIR");
  CheckpointManager ckpt(dir_, false, 0, cpu());
  TrainState s = make_state(3);
  ckpt.save(s);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"1", "3"}));
  TrainState r = blank_like(s);
  ckpt.restore(3, r);
  expect_same(s, r);
}

// ---- sharded checkpoints (format version 2) -------------------------------------------------

// Ranks as threads of one process, their collectives through shared memory: the sharded saves'
// protocol without mpirun (the mpirun tests run it across processes).
struct ThreadWorld {
  explicit ThreadWorld(int n) : ranks(n), sync(n), slots(static_cast<size_t>(n)) {}
  int ranks;
  std::barrier<> sync;
  std::vector<void*> slots;
};

class ThreadComm final : public Communicator {
 public:
  ThreadComm(ThreadWorld& w, int rank) : w_(w), rank_(rank) {}
  std::string name() const override { return "threads"; }
  int rank() const override { return rank_; }
  int size() const override { return w_.ranks; }
  void all_reduce_sum(float* data, size_t n) override { sum(data, n); }
  void all_reduce_sum(double* data, size_t n) override { sum(data, n); }
  void broadcast(void* data, size_t bytes, int root) override {
    w_.slots[static_cast<size_t>(rank_)] = data;
    w_.sync.arrive_and_wait();
    if (rank_ != root) std::memcpy(data, w_.slots[static_cast<size_t>(root)], bytes);
    w_.sync.arrive_and_wait();
  }
  void barrier() override { w_.sync.arrive_and_wait(); }
  [[noreturn]] void abort(int) override { std::abort(); }

 private:
  template <class T>
  void sum(T* data, size_t n) {
    w_.slots[static_cast<size_t>(rank_)] = data;
    w_.sync.arrive_and_wait();
    std::vector<T> total(n, T(0));
    for (int r = 0; r < w_.ranks; ++r)
      for (size_t i = 0; i < n; ++i)
        total[i] += static_cast<T*>(w_.slots[static_cast<size_t>(r)])[i];
    w_.sync.arrive_and_wait();
    std::copy(total.begin(), total.end(), data);
    w_.sync.arrive_and_wait();
  }
  ThreadWorld& w_;
  int rank_;
};

// Runs f(comm) on `n` threads, one rank each; rethrows the first rank's failure.
void on_ranks(int n, const std::function<void(Communicator&)>& f) {
  ThreadWorld world(n);
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      ThreadComm comm(world, r);
      try {
        f(comm);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r)
    if (!errors[static_cast<size_t>(r)].empty())
      FAIL() << "rank " << r << ": " << errors[static_cast<size_t>(r)];
}

// The elements [b, e) of part `part` of a whole tensor split into `parts` along `dim`, by the
// definition (every element of the whole visited, its part and place within it computed).
std::vector<float> cut(const std::vector<float>& whole, const Shape& shape, int dim, int parts,
                       int part, int64_t b, int64_t e) {
  std::vector<float> local;
  if (parts == 1) {
    local = whole;
  } else {
    int64_t inner = 1;  // elements of one index of `dim`
    for (size_t i = static_cast<size_t>(dim) + 1; i < shape.size(); ++i) inner *= shape[i];
    const int64_t size = shape[static_cast<size_t>(dim)], mine = size / parts;
    for (int64_t i = 0; i < static_cast<int64_t>(whole.size()); ++i)
      if ((i / inner) % size / mine == part) local.push_back(whole[static_cast<size_t>(i)]);
  }
  return std::vector<float>(local.begin() + b, local.begin() + e);
}

// A model's tensors whole: "w" split by tensor parallelism along dimension 1 ([embed, heads]),
// "b" replicated; the moments alike.
struct WholeState {
  std::map<std::string, Shape> shapes{{"w", {4, 6}}, {"b", {6}}};
  std::map<std::string, int> dims{{"w", 1}, {"b", -1}};
  std::map<std::string, std::vector<float>> values[3];
  explicit WholeState(std::mt19937_64& rng) {
    for (auto& group : values)
      for (const auto& [name, shape] : shapes) {
        group[name] = test::randn(static_cast<size_t>(shape_numel(shape)), rng);
        // Through bf16, so a part saved as bf16 round-trips exactly.
        for (float& v : group[name]) v = bf16_to_f32(f32_to_bf16(v));
      }
  }
  // A rank's parts on a mesh of `tp` tensor ranks x `fsdp` ranks (tensor rank r % tp, fsdp
  // rank r / tp), `bf16` parameters.
  ShardedTrainState parts(int rank, int tp, int fsdp, bool bf16 = false) const {
    ShardedTrainState st;
    for (int g = 0; g < 3; ++g)
      for (const auto& [name, shape] : shapes) {
        TensorPart p;
        p.shape = shape;
        const bool split = tp > 1 && dims.at(name) >= 0;
        p.dim = split ? dims.at(name) : -1;
        p.parts = split ? tp : 1;
        p.part = split ? rank % tp : 0;
        const auto [b, e] =
            shard_range(static_cast<size_t>(shape_numel(shape) / p.parts), rank / tp, fsdp);
        p.begin = static_cast<int64_t>(b);
        p.end = static_cast<int64_t>(e);
        const std::vector<float> mine =
            cut(values[g].at(name), shape, p.dim, p.parts, p.part, p.begin, p.end);
        p.data = test::from_vector(cpu(), {p.end - p.begin}, mine,
                                   g == 0 && bf16 ? DType::bf16 : DType::f32);
        st.tensors[g][name] = p;
      }
    return st;
  }
  // Zeroed parts of the same geometry, to restore into.
  ShardedTrainState blank(int rank, int tp, int fsdp) const {
    ShardedTrainState st = parts(rank, tp, fsdp);
    for (auto& group : st.tensors)
      for (auto& [name, p] : group) p.data = cpu().zeros(p.data.shape(), DType::f32);
    return st;
  }
  // Every part of `st` holds what the whole tensors say it does.
  void expect_parts(const ShardedTrainState& st, const std::string& where) const {
    for (int g = 0; g < 3; ++g)
      for (const auto& [name, p] : st.tensors[g])
        EXPECT_EQ(test::to_vector(p.data),
                  cut(values[g].at(name), p.shape, p.dim, p.parts, p.part, p.begin, p.end))
            << where << ": group " << g << " tensor " << name << " part " << p.part << " ["
            << p.begin << ", " << p.end << ")";
  }
};

// 4 ranks (2 tensor x 2 fsdp) save their parts, each its own files; the checkpoint restores on
// other meshes: whole on one rank, 3 fsdp ranks, 2 tensor x 3 fsdp ranks (the stored split:
// each part read from the pieces that overlap it), 3 tensor ranks (another split: assembled
// whole, then cut). Every element lands where the definition puts it.
TEST_F(Checkpoint, ShardedSaveRestoresOnAnyMesh) {
  const WholeState whole(rng_);
  for (const bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "sync");
    fs::remove_all(dir_);
    on_ranks(4, [&](Communicator& comm) {
      CheckpointManager ckpt(dir_, async, 0, cpu(), &comm);
      ShardedTrainState st = whole.parts(comm.rank(), 2, 2, /*bf16=*/true);
      st.step = 7;
      st.data_state = "data";
      st.config_yaml = "yaml";
      ckpt.save_parts(st);
      ckpt.poll();  // every rank once: publishes when all are done, else returns
      ckpt.wait();
    });
    CheckpointManager reader(dir_, false, 0, cpu());
    ASSERT_EQ(reader.latest_step(), 7);
    // Each rank wrote the pieces no lower rank holds: rank 1 its part of w (b is rank 0's).
    const fs::path step = dir_ / "7";
    for (int r = 0; r < 4; ++r)
      EXPECT_TRUE(fs::exists(step / ("params." + std::to_string(r) + "-of-4.safetensors"))) << r;
    EXPECT_EQ(SafeTensorsFile(step / "params.1-of-4.safetensors").names(),
              std::vector<std::string>{"w"});
    EXPECT_EQ(SafeTensorsFile(step / "params.0-of-4.safetensors").info("w").dtype, "BF16");
    EXPECT_FALSE(fs::exists(step / "params.safetensors"));

    // Whole, as one rank sees it (restore() and the tools).
    TrainState r;
    for (const auto& [name, shape] : whole.shapes) {
      r.params[name] = cpu().zeros(shape, DType::f32);
      r.opt_m[name] = cpu().zeros(shape, DType::f32);
      r.opt_v[name] = cpu().zeros(shape, DType::f32);
    }
    reader.restore(7, r);
    EXPECT_EQ(r.step, 7);
    EXPECT_EQ(r.data_state, "data");
    for (const auto& [name, shape] : whole.shapes) {
      EXPECT_EQ(test::to_vector(r.params[name]), whole.values[0].at(name)) << name;
      EXPECT_EQ(test::to_vector(r.opt_v[name]), whole.values[2].at(name)) << name;
    }
    EXPECT_EQ(test::to_vector(load_checkpoint_tensors(step, "opt_m", cpu()).at("w")),
              whole.values[1].at("w"));
    // Other meshes.
    for (const auto& [tp, fsdp] :
         std::vector<std::pair<int, int>>{{1, 1}, {1, 3}, {2, 3}, {3, 1}, {3, 2}})
      for (int rank = 0; rank < tp * fsdp; ++rank) {
        ShardedTrainState st = whole.blank(rank, tp, fsdp);
        reader.restore_parts(7, st);
        EXPECT_EQ(st.step, 7);
        whole.expect_parts(st, "tp " + std::to_string(tp) + " fsdp " + std::to_string(fsdp) +
                                   " rank " + std::to_string(rank));
      }
  }
}

// A version 1 checkpoint (one rank, whole tensors) restores onto parts too.
TEST_F(Checkpoint, WholeCheckpointRestoresOntoParts) {
  const WholeState whole(rng_);
  TrainState s;
  s.step = 3;
  for (const auto& [name, shape] : whole.shapes) {
    s.params[name] = test::from_vector(cpu(), shape, whole.values[0].at(name));
    s.opt_m[name] = test::from_vector(cpu(), shape, whole.values[1].at(name));
    s.opt_v[name] = test::from_vector(cpu(), shape, whole.values[2].at(name));
  }
  CheckpointManager ckpt(dir_, false, 0, cpu());
  ckpt.save(s);
  for (int rank = 0; rank < 4; ++rank) {
    ShardedTrainState st = whole.blank(rank, 2, 2);
    ckpt.restore_parts(3, st);
    whole.expect_parts(st, "rank " + std::to_string(rank));
  }
  // load_parameters_path's bare file, as parts.
  write_safetensors(root_ / "p.safetensors",
                    {{"w", DType::f32, {4, 6}, whole.values[0].at("w").data()},
                     {"b", DType::f32, {6}, whole.values[0].at("b").data()}});
  ShardedTrainState st = whole.blank(1, 3, 1);
  st.tensors[1].clear();
  st.tensors[2].clear();
  load_parameter_parts(root_ / "p.safetensors", st);
  whole.expect_parts(st, "bare file");
}

// What a sharded checkpoint's reader refuses: a shard whose bytes changed (its checksum), a
// missing shard (the step is incomplete and skipped), pieces that cannot be (hostile
// metadata), and a model that does not match.
TEST_F(Checkpoint, ShardedCheckpointDamageIsDetected) {
  const WholeState whole(rng_);
  auto save = [&](int64_t step) {
    on_ranks(2, [&](Communicator& comm) {
      CheckpointManager ckpt(dir_, false, 0, cpu(), &comm);
      ShardedTrainState st = whole.parts(comm.rank(), 1, 2);
      st.step = step;
      ckpt.save_parts(st);
    });
  };
  save(1);
  save(2);
  CheckpointManager reader(dir_, false, 0, cpu());
  ASSERT_EQ(reader.complete_steps(), (std::vector<int64_t>{1, 2}));
  // A flipped byte in rank 1's moments.
  const fs::path shard = dir_ / "2" / "opt_v.1-of-2.safetensors";
  std::string bytes = read_all(shard);
  bytes[bytes.size() - 3] ^= 0x20;
  write_all(shard, bytes);
  ShardedTrainState st = whole.blank(0, 1, 1);
  try {
    reader.restore_parts(2, st);
    ADD_FAILURE() << "a changed shard was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("opt_v.1-of-2.safetensors' has CRC-32C"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("previous complete checkpoint is step 1"),
              std::string::npos)
        << e.what();
  }
  // A missing shard: step 2 is incomplete, skipped with the reason.
  fs::remove(shard);
  EXPECT_EQ(reader.latest_step(), 1);
  ASSERT_EQ(reader.skipped_newer_steps().size(), 1u);
  EXPECT_NE(reader.skipped_newer_steps()[0].find("opt_v.1-of-2.safetensors"), std::string::npos);
  // Hostile metadata: a split the shape does not divide.
  const fs::path md = dir_ / "1" / "metadata.json";
  const std::string good = read_all(md);
  std::string bad = good;
  const size_t at = bad.find("\"parts\": 1");
  ASSERT_NE(at, std::string::npos);
  bad.replace(at, 10, "\"parts\": 5");
  write_all(md, bad);
  EXPECT_EQ(reader.latest_step(), -1);
  try {
    reader.restore_parts(1, st);
    ADD_FAILURE() << "hostile metadata was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is corrupt"), std::string::npos) << e.what();
  }
  // A model with another shape: refused, nothing written.
  write_all(md, good);
  ShardedTrainState other = whole.blank(0, 1, 1);
  other.tensors[0]["w"].shape = {6, 4};
  try {
    reader.restore_parts(1, other);
    ADD_FAILURE() << "a mismatched model was read";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "tensor 'w' has shape [4, 6] in the checkpoint but [6, 4] in the model"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(test::to_vector(other.tensors[0]["b"].data), std::vector<float>(6, 0.f));
}

// One rank that cannot write (its file past the size limit: EFBIG) fails the save on every
// rank: rank 0 names it, nothing is published, and the earlier checkpoint stays.
TEST_F(Checkpoint, AShardThatCannotBeWrittenFailsTheSaveEverywhere) {
  const WholeState whole(rng_);
  EXPECT_EXIT(
      {
        ::signal(SIGXFSZ, SIG_IGN);
        std::vector<std::string> errors(2);
        auto save = [&](int64_t step, int64_t big) {
          on_ranks(2, [&](Communicator& comm) {
            CheckpointManager ckpt(dir_, true, 0, cpu(), &comm);
            ShardedTrainState st = whole.parts(comm.rank(), 1, 2);
            st.step = step;
            // Rank 1 alone holds "big" (rank 0 an empty part of it).
            TensorPart p{{big}, -1, 1, 0, 0, comm.rank() == 1 ? big : 0, {}};
            p.data = cpu().zeros({p.end}, DType::f32);
            st.tensors[0]["big"] = p;
            try {
              ckpt.save_parts(st);
              ckpt.wait();
            } catch (const Error& e) {
              errors[static_cast<size_t>(comm.rank())] = e.what();
            }
          });
        };
        save(1, 1000);
        rlimit lim;
        lim.rlim_cur = lim.rlim_max = 1 << 20;
        ::setrlimit(RLIMIT_FSIZE, &lim);
        save(2, 1 << 20);  // 4 MiB on rank 1
        std::vector<std::string> names;
        for (const auto& e : fs::directory_iterator(dir_))
          names.push_back(e.path().filename().string());
        const bool named =
            errors[0].find("rank 1 could not write its files") != std::string::npos &&
            errors[1].find("rank 0 names the cause") != std::string::npos;
        const bool clean = names == std::vector<std::string>{"1"};
        std::fprintf(stderr, "named=%d clean=%d [%s] [%s]\n", named, clean, errors[0].c_str(),
                     errors[1].c_str());
        fs::remove_all(root_);
        std::_Exit(named && clean ? 0 : 1);
      },
      ::testing::ExitedWithCode(0),
      "rank 1: rank 1 could not write(.|\n)*File too large(.|\n)*named=1 clean=1");
}

}  // namespace
}  // namespace mt
