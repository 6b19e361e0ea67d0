// Flash attention for the CUDA backend: the launchers, which check the arguments and pick the
// tensor-core or SIMT kernels of flash_kernels.cuh (see flash.h).
#ifndef MT_CUDA_EMULATION
#include <cuda_bf16.h>
#endif

#include <climits>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "attention_args.h"
#include "device_io.cuh"
#include "flash.h"
#include "flash_kernels.cuh"
#include "kernels.h"
#include "mt/error.h"

namespace mt::cuda {
namespace {

// ---- host side ----------------------------------------------------------------------------

Flash make_flash(const AttnArgs& a, int64_t B, const Tensor& q_seg, const Tensor& kv_seg,
                 const int32_t* lengths) {
  Flash f{};
  f.a = a;
  f.B = B;
  f.group = a.Hq / a.Hkv;
  f.q_seg = q_seg.defined() ? q_seg.ptr<const int32_t>() : nullptr;
  f.kv_seg = kv_seg.defined() ? kv_seg.ptr<const int32_t>() : nullptr;
  f.lengths = lengths;
  return f;
}

unsigned warp_blocks(int64_t rows) {
  return static_cast<unsigned>((rows + kWarps - 1) / kWarps);
}

// The tensor-core kernels need bf16 operands whose rows start 16-byte aligned, head_dim 64 or
// 128, mma.sync (compute capability 8.0+), and a grid whose y (heads x batch) fits.
bool tensor_cores(const Ctx& c, std::initializer_list<const Tensor*> ts, int64_t D,
                  int64_t grid_y) {
  if ((D != 64 && D != 128) || grid_y > 65535 || c.sm_major < 8) return false;
  for (const Tensor* t : ts)
    if (t->dtype() != DType::bf16 || !aligned16({t->data()})) return false;
  return true;
}

// Launches a tensor-core kernel of `warps` warps with `smem` bytes of dynamic shared memory
// (above the 48 KiB default, so the kernel must opt in first). `shapes` is called for an error
// message only.
template <class K, class S, class... Args>
void launch_tc(const Ctx& c, const std::string& op, K kernel, int warps, dim3 grid, size_t smem,
               const S& shapes, Args... args) {
  const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
  if (e != cudaSuccess) check(e, op, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)", shapes());
  MT_LAUNCH(kernel, grid, static_cast<unsigned>(warps * 32), smem, c)(args...);
  launched(op, shapes);
}

// Bytes of a shared [rows][D + 8] bf16 tile.
size_t tile_bytes(int64_t rows, int64_t D) {
  return static_cast<size_t>(rows) * static_cast<size_t>(D + 8) * sizeof(bf16);
}
unsigned tiles_of(int64_t n, int64_t rows) {
  return static_cast<unsigned>((n + rows - 1) / rows);
}

// Dynamic shared memory of the tensor-core kernels of w warps a block at head_dim D: the
// forward's (its owned query tile, two buffers each of K and V tiles), dq's (the owned Q and dO
// tiles and the K/V buffers) and dk/dv's (the owned K and V tiles, the Q/dO buffers and their lse
// and delta). The launches ask for these, and the kernels run only where they fit.
size_t fwd_smem(int64_t w, int64_t D) {
  return tile_bytes(16 * w, D) + 4 * tile_bytes(kTile, D);
}
size_t dq_smem(int64_t w, int64_t D) {
  return 2 * tile_bytes(16 * w, D) + 4 * tile_bytes(kTile, D);
}
size_t dkv_smem(int64_t w, int64_t D) {
  return dq_smem(w, D) + 4 * kTile * sizeof(float);
}
int64_t warps_of(int choice) {
  return choice == 8 ? 8 : 4;  // with_warps's choice
}

// Calls fn with std::integral_constant<int, D> for the tensor-core head sizes, D = 64 or 128.
template <class F>
void with_head_dim(int64_t D, F&& fn) {
  if (D == 64)
    fn(std::integral_constant<int, 64>{});
  else
    fn(std::integral_constant<int, 128>{});
}
// Calls fn with std::bool_constant<Cap>: whether the scores are soft-capped (the kernels
// without a cap have no tanh in their code).
template <class F>
void with_cap(const AttnArgs& a, F&& fn) {
  if (a.cap > 0.f)
    fn(std::true_type{});
  else
    fn(std::false_type{});
}
// Calls fn with std::integral_constant<int, W> for the warps per block of a tensor-core kernel:
// 4 (64 rows a block) unless `choice` (Ctx::flash_warps for the forward and dq,
// Ctx::flash_dkv_warps for dk/dv) says 8. On an H200 (2026-11-26, B=2 T=4096 H=32 causal) 4
// warps ran the forward 3% faster at head_dim 128 and 17% at 64, and forward + backward 3-4%
// faster again with a 4-warp dk/dv: two blocks share a multiprocessor (their registers allow no
// more warps either way), each waiting at its own barriers.
template <class F>
void with_warps(int choice, F&& fn) {
  if (choice == 8)
    fn(std::integral_constant<int, 8>{});
  else
    fn(std::integral_constant<int, 4>{});
}

const bf16* bf(const Tensor& t) {
  return t.ptr<const bf16>();
}

void check_head_dim(const std::string& op, const AttnArgs& a, bool tc) {
  MT_CHECK(tc || a.D <= 32 * kLaneMax,
           op + ": head_dim " + std::to_string(a.D) + " is larger than the " +
               std::to_string(32 * kLaneMax) +
               " this kernel supports (bf16 operands with head_dim 64 or 128 use tensor cores); "
               "use attention=dot_product");
}

}  // namespace

void flash_forward(const Ctx& c, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& q_segment, const Tensor& kv_segment, const AttentionSpec& spec,
                   Tensor& o, Tensor& lse) {
  const std::string op = "flash attention forward";
  const AttnArgs a = attention_args(op, q, k, v, q_segment, kv_segment, spec, o);
  const int64_t B = q.dim(0), rows = B * a.Hq * a.T;
  check_attention_lse(op, lse, B, a);
  if (rows == 0) return;
  const Flash f = make_flash(a, B, q_segment, kv_segment, nullptr);
  const auto shapes = [&] { return "q " + str(q) + ", k " + str(k) + ", v " + str(v); };
  // Where the device's shared memory per block is too small for them (99 KiB on sm_86/89/120
  // against the backward's 102-103 KiB at head_dim 128), the SIMT kernels run (before: a
  // cudaFuncSetAttribute error ended the run).
  const bool tc = tensor_cores(c, {&q, &k, &v}, a.D, B * a.Hq) &&
                  fwd_smem(warps_of(c.flash_warps), a.D) <= c.smem_per_block;
  check_head_dim(op, a, tc);
  if (tc) {
    // The owned query tile (16 rows a warp), and two buffers each of K and V tiles.
    with_warps(c.flash_warps, [&](auto w) {
      constexpr int W = decltype(w)::value;
      const dim3 grid(tiles_of(a.T, 16 * W), static_cast<unsigned>(B * a.Hq));
      const size_t smem = fwd_smem(W, a.D);
      with_head_dim(a.D, [&](auto d) {
        with_cap(a, [&](auto cap) {
          launch_tc(c, op, tc_fwd_kernel<decltype(d)::value, W, decltype(cap)::value>, W, grid,
                    smem, shapes, bf(q), bf(k), bf(v), f, out(o), lse.ptr<float>());
        });
      });
    });
    return;
  }
  MT_LAUNCH(simt_fwd_kernel, warp_blocks(rows), kWarps * 32, 0, c)
  (in(q), in(k), in(v), f, out(o), lse.ptr<float>());
  launched(op, shapes);
}

void flash_backward(const Ctx& c, const Tensor& dout, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& q_segment, const Tensor& kv_segment,
                    const Tensor& o, const Tensor& lse, const AttentionSpec& spec, Tensor& dq,
                    Tensor& dk, Tensor& dv) {
  const std::string op = "flash attention backward";
  const AttnArgs a = attention_args(op, q, k, v, q_segment, kv_segment, spec, o);
  check_attention_grads(op, dout, q, k, v, lse, dq, dk, dv);
  const int64_t B = q.dim(0), rows = B * a.Hq * a.T;
  if (rows == 0 || a.S == 0) return;
  const auto shapes = [&] { return attention_grad_shapes(dout, q, k, v, dq, dk, dv); };
  const Flash f = make_flash(a, B, q_segment, kv_segment, nullptr);
  const bool tc = tensor_cores(c, {&q, &k, &v, &dout}, a.D, B * a.Hq) &&
                  std::max(dq_smem(warps_of(c.flash_warps), a.D),
                           dkv_smem(warps_of(c.flash_dkv_warps), a.D)) <= c.smem_per_block;
  check_head_dim(op, a, tc);
  Tensor delta = c.scratch({B, a.Hq, a.T}, DType::f32);
  MT_LAUNCH(delta_kernel, warp_blocks(rows), kWarps * 32, 0, c)
  (in(dout), in(o), f, delta.ptr<float>());
  launched(op, shapes);
  const float* ls = lse.ptr<const float>();
  const float* dl = delta.ptr<const float>();
  if (tc) {
    // dq: the owned Q and dO tiles, two buffers each of K and V. dk/dv: the owned K and V tiles,
    // two buffers each of Q and dO tiles and of their lse and delta.
    // dk/dv in slices of the streamed query tiles (tc_dkv_kernel): whole at head_dim 64, two
    // at 128 unless Ctx::flash_dkv_parts says otherwise.
    const int parts = c.flash_dkv_parts > 0 ? c.flash_dkv_parts : a.D == 64 ? 1 : 2;
    with_head_dim(a.D, [&](auto d) {
      with_cap(a, [&](auto cap) {
        constexpr int D = decltype(d)::value;
        constexpr bool Cap = decltype(cap)::value;
        with_warps(c.flash_warps, [&](auto w) {
          constexpr int W = decltype(w)::value;
          const dim3 qgrid(tiles_of(a.T, 16 * W), static_cast<unsigned>(B * a.Hq));
          launch_tc(c, op, tc_dq_kernel<D, W, Cap>, W, qgrid, dq_smem(W, a.D), shapes, bf(q), bf(k),
                    bf(v), bf(dout), f, ls, dl, out(dq));
        });
        with_warps(c.flash_dkv_warps, [&](auto w) {
          constexpr int W = decltype(w)::value;
          const dim3 kgrid(tiles_of(a.S, 16 * W), static_cast<unsigned>(B * a.Hkv));
          const size_t dkv_bytes = dkv_smem(W, a.D);
          const auto dkv = [&](auto kernel) {
            launch_tc(c, op, kernel, W, kgrid, dkv_bytes, shapes, bf(q), bf(k), bf(v), bf(dout), f,
                      ls, dl, out(dk), out(dv));
          };
          if (parts == 1)
            dkv(tc_dkv_kernel<D, W, 1, Cap>);
          else
            dkv(tc_dkv_kernel<D, W, 2, Cap>);
        });
      });
    });
    return;
  }
  MT_LAUNCH(simt_dq_kernel, warp_blocks(rows), kWarps * 32, 0, c)
  (in(q), in(k), in(v), in(dout), f, ls, dl, out(dq));
  launched(op, shapes);
  MT_LAUNCH(simt_dkv_kernel, warp_blocks(B * a.S * a.Hkv), kWarps * 32, 0, c)
  (in(q), in(k), in(v), in(dout), f, ls, dl, out(dk), out(dv));
  launched(op, shapes);
}

void flash_decode(const Ctx& c, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                  const Tensor& lengths, const AttentionSpec& spec, Tensor& o) {
  const std::string op = "flash attention decode";
  const AttnArgs a = attention_args(op, q, k_cache, v_cache, Tensor(), Tensor(), spec, o);
  const int64_t B = q.dim(0), rows = B * a.Hq * a.T;
  unsigned long long* bad = check_decode_lengths(c, op, lengths, B, a);
  check_head_dim(op, a, false);
  if (rows == 0) return;
  const Flash f = make_flash(a, B, Tensor(), Tensor(), lengths.ptr<const int32_t>());
  const auto shapes = [&] {
    return "q " + str(q) + ", k_cache " + str(k_cache) + ", v_cache " + str(v_cache);
  };
  // A block per kv head and chunk of kDecodeKeys cache rows (decode_kernel), then the chunks'
  // partial softmaxes combined per query row.
  // At least one: an empty cache (no length is valid then) still runs the kernel that reports
  // the lengths (a grid of no blocks was a launch error that named no cause).
  const int64_t splits = std::max<int64_t>(1, (a.S + kDecodeKeys - 1) / kDecodeKeys);
  MT_CHECK(splits <= 65535 && B * a.Hkv <= INT_MAX,
           op + ": a cache of " + std::to_string(a.S) + " rows (more than " +
               std::to_string(int64_t{65535} * kDecodeKeys) + ") or " + std::to_string(B * a.Hkv) +
               " batch x kv heads is more than this kernel's grid");
  const bool vec = a.D % 8 == 0 && aligned16({k_cache.data(), v_cache.data()});
  Tensor partial = c.scratch({rows, splits, a.D + 2}, DType::f32);
  const dim3 grid(static_cast<unsigned>(B * a.Hkv), static_cast<unsigned>(splits));
  const int64_t group_rows = f.group * a.T;
  const auto launch = [&](auto kernel) {
    MT_LAUNCH(kernel, grid, kWarps * 32, 0, c)
    (in(q), in(k_cache), in(v_cache), f, vec, partial.ptr<float>(), bad);
  };
  if (group_rows <= 1) {
    launch(decode_kernel<1>);
  } else if (group_rows <= 2) {
    launch(decode_kernel<2>);
  } else if (group_rows <= 4) {
    launch(decode_kernel<4>);
  } else {
    launch(decode_kernel<kDecodeRows>);
  }
  launched(op, shapes);
  MT_LAUNCH(combine_kernel, warp_blocks(rows), kWarps * 32, 0, c)
  (partial.ptr<const float>(), splits, f, out(o));
  launched(op, shapes);
}

}  // namespace mt::cuda
