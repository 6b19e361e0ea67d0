#include "safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "mt/error.h"
#include "test_support.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed afterwards.
class SafeTensors : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("mt_safetensors_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path file(const std::string& name) const { return dir_ / name; }

  // Writes raw bytes: an 8-byte length, the header text, then `data`.
  fs::path raw(const std::string& name, const std::string& header, const std::string& data,
               uint64_t len_override = UINT64_MAX) {
    fs::path p = file(name);
    std::ofstream f(p, std::ios::binary);
    uint64_t n = len_override == UINT64_MAX ? header.size() : len_override;
    unsigned char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
    f.write(reinterpret_cast<const char*>(len), 8);
    f << header << data;
    return p;
  }

  fs::path dir_;
};

std::string read_all(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void write_all(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << s;
}

// Expects opening `p` to throw mt::Error whose message names the file and contains `needle`.
void expect_open_error(const fs::path& p, const std::string& needle) {
  try {
    SafeTensorsFile f(p);
    ADD_FAILURE() << "opening " << p << " did not throw; expected '" << needle << "'";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find(needle), std::string::npos) << "expected '" << needle << "' in: " << msg;
  }
}

TEST_F(SafeTensors, RoundTripDtypesShapesAndMetadata) {
  std::vector<float> f32 = {1.5f, -2.f, 3.25f, 0.f, 1e-8f, -1e30f};
  std::vector<uint16_t> bf = {f32_to_bf16(1.f), f32_to_bf16(-0.5f), f32_to_bf16(3.f)};
  std::vector<uint16_t> f16 = {0x3C00, 0xC000, 0x0001, 0x7BFF};  // 1, -2, smallest, 65504
  std::vector<int32_t> i32 = {1, -2, 2147483647, -2147483647 - 1};
  std::vector<int64_t> i64 = {int64_t{1} << 40, -7};
  std::vector<uint8_t> u8 = {0, 255, 7};
  float scalar = 42.f;
  std::vector<SafeTensorsEntry> in = {
      {"a.f32", DType::f32, {2, 3}, f32.data()},
      {"b.bf16", DType::bf16, {3}, bf.data()},
      {"c.f16", DType::f16, {2, 1, 2}, f16.data()},
      {"d.i32", DType::i32, {4}, i32.data()},
      {"e.i64", DType::i64, {1, 2}, i64.data()},
      {"f.u8", DType::u8, {3}, u8.data()},
      {"scalar", DType::f32, {}, &scalar},
      {"empty", DType::f32, {0, 5}, nullptr},
      {"weird \"name\"\n\xc3\xa9", DType::u8, {1}, u8.data()},
  };
  std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "12"}, {"quote", "a\"b"}};
  fs::path p = file("x.safetensors");
  write_safetensors(p, in, meta);
  EXPECT_FALSE(fs::exists(p.string() + ".tmp"));

  // The header is padded to 8 bytes and every tensor is aligned to its element size.
  std::string bytes = read_all(p);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);

  SafeTensorsFile f(p);
  EXPECT_EQ(f.size(), in.size());
  EXPECT_EQ(f.metadata(), meta);
  for (const auto& e : in) {
    ASSERT_TRUE(f.contains(e.name)) << e.name;
    const SafeTensorInfo& info = f.info(e.name);
    EXPECT_EQ(info.dtype, e.dtype);
    EXPECT_EQ(info.shape, e.shape);
    size_t nb = static_cast<size_t>(shape_numel(e.shape)) * safetensors_dtype_size(e.dtype);
    ASSERT_EQ(info.nbytes(), nb) << e.name;
    if (nb) {
      EXPECT_EQ(std::memcmp(info.data, e.data, nb), 0) << e.name;
    }
    EXPECT_EQ((8 + n + info.begin) % safetensors_dtype_size(e.dtype), 0u) << e.name;
  }
  EXPECT_EQ(f.info("scalar").numel(), 1);
  EXPECT_EQ(f.info("empty").numel(), 0);
  EXPECT_FALSE(f.contains("nope"));

  // Moving keeps the mapping valid.
  SafeTensorsFile g = std::move(f);
  EXPECT_EQ(std::memcmp(g.info("a.f32").data, f32.data(), 24), 0);
}

TEST_F(SafeTensors, WriteIsAtomicAndRefusesBadEntries) {
  fs::path p = file("y.safetensors");
  float v = 1.f;
  write_safetensors(p, {{"a", DType::f32, {1}, &v}});
  std::string before = read_all(p);
  // A duplicate name is refused before anything is written; the old file stays as it was.
  EXPECT_THROW(write_safetensors(p, {{"a", DType::f32, {1}, &v}, {"a", DType::f32, {1}, &v}}),
               Error);
  EXPECT_THROW(write_safetensors(p, {{"__metadata__", DType::f32, {1}, &v}}), Error);
  EXPECT_THROW(write_safetensors(p, {{"b", std::string("F7"), {1}, &v}}), Error);
  EXPECT_THROW(write_safetensors(p, {{"b", DType::f32, {-1}, &v}}), Error);
  EXPECT_EQ(read_all(p), before);
  EXPECT_FALSE(fs::exists(p.string() + ".tmp"));
  // An unwritable destination names the file.
  try {
    write_safetensors(dir_ / "no_such_dir" / "z.safetensors", {{"a", DType::f32, {1}, &v}});
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("z.safetensors"), std::string::npos) << e.what();
  }
}

TEST_F(SafeTensors, LoadTensorConverts) {
  Backend& b = test::cpu();
  std::vector<float> vals = {1.f, -2.5f, 0.1f, 65504.f, 1e-7f, -0.f};
  std::vector<uint16_t> bf(vals.size());
  for (size_t i = 0; i < vals.size(); ++i) bf[i] = f32_to_bf16(vals[i]);
  std::vector<double> f64(vals.begin(), vals.end());
  std::vector<int64_t> ids = {0, 5, 255, -3};
  std::vector<int64_t> big = {int64_t{1} << 40};
  fs::path p = file("c.safetensors");
  write_safetensors(p, {{"f32", DType::f32, {2, 3}, vals.data()},
                        {"bf16", DType::bf16, {2, 3}, bf.data()},
                        {"f64", std::string("F64"), {2, 3}, f64.data()},
                        {"ids", DType::i64, {4}, ids.data()},
                        {"big", DType::i64, {1}, big.data()},
                        {"scalar", DType::f32, {}, vals.data()},
                        {"empty", DType::f32, {0}, nullptr}});
  SafeTensorsFile f(p);

  Tensor t = load_tensor(f, "f32", b, DType::f32, {2, 3});
  EXPECT_EQ(t.shape(), (Shape{2, 3}));
  EXPECT_EQ(test::to_vector(t), vals);
  // f32 -> bf16 rounds as f32_to_bf16 does.
  Tensor tb = load_tensor(f, "f32", b, DType::bf16);
  EXPECT_EQ(tb.dtype(), DType::bf16);
  std::vector<uint16_t> got(vals.size());
  b.copy_to_host(tb, got.data());
  EXPECT_EQ(got, bf);
  // bf16 -> f32 is exact.
  auto up = test::to_vector(load_tensor(f, "bf16", b, DType::f32));
  for (size_t i = 0; i < vals.size(); ++i) EXPECT_EQ(up[i], bf16_to_f32(bf[i]));
  // f64 -> f32 and f32 -> f16 -> (via f64 file) back.
  EXPECT_EQ(test::to_vector(load_tensor(f, "f64", b, DType::f32)), vals);
  Tensor h = load_tensor(f, "f32", b, DType::f16);
  std::vector<uint16_t> hb(vals.size());
  b.copy_to_host(h, hb.data());
  EXPECT_EQ(hb[0], 0x3C00);  // 1
  EXPECT_EQ(hb[1], 0xC100);  // -2.5
  EXPECT_EQ(hb[3], 0x7BFF);  // 65504, the largest half
  EXPECT_EQ(hb[4], 0x0002);  // 1e-7 rounds to 2 * 2^-24
  EXPECT_EQ(hb[5], 0x8000);  // -0
  // i64 -> i32 when every value fits; refused otherwise.
  EXPECT_EQ(test::to_ints(load_tensor(f, "ids", b, DType::i32)),
            (std::vector<int32_t>{0, 5, 255, -3}));
  EXPECT_THROW(load_tensor(f, "big", b, DType::i32), Error);
  EXPECT_THROW(load_tensor(f, "ids", b, DType::u8), Error);  // -3
  EXPECT_THROW(load_tensor(f, "ids", b, DType::f32), Error);
  EXPECT_THROW(load_tensor(f, "f32", b, DType::i32), Error);
  // Scalars, empty tensors, shape checks and missing names.
  Tensor s = load_tensor(f, "scalar", b, DType::f32);
  EXPECT_EQ(s.ndim(), 0);
  EXPECT_EQ(test::to_vector(s), std::vector<float>{1.f});
  EXPECT_EQ(load_tensor(f, "empty", b, DType::bf16).numel(), 0);
  try {
    load_tensor(f, "f32", b, DType::f32, {3, 2});
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("'f32'"), std::string::npos) << m;
    EXPECT_NE(m.find("[2, 3]"), std::string::npos) << m;
    EXPECT_NE(m.find("[3, 2]"), std::string::npos) << m;
  }
  try {
    load_tensor(f, "missing", b, DType::f32);
    ADD_FAILURE() << "no throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'missing'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
  }
  Tensor dst = b.empty({2, 3}, DType::bf16);
  load_into(f, "f64", dst);
  std::vector<uint16_t> d16(6);
  b.copy_to_host(dst, d16.data());
  EXPECT_EQ(d16, bf);
  Tensor wrong = b.empty({6}, DType::f32);
  EXPECT_THROW(load_into(f, "f32", wrong), Error);
}

// Resident kilobytes of this process's mapping of `path` (/proc/self/smaps), -1 when unmapped.
long mapped_rss_kb(const fs::path& path) {
  std::ifstream smaps("/proc/self/smaps");
  long rss = -1;
  bool in = false;
  for (std::string line; std::getline(smaps, line);) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) &&
        line.find('-') != std::string::npos && line.find(' ') != std::string::npos) {
      in = line.size() >= path.string().size() &&
           line.compare(line.size() - path.string().size(), std::string::npos, path.string()) == 0;
    } else if (in && line.rfind("Rss:", 0) == 0) {
      rss = std::max(rss, 0L) + std::stol(line.substr(4));
    }
  }
  return rss;
}

// A loader drops a tensor's mapped pages once it has copied them (read_f32, load_into): a model's
// files do not add up in the process's resident memory while it loads (mt decode of a 3.6 GiB
// directory peaked at 7.2 GiB resident, 5.0 GiB after). The values stay readable.
TEST_F(SafeTensors, ReadTensorsLeaveNoMappedPagesResident) {
  Backend& b = test::cpu();
  const int64_t n = 1 << 20;  // 4 MiB a tensor
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = static_cast<float>(i % 256);  // exact in bf16
  fs::path p = file("big.safetensors");
  save_tensors(p, {{"a", test::from_vector(b, {n}, v)}, {"b", test::from_vector(b, {n}, v)}}, {});
  SafeTensorsFile f(p);
  if (mapped_rss_kb(p) < 0) GTEST_SKIP() << "/proc/self/smaps does not show the mapping";
  EXPECT_EQ(read_f32(f, "a"), v);
  Tensor t = b.empty({n}, DType::bf16);
  load_into(f, "b", t);
  EXPECT_EQ(test::to_vector(t), v);
  // The header's page and the tensors' boundary pages at most (a page each), not 8 MiB.
  EXPECT_LT(mapped_rss_kb(p), 64) << "kB of the file still mapped in";
  EXPECT_EQ(read_f32(f, "a"), v);  // read again after: mapped in again
}

TEST_F(SafeTensors, SaveTensorsFromBackend) {
  Backend& b = test::cpu();
  Tensor a = test::from_vector(b, {2, 2}, {1, 2, 3, 4});
  Tensor c = test::from_vector(b, {3}, {5, 6, 7}, DType::bf16);
  Tensor ids = test::from_ints(b, {2}, {9, -1});
  fs::path p = file("s.safetensors");
  save_tensors(p, {{"a", a}, {"c", c}, {"ids", ids}}, {{"k", "v"}});
  SafeTensorsFile f(p);
  EXPECT_EQ(f.info("c").dtype, "BF16");
  EXPECT_EQ(test::to_vector(load_tensor(f, "a", b, DType::f32)), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(test::to_vector(load_tensor(f, "c", b, DType::f32)), (std::vector<float>{5, 6, 7}));
  EXPECT_EQ(test::to_ints(load_tensor(f, "ids", b, DType::i32)), (std::vector<int32_t>{9, -1}));
  EXPECT_EQ(f.metadata().at("k"), "v");
}

TEST_F(SafeTensors, TruncatedFiles) {
  float v[4] = {1, 2, 3, 4};
  fs::path good = file("good.safetensors");
  write_safetensors(good, {{"w", DType::f32, {4}, v}});
  std::string bytes = read_all(good);

  write_all(file("empty.safetensors"), "");
  expect_open_error(file("empty.safetensors"), "truncated");
  write_all(file("five.safetensors"), bytes.substr(0, 5));
  expect_open_error(file("five.safetensors"), "truncated");
  // Cut inside the header: the stated length runs past the end of the file.
  write_all(file("header.safetensors"), bytes.substr(0, 20));
  expect_open_error(file("header.safetensors"), "exceeds the file size");
  // Cut inside the data: the tensor's offsets run past the data section.
  write_all(file("data.safetensors"), bytes.substr(0, bytes.size() - 3));
  expect_open_error(file("data.safetensors"), "beyond the data section");
  expect_open_error(file("does_not_exist.safetensors"), "cannot open");
}

TEST_F(SafeTensors, HeaderLengthTooLarge) {
  std::string h = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  expect_open_error(raw("len.safetensors", h, "abcd", 1000), "exceeds the file size");
  expect_open_error(raw("huge.safetensors", h, "abcd", uint64_t{1} << 63), "exceeds the file size");
}

TEST_F(SafeTensors, BadJson) {
  const std::string data = "abcd";
  struct Case {
    const char* header;
    const char* needle;
  };
  const Case cases[] = {
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})", "malformed JSON"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}x)", "malformed JSON"},
      {R"({"w":{"dtype":"F32","shape":[1,],"data_offsets":[0,4]}})", "malformed JSON"},
      {R"({"w":{"dtype":"F32" "shape":[1],"data_offsets":[0,4]}})", "malformed JSON"},
      {R"({"w":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}})", "malformed JSON"},
      {R"({"w":{"dtype":"F32\q","shape":[1],"data_offsets":[0,4]}})", "malformed JSON"},
      {R"({w:{}})", "malformed JSON"},
      {R"([1,2])", "not a JSON object"},
      {R"({"w":{"dtype":"F32","shape":[1]}})", "missing field 'data_offsets'"},
      {R"({"w":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}})", "unknown dtype 'F33'"},
      {R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "non-negative integer"},
      {R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", "non-negative integer"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", "two integers"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", "end before they begin"},
      {R"({"w":[]})", "not an object"},
      {R"({"__metadata__":{"a":1},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       "not a string"},
      {R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
       "appears twice"},
  };
  int i = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(c.header);
    expect_open_error(raw("bad" + std::to_string(i++) + ".safetensors", c.header, data), c.needle);
  }
  // Unicode escapes decode to UTF-8; unknown fields inside an entry are tolerated.
  SafeTensorsFile ok(raw(
      "ok.safetensors",
      R"({"\u00e9\ud83d\ude00":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":null}})", data));
  EXPECT_TRUE(ok.contains("\xc3\xa9\xf0\x9f\x98\x80"));
}

TEST_F(SafeTensors, OffsetsOutOfRangeOverlappingOrMismatched) {
  expect_open_error(
      raw("range.safetensors", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "abcd"),
      "beyond the data section");
  expect_open_error(
      raw("overlap.safetensors",
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          std::string(12, 'x')),
      "overlap");
  expect_open_error(
      raw("gap.safetensors",
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
          std::string(12, 'x')),
      "belong to no tensor");
  expect_open_error(raw("trailing.safetensors",
                        R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "abcdef"),
                    "bytes after the last tensor");
  expect_open_error(
      raw("size.safetensors", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", "abcd"),
      "needs 8");
  expect_open_error(
      raw("bf.safetensors", R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,4]}})", "abcd"),
      "'w'");
  expect_open_error(
      raw("overflow.safetensors",
          R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", "abcd"),
      "too large");
}

// A file written by Python's safetensors library (tools/make_llama_golden.py).
TEST_F(SafeTensors, ReadsFilesFromPythonLibrary) {
  fs::path p = fs::path(test::source_dir()) / "tests/golden/llama_gqa.safetensors";
  if (!fs::exists(p)) GTEST_SKIP() << "golden file missing: " << p;
  SafeTensorsFile f(p);
  EXPECT_EQ(f.info("input_ids").dtype, "I32");
  EXPECT_EQ(f.info("input_ids").shape, (Shape{2, 16}));
  EXPECT_EQ(f.info("logits").shape, (Shape{2, 16, 256}));
  EXPECT_EQ(f.info("model.embed_tokens.weight").shape, (Shape{256, 64}));
  EXPECT_EQ(f.info("model.layers.0.self_attn.k_proj.weight").shape, (Shape{32, 64}));
  EXPECT_TRUE(f.contains("grad.model.layers.1.mlp.down_proj.weight"));
  EXPECT_TRUE(f.contains("lm_head.weight"));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  Backend& b = test::cpu();
  auto ids = test::to_ints(load_tensor(f, "input_ids", b, DType::i32));
  for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 256) << id;
  auto logits = test::to_vector(load_tensor(f, "logits", b, DType::f32));
  for (float x : logits) ASSERT_TRUE(std::isfinite(x));

  // Writing what we read gives a file the reader accepts with identical tensors.
  std::vector<SafeTensorsEntry> entries;
  for (const auto& name : f.names()) {
    const auto& info = f.info(name);
    entries.emplace_back(name, info.dtype, info.shape, info.data);
  }
  fs::path q = file("copy.safetensors");
  write_safetensors(q, entries, f.metadata());
  SafeTensorsFile g(q);
  ASSERT_EQ(g.names(), f.names());
  for (const auto& name : f.names()) {
    const auto& a = f.info(name);
    const auto& c = g.info(name);
    EXPECT_EQ(a.shape, c.shape);
    ASSERT_EQ(a.nbytes(), c.nbytes());
    EXPECT_EQ(std::memcmp(a.data, c.data, a.nbytes()), 0) << name;
  }
}

}  // namespace
}  // namespace mt
