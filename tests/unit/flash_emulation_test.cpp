// The CUDA backend's flash attention kernels, compiled as host C++ and run under
// tests/support/cuda_emulation.h (block threads as host threads, mma.sync from the PTX fragment
// layout), against the CPU backend's dot_product reference: forward, backward and decode, the
// tensor-core kernels (bf16, head_dim 64 and 128) and the SIMT ones (f32, any head size), over
// causal, sliding window (skipping whole tiles), soft-cap, GQA/MQA, segment ids and a query
// offset. This checks the kernels' logic on every machine; gpu_ops_test checks them on a device.
#include "cuda_emulation.h"
// The kernels need the emulation's definitions first.
#include "flash_kernels.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mt/attention.h"
#include "mt/backend.h"
#include "test_support.h"

namespace mt {
namespace {

#define SEEDED_RNG(rng)                                              \
  const uint64_t seed_ = test::seed();                               \
  SCOPED_TRACE("seed " + std::to_string(seed_) + " (MT_TEST_SEED)"); \
  std::mt19937_64 rng(seed_)

using bf16 = __nv_bfloat16;

struct Case {
  int64_t hq, hkv;
  bool causal;
  int64_t window;
  float softcap;
  bool segments;
  int64_t offset;
};

int64_t pick(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

std::vector<float> rand_nz(size_t n, std::mt19937_64& rng) {
  std::vector<float> v = test::randn(n, rng);
  for (auto& x : v)
    if (std::fabs(x) < 0.05f) x = x < 0 ? -0.05f : 0.05f;
  return v;
}

// max|got - want| / max|want|; fails on a non-finite value where the reference is finite.
::testing::AssertionResult close(const Tensor& got_t, const Tensor& want_t, double limit,
                                 const char* what) {
  const std::vector<float> got = test::to_vector(got_t), want = test::to_vector(want_t);
  double diff = 0, ref = 0;
  size_t worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i]) && got[i] == want[i]) continue;  // lse of a row that sees no key
    if (!std::isfinite(got[i]))
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << got[i];
    const double d = std::fabs(double(got[i]) - want[i]);
    if (d > diff) diff = d, worst = i;
    ref = std::max(ref, std::fabs(double(want[i])));
  }
  if (diff <= limit * std::max(ref, 1e-30)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": error " << diff / ref << " > " << limit << " (worst at " << worst << ": "
         << got[worst] << " vs " << want[worst] << ")";
}

class FlashEmulation : public ::testing::Test {
 protected:
  Backend& cpu() { return test::cpu(); }
  Tensor poisoned(const Shape& s, DType dt) {
    Tensor t = cpu().empty(s, dt);
    cpu().fill(t, std::numeric_limits<float>::quiet_NaN());
    return t;
  }
  static const bf16* bf(const Tensor& t) { return t.ptr<const bf16>(); }

  // One case: the emulated kernels against dot_product on the CPU. tc: the tensor-core kernels
  // (bf16 storage, D 64 or 128), else the SIMT ones.
  void run(const Case& cs, DType dt, int64_t B, int64_t T, int64_t D, bool tc, double limit,
           std::mt19937_64& rng) {
    SCOPED_TRACE(std::string(tc ? "tensor cores" : "simt") + " B " + std::to_string(B) + " T " +
                 std::to_string(T) + " D " + std::to_string(D) + " hq " + std::to_string(cs.hq) +
                 " hkv " + std::to_string(cs.hkv) + (cs.causal ? " causal" : "") + " window " +
                 std::to_string(cs.window) + " softcap " + std::to_string(cs.softcap) +
                 (cs.segments ? " segments" : "") + " offset " + std::to_string(cs.offset));
    auto ref = test::attention("dot_product", cpu());
    const int64_t S = T + cs.offset;
    const Shape sq{B, T, cs.hq, D}, sk{B, S, cs.hkv, D};
    auto make = [&](const Shape& s) {
      return test::from_vector(cpu(), s, rand_nz(static_cast<size_t>(shape_numel(s)), rng), dt);
    };
    Tensor q = make(sq), k = make(sk), v = make(sk), dout = make(sq);
    Tensor qs, ks;
    if (cs.segments) {
      std::vector<int32_t> a(static_cast<size_t>(B * T)), b(static_cast<size_t>(B * S));
      // Runs of equal ids, as packed documents make, plus a few isolated ones.
      for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<int32_t>(i * 3 / a.size());
      for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<int32_t>(pick(rng, 0, 2));
      qs = test::from_ints(cpu(), {B, T}, a);
      ks = test::from_ints(cpu(), {B, S}, b);
    }
    AttentionSpec spec;
    spec.causal = cs.causal;
    spec.window = cs.window;
    spec.softcap = cs.softcap;
    spec.query_offset = cs.offset;

    cuda::AttnArgs a{};
    a.T = T, a.S = S, a.Hq = cs.hq, a.Hkv = cs.hkv, a.D = D;
    a.causal = cs.causal, a.window = cs.window, a.cap = cs.softcap;
    a.scale = 1.f / std::sqrt(static_cast<float>(D));
    a.offset = cs.offset;
    cuda::Flash f{};
    f.a = a;
    f.B = B;
    f.group = cs.hq / cs.hkv;
    f.q_seg = qs.defined() ? qs.ptr<const int32_t>() : nullptr;
    f.kv_seg = ks.defined() ? ks.ptr<const int32_t>() : nullptr;
    const int64_t rows = B * cs.hq * T;
    auto warps = [](int64_t n) { return dim3{static_cast<unsigned>((n + 3) / 4), 1, 1}; };
    auto tiles = [](int64_t n, int64_t y) {
      return dim3{static_cast<unsigned>((n + 63) / 64), static_cast<unsigned>(y), 1};
    };
    const size_t tile_bytes = static_cast<size_t>(64 * (D + 8)) * sizeof(bf16);

    // forward
    Tensor o = poisoned(sq, dt), lse = poisoned({B, cs.hq, T}, DType::f32);
    Tensor o_ref = poisoned(sq, dt), lse_ref = poisoned({B, cs.hq, T}, DType::f32);
    ref->forward(q, k, v, qs, ks, spec, o_ref, lse_ref);
    if (tc && D == 64)
      emu::launch(tiles(T, B * cs.hq), 128, 3 * tile_bytes, [&] {
        cuda::tc_fwd_kernel<64>(bf(q), bf(k), bf(v), f, cuda::out(o), lse.ptr<float>());
      });
    else if (tc)
      emu::launch(tiles(T, B * cs.hq), 128, 3 * tile_bytes, [&] {
        cuda::tc_fwd_kernel<128>(bf(q), bf(k), bf(v), f, cuda::out(o), lse.ptr<float>());
      });
    else
      emu::launch(warps(rows), 128, 0, [&] {
        cuda::simt_fwd_kernel(cuda::in(q), cuda::in(k), cuda::in(v), f, cuda::out(o),
                              lse.ptr<float>());
      });
    EXPECT_TRUE(close(o, o_ref, limit, "out"));
    EXPECT_TRUE(close(lse, lse_ref, tc ? 1e-4 : 1e-5, "lse"));

    // backward, from the reference's forward, into zeroed gradients
    Tensor dq = cpu().zeros(sq, DType::f32), dk = cpu().zeros(sk, DType::f32),
           dv = cpu().zeros(sk, DType::f32);
    Tensor dq_ref = cpu().zeros(sq, DType::f32), dk_ref = cpu().zeros(sk, DType::f32),
           dv_ref = cpu().zeros(sk, DType::f32);
    ref->backward(dout, q, k, v, qs, ks, o_ref, lse_ref, spec, dq_ref, dk_ref, dv_ref);
    Tensor delta = poisoned({B, cs.hq, T}, DType::f32);
    emu::launch(warps(rows), 128, 0, [&] {
      cuda::delta_kernel(cuda::in(dout), cuda::in(o_ref), f, delta.ptr<float>());
    });
    const float* ls = lse_ref.ptr<const float>();
    const float* dl = delta.ptr<const float>();
    if (tc) {
      const size_t dkv_bytes = 4 * tile_bytes + 2 * 64 * sizeof(float);
      emu::launch(tiles(T, B * cs.hq), 128, 4 * tile_bytes, [&] {
        if (D == 64)
          cuda::tc_dq_kernel<64>(bf(q), bf(k), bf(v), bf(dout), f, ls, dl, cuda::out(dq));
        else
          cuda::tc_dq_kernel<128>(bf(q), bf(k), bf(v), bf(dout), f, ls, dl, cuda::out(dq));
      });
      emu::launch(tiles(S, B * cs.hkv), 128, dkv_bytes, [&] {
        if (D == 64)
          cuda::tc_dkv_kernel<64>(bf(q), bf(k), bf(v), bf(dout), f, ls, dl, cuda::out(dk),
                                  cuda::out(dv));
        else
          cuda::tc_dkv_kernel<128>(bf(q), bf(k), bf(v), bf(dout), f, ls, dl, cuda::out(dk),
                                   cuda::out(dv));
      });
    } else {
      emu::launch(warps(rows), 128, 0, [&] {
        cuda::simt_dq_kernel(cuda::in(q), cuda::in(k), cuda::in(v), cuda::in(dout), f, ls, dl,
                             cuda::out(dq));
      });
      emu::launch(warps(B * S * cs.hkv), 128, 0, [&] {
        cuda::simt_dkv_kernel(cuda::in(q), cuda::in(k), cuda::in(v), cuda::in(dout), f, ls, dl,
                              cuda::out(dk), cuda::out(dv));
      });
    }
    EXPECT_TRUE(close(dq, dq_ref, limit, "dq"));
    EXPECT_TRUE(close(dk, dk_ref, limit, "dk"));
    EXPECT_TRUE(close(dv, dv_ref, limit, "dv"));

    // decode (SIMT) over a longer cache of which lengths[b] rows are valid
    if (cs.segments) return;
    const int64_t smax = S + 5;
    const Shape sc{B, smax, cs.hkv, D};
    Tensor kc = make(sc), vc = make(sc);
    std::vector<int32_t> len(static_cast<size_t>(B));
    for (auto& l : len) l = static_cast<int32_t>(pick(rng, T, smax));
    Tensor lengths = test::from_ints(cpu(), {B}, len);
    Tensor od = poisoned(sq, dt), od_ref = poisoned(sq, dt);
    ref->decode(q, kc, vc, lengths, spec, od_ref);
    cuda::AttnArgs ad = a;
    ad.S = smax;
    cuda::Flash fd = f;
    fd.a = ad;
    fd.q_seg = fd.kv_seg = nullptr;
    fd.lengths = lengths.ptr<const int32_t>();
    emu::launch(warps(rows), 128, 0, [&] {
      cuda::simt_fwd_kernel(cuda::in(q), cuda::in(kc), cuda::in(vc), fd, cuda::out(od), nullptr);
    });
    EXPECT_TRUE(close(od, od_ref, tc ? 1e-2 : limit, "decode"));
  }
};

const Case kCases[] = {{4, 2, true, 0, 0.f, false, 0},  {4, 1, true, 0, 0.f, false, 5},
                       {2, 2, false, 0, 0.f, false, 0}, {4, 2, true, 70, 0.f, false, 9},
                       {2, 1, true, 0, 15.f, true, 0},  {2, 2, false, 40, 8.f, true, 3}};

// bf16 with head_dim 64 and 128: the tensor-core kernels on several 64-row tiles with a partial
// last tile. P and dS are rounded to bf16 before their products: 2e-2 of the largest value.
TEST_F(FlashEmulation, TensorCoreKernels) {
  SEEDED_RNG(rng);
  for (const Case& cs : kCases) run(cs, DType::bf16, 1, pick(rng, 65, 130), 64, true, 2e-2, rng);
  run(kCases[4], DType::bf16, 2, 70, 128, true, 2e-2, rng);
}

// f32 (and any head size): the SIMT kernels, f32 arithmetic as the reference's.
TEST_F(FlashEmulation, SimtKernels) {
  SEEDED_RNG(rng);
  for (const Case& cs : kCases)
    run(cs, DType::f32, pick(rng, 1, 2), pick(rng, 1, 24), pick(rng, 1, 40), false, 1e-5, rng);
  run(kCases[3], DType::f32, 1, 80, 40, false, 1e-5, rng);  // the window skips keys
}

}  // namespace
}  // namespace mt
