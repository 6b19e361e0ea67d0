#include "test_support.h"

#include <cpuid.h>
#include <sys/wait.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "config_impl.h"
#include "config_loader.h"
#include "mt/error.h"
#include "mt/model.h"

namespace mt::test {

const char* cpu_backend_name() {
  const char* e = std::getenv("MT_TEST_CPU_BACKEND");
  return e && *e ? e : "cpu";
}

PluginManager& plugins() {
  // cpu_x86emu is built beside the tests, never installed: its directory is added here, so the
  // X86Emu.* tests need one environment variable (CTest's ENVIRONMENT property is a CMake list,
  // and gtest_discover_tests splits a second entry off it unseen).
  static PluginManager pm(
      std::string(cpu_backend_name()) == "cpu_x86emu"
          ? std::vector<std::filesystem::path>{std::filesystem::path(MT_BUILD_DIR) / "tests" /
                                               "x86emu"}
          : std::vector<std::filesystem::path>{});
  return pm;
}

bool cpu_supports(const std::string& feature) {
  if (std::string(cpu_backend_name()) == "cpu_x86emu")  // kernels/x86_simd.h's emulated CPU
    return feature != "amx-bf16" && feature != "amx-tile" && feature != "amx-int8";
  __builtin_cpu_init();
  if (feature == "avx2") return __builtin_cpu_supports("avx2");
  if (feature == "fma") return __builtin_cpu_supports("fma");
  if (feature == "avx512f") return __builtin_cpu_supports("avx512f");
  if (feature == "avx512bw") return __builtin_cpu_supports("avx512bw");
  if (feature == "avx512dq") return __builtin_cpu_supports("avx512dq");
  if (feature == "avx512vl") return __builtin_cpu_supports("avx512vl");
  if (feature == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
  if (feature == "avx512vnni") return __builtin_cpu_supports("avx512vnni");
  // CPUID leaf 7, EDX bits 22, 24 and 25: clang before 15 has no such __builtin_cpu_supports
  // names.
  if (feature == "amx-bf16" || feature == "amx-tile" || feature == "amx-int8") {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return ((d >> (feature == "amx-bf16" ? 22 : feature == "amx-tile" ? 24 : 25)) & 1u) != 0;
  }
  if (feature == "amd") return __builtin_cpu_is("amd");
  throw std::invalid_argument("cpu_supports: no check for '" + feature + "'");
}

Backend& cpu(int threads) {
  static std::unique_ptr<Backend> b = plugins().make_backend(
      cpu_backend_name(), config_from_pairs({{"num_threads", std::to_string(threads)}}));
  return *b;
}

std::unique_ptr<AttentionKernel> attention(const std::string& name, Backend& b) {
  return plugins().make_attention(b.name(), name, b);
}

DevicePlugins device_plugins(const std::vector<std::pair<std::string, std::string>>& required,
                             const std::string& file, const std::string& not_built) {
  DevicePlugins s;
  try {
    for (const auto& [kind, name] : required) plugins().require(kind, name);
  } catch (const std::exception& e) {
    bool built = false;
    for (const auto& dir : plugins().search_dirs()) {
      std::error_code ec;
      built = built || std::filesystem::exists(dir / file, ec);
    }
    const std::string why = e.what();
    if (!built)
      s.skip = "the " + file + " plugin was not built (" + not_built + "): " + why;
    else if (why.find("declined to run on this machine") != std::string::npos)
      s.skip = "no CUDA device: " + why;
    else
      s.error = why;
  }
  return s;
}

Tensor from_vector(Backend& b, const Shape& shape, const std::vector<float>& v, DType dt) {
  MT_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape), "from_vector: size mismatch");
  Tensor f = b.empty(shape, DType::f32);
  b.copy_from_host(f, v.data());
  if (dt == DType::f32) return f;
  Tensor t = b.empty(shape, dt);
  b.cast(f, t);
  return t;
}

Tensor from_ints(Backend& b, const Shape& shape, const std::vector<int32_t>& v) {
  MT_CHECK(static_cast<int64_t>(v.size()) == shape_numel(shape), "from_ints: size mismatch");
  Tensor t = b.empty(shape, DType::i32);
  b.copy_from_host(t, v.data());
  return t;
}

std::vector<float> to_vector(const Tensor& t) {
  Backend& b = *t.backend();
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::f32) {
    b.copy_to_host(t, out.data());
  } else {
    Tensor f = b.empty(t.shape(), DType::f32);
    b.cast(t, f);
    b.copy_to_host(f, out.data());
  }
  return out;
}

std::vector<int32_t> to_ints(const Tensor& t) {
  std::vector<int32_t> out(static_cast<size_t>(t.numel()));
  t.backend()->copy_to_host(t, out.data());
  return out;
}

uint64_t seed() {
  if (const char* s = std::getenv("MT_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return std::random_device{}();
}

std::vector<float> randn(size_t n, std::mt19937_64& rng, float stddev) {
  std::normal_distribution<float> d(0.f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double max_rel_err(const std::vector<float>& a, const std::vector<float>& b, double floor) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    const double r = d / std::max(std::fabs(double(b[i])), floor);
    if (std::isnan(r)) return INFINITY;
    m = std::max(m, r);
  }
  return m;
}

std::string source_dir() {
  return MT_SOURCE_DIR;
}
std::string build_dir() {
  return MT_BUILD_DIR;
}
std::string mt_exe() {
  return build_dir() + "/bin/mt";
}

int run_command(const std::string& cmd, std::string& output) {
  output.clear();
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) output.append(buf.data(), n);
  int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

MtResult run_mt(const std::string& args, int seconds, const std::string& env) {
  MtResult r;
  const std::string limit = seconds > 0 ? "timeout -k 10 " + std::to_string(seconds) + " " : "";
  r.code = run_command("MT_PLUGIN_PATH= " + env + " " + limit + mt_exe() + " " + args, r.out);
  return r;
}

std::map<int64_t, double> losses_by_step(const std::string& run_dir) {
  std::ifstream f(run_dir + "/metrics.jsonl");
  std::map<int64_t, double> r;
  std::string line;
  while (std::getline(f, line)) {
    const size_t s = line.find("\"step\": "), k = line.find("\"loss\": ");
    if (s != std::string::npos && k != std::string::npos)
      r[std::stoll(line.substr(s + 8))] = std::stod(line.substr(k + 8));
  }
  return r;
}

double scaled_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, std::fabs(double(a[i]) - double(b[i])));
    den = std::max(den, std::fabs(double(b[i])));
  }
  return den > 0 ? num / den : num;
}

double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(double(x)));
  return m;
}

Config model_config(const std::string& model, const std::vector<std::string>& overrides) {
  ConfigRequest req;
  req.configs_dir = source_dir() + "/configs";
  req.model = model;
  req.overrides = overrides;
  req.schemas_for = family_schemas;
  return load_config(req);
}

std::vector<SchemaText> family_schemas(const Config& layers) {
  const std::string fam = layers.get_string("decoder_block");
  return {{"model family '" + fam + "'", plugins().make_model_family(fam)->config_schema()}};
}

}  // namespace mt::test
