// Shared helpers of the test suite: the plugins of this build tree, tensors from vectors, and
// comparisons with useful failure messages.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "config_loader.h"
#include "mt/attention.h"
#include "mt/backend.h"
#include "plugin_manager.h"
#include "required_only_backend.h"

namespace mt::test {

// The plugin manager of this test process; searches the build tree's plugin directory
// (MT_PLUGIN_PATH is cleared by CTest), and build/tests/x86emu where cpu_backend_name() is
// cpu_x86emu.
PluginManager& plugins();
// The CPU backend, made once per process with `threads` threads (0 = all cores).
Backend& cpu(int threads = 0);
// The CPU backend the tests run on: "cpu", or the one MT_TEST_CPU_BACKEND names (cpu_x86emu: the
// same kernels with emulated AVX-512, plugins/backends/cpu/kernels/x86_simd.h).
const char* cpu_backend_name();
// Whether that backend's CPU has an x86 feature (GCC's names: "avx2", "avx512bf16", ...; "amd"
// for the vendor): the real CPU's answer, or the emulated one's (everything but AMX, and AMD).
bool cpu_supports(const std::string& feature);
std::unique_ptr<AttentionKernel> attention(const std::string& name, Backend& b);

// Whether the plugins a device test needs run here: each {kind, name} is required in turn. `skip`
// says why not when that is the machine's doing (the library `file` was not built, `not_built`
// saying what the build lacks; or a plugin declined: no driver or no device), `error` why loading
// failed otherwise (a test failure). Both empty: they run.
struct DevicePlugins {
  std::string skip, error;
};
DevicePlugins device_plugins(const std::vector<std::pair<std::string, std::string>>& required,
                             const std::string& file, const std::string& not_built);

using mt::RequiredOnlyBackend;  // core/src/required_only_backend.h

Tensor from_vector(Backend& b, const Shape& shape, const std::vector<float>& v,
                   DType dt = DType::f32);
Tensor from_ints(Backend& b, const Shape& shape, const std::vector<int32_t>& v);
std::vector<float> to_vector(const Tensor& t);  // any float dtype -> f32
std::vector<int32_t> to_ints(const Tensor& t);

// Fresh random draws every run unless MT_TEST_SEED is set; the seed is printed on failure
// through SCOPED_TRACE by the caller (seed()).
uint64_t seed();
std::vector<float> randn(size_t n, std::mt19937_64& rng, float stddev = 1.f);

// A std::mt19937_64 named `rng` seeded by seed(), the seed shown with any failure of the scope.
#define MT_SEEDED_RNG(rng)                                           \
  const uint64_t seed_ = ::mt::test::seed();                         \
  SCOPED_TRACE("seed " + std::to_string(seed_) + " (MT_TEST_SEED)"); \
  std::mt19937_64 rng(seed_)

// max_i |a - b| / max_i |b|: the error relative to the scale of the whole tensor.
double scaled_err(const std::vector<float>& a, const std::vector<float>& b);

// max_i |v|.
double max_abs(const std::vector<float>& v);

// Max over i of |a - b| / max(|b|, floor): relative error with a floor for values near zero.
double max_rel_err(const std::vector<float>& a, const std::vector<float>& b, double floor = 1e-3);

// Paths
std::string source_dir();
std::string build_dir();
std::string mt_exe();  // build/bin/mt

// Runs a command, captures stdout+stderr; returns the exit code.
int run_command(const std::string& cmd, std::string& output);

// `mt <args>` of this build (MT_PLUGIN_PATH cleared), stdout and stderr together. A positive
// `seconds` bounds it with timeout(1): a hang fails with exit code 124 instead of stalling the
// suite (SIGTERM, then SIGKILL 10 s later, since mt run answers SIGTERM by finishing its step).
// `env`: "NAME=value ..." added to mt's environment.
struct MtResult {
  int code = -1;
  std::string out;
};
MtResult run_mt(const std::string& args, int seconds = 0, const std::string& env = "");

// step -> loss of a run directory's metrics.jsonl, the last line of each step winning (a run
// stopped or killed after its last checkpoint logged steps that its restart logs again).
std::map<int64_t, double> losses_by_step(const std::string& run_dir);

// The resolved config of configs/models/<model>.yml with `overrides` ("key=value"), as mt run
// loads it (the family's own keys included).
Config model_config(const std::string& model, const std::vector<std::string>& overrides);
// ConfigRequest::schemas_for of a config naming any model family: the schema of the family its
// decoder_block names (from plugins()), so that family's own keys are known.
std::vector<SchemaText> family_schemas(const Config& layers);

}  // namespace mt::test
