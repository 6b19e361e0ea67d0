// The cross-backend op table (as ggml's test-backend-ops): every op of mt/ops.def, in f32 and
// bf16, on every backend present, against the CPU backend's kernels. The backends under test:
// - cpu_composed: the CPU's required ops with the core's composition of every composed op (a
//   backend that lacks them: core/src/required_only_backend.h);
// - emulated_cuda: the cuda plugin's launchers run on the host (tests/support/emulated_cuda);
// - emulated_cuda_composed: the same without its composed ops;
// - cuda: the plugin on a real device (skipped, with the reason, where there is none).
// Inputs are drawn on the host from one seed per case, so every backend gets the same values;
// accumulated outputs start from random values, so a kernel that overwrites instead of adding
// is caught. A table entry per op is required (EveryOpHasACase): adding an op to ops.def without
// a case here fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "config_impl.h"
#include "emulated_cuda.h"
#include "mt/backend.h"
#include "mt/error.h"
#include "mt/ops.h"
#include "mt/q8.h"
#include "profiling_backend.h"
#include "test_support.h"

namespace mt {
namespace {

// One run of a case on one backend: makes its inputs, runs the op, keeps the outputs.
struct OpRun {
  OpRun(Backend& backend, DType dtype, uint64_t seed) : b(backend), dt(dtype), rng(seed) {}
  Backend& b;
  DType dt;
  std::mt19937_64 rng;
  std::vector<std::vector<float>> outs;
  std::vector<std::string> names;

  Tensor in(const Shape& s, float stddev = 1.f) { return in_as(s, dt, stddev); }
  Tensor in_as(const Shape& s, DType d, float stddev = 1.f) {
    return test::from_vector(b, s, test::randn(static_cast<size_t>(shape_numel(s)), rng, stddev),
                             d);
  }
  Tensor f32(const Shape& s, float stddev = 1.f) { return in_as(s, DType::f32, stddev); }
  Tensor positive_f32(const Shape& s) {
    std::vector<float> v = test::randn(static_cast<size_t>(shape_numel(s)), rng);
    for (float& x : v) x = std::fabs(x) + 0.1f;
    return test::from_vector(b, s, v, DType::f32);
  }
  // Written by the op: starts as zeros (an unwritten element then shows as a difference).
  Tensor out(const Shape& s) { return out_as(s, dt); }
  Tensor out_as(const Shape& s, DType d) { return b.zeros(s, d); }
  Tensor ints(const Shape& s, int lo, int hi) {
    std::uniform_int_distribution<int> u(lo, hi - 1);
    std::vector<int32_t> v(static_cast<size_t>(shape_numel(s)));
    for (int32_t& x : v) x = u(rng);
    return test::from_ints(b, s, v);
  }
  // Int8 rows (mt/q8.h) of random values: `lead` rows (any leading shape) of k values each, as
  // an i8 tensor [lead..., q8_row_bytes(k)].
  Tensor q8_rows(Shape lead, int64_t k) {
    const int64_t n = shape_numel(lead), rb = q8_row_bytes(k);
    const std::vector<float> f = test::randn(static_cast<size_t>(n * k), rng);
    std::vector<int8_t> q(static_cast<size_t>(n * rb));
    for (int64_t j = 0; j < n; ++j)
      EXPECT_TRUE(quantize_q8_row(f.data() + j * k, k, q.data() + j * rb));
    lead.push_back(rb);
    Tensor t = b.empty(lead, DType::i8);
    b.copy_from_host(t, q.data());
    return t;
  }
  // Values that quantizing by blocks of kQ8Block keeps exactly (each block: integers up to 127
  // in magnitude, one of them +-127, times a power of two; exact in bf16 too), in the run's
  // dtype.
  Tensor q8_exact(const Shape& s) {
    std::vector<float> v(static_cast<size_t>(shape_numel(s)));
    std::uniform_int_distribution<int> qd(-127, 127);
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = float(i % kQ8Block == 0 ? (qd(rng) < 0 ? -127 : 127) : qd(rng)) / 16.f;
    return test::from_vector(b, s, v, dt);
  }
  Tensor given_ints(const Shape& s, const std::vector<int32_t>& v) {
    return test::from_ints(b, s, v);
  }
  void keep(const std::string& name, const Tensor& t) {
    names.push_back(name);
    if (t.dtype() == DType::i32) {
      const std::vector<int32_t> v = test::to_ints(t);
      outs.emplace_back(v.begin(), v.end());
    } else {
      outs.push_back(test::to_vector(t));
    }
  }
  void keep(const std::string& name, double v) {
    names.push_back(name);
    outs.push_back({static_cast<float>(v)});
  }
};

struct OpCase {
  Op op;
  std::string label;
  std::function<void(OpRun&)> run;
  double tol_f32 = 2e-5;  // scaled error: max |got - want| / max |want|
  double tol_bf16 = 2e-2;
};

const Activation kActs[] = {Activation::silu, Activation::gelu_tanh, Activation::gelu_exact,
                            Activation::relu, Activation::tanh};
const char* kActNames[] = {"silu", "gelu_tanh", "gelu_exact", "relu", "tanh"};

std::vector<OpCase> cases() {
  std::vector<OpCase> c;
  auto add = [&](Op op, std::string label, std::function<void(OpRun&)> f) {
    c.push_back({op, std::move(label), std::move(f)});
    return &c.back();
  };
  // ---- elementwise
  add(Op::fill, "fill", [](OpRun& r) {
    Tensor t = r.out({37});
    r.b.fill(t, 0.75f);
    r.keep("x", t);
  });
  add(Op::cast, "cast", [](OpRun& r) {
    Tensor x = r.in({53});
    Tensor a = r.out_as({53}, DType::f32), h = r.out_as({53}, DType::bf16);
    r.b.cast(x, a);
    r.b.cast(x, h);
    r.keep("f32", a);
    r.keep("bf16", h);
  });
  add(Op::add, "add", [](OpRun& r) {
    Tensor a = r.in({3, 41}), b = r.in({3, 41}), o = r.out({3, 41});
    r.b.add(a, b, o);
    r.keep("out", o);
  });
  add(Op::mul, "mul", [](OpRun& r) {
    Tensor a = r.in({3, 41}), b = r.in({3, 41}), o = r.out({3, 41});
    r.b.mul(a, b, o);
    r.keep("out", o);
  });
  add(Op::scale, "scale", [](OpRun& r) {
    Tensor x = r.in({77}), o = r.out({77});
    r.b.scale(x, -1.7f, o);
    r.keep("out", o);
  });
  add(Op::axpy, "axpy", [](OpRun& r) {
    Tensor x = r.in({77}), y = r.in({77});
    r.b.axpy(0.3f, x, y);
    r.keep("y", y);
  });
  add(Op::sum, "sum", [](OpRun& r) { r.keep("sum", r.b.sum(r.in({3, 50}))); });
  add(Op::sum_squares, "sum_squares", [](OpRun& r) {
    r.keep("sum", r.b.sum_squares(r.in({3, 50})));
  });
  add(Op::sum_squares_each, "sum_squares_each", [](OpRun& r) {
    Tensor a = r.in({13}), b = r.in({4, 9}), c = r.in({1});
    std::vector<double> s;
    r.b.sum_squares_each({&a, &b, &c}, s);
    ASSERT_EQ(s.size(), 3u);
    for (double v : s) r.keep("sum", v);
  });
  add(Op::copy_columns, "copy_columns", [](OpRun& r) {
    Tensor src = r.in({5, 7}), dst = r.in({5, 9});
    r.b.copy_columns(src, 1, dst, 2, 4, false);
    r.keep("copy", dst);
    r.b.copy_columns(src, 0, dst, 5, 4, true);
    r.keep("accumulate", dst);
  });
  // Pieces starting off 16-byte boundaries, an empty one, rows of two leading dimensions.
  add(Op::split_columns, "split_columns", [](OpRun& r) {
    Tensor src = r.in({3, 2, 13});
    std::vector<Tensor> pieces{r.out({3, 2, 5}), r.out({3, 2, 0}), r.out({3, 2, 1}),
                               r.out({3, 2, 7})};
    r.b.split_columns(src, pieces);
    for (const Tensor& p : pieces) r.keep("piece", p);
  });
  // Parameter initialisation: every backend writes the same bits (mt/random_fill.h), so exactly.
  add(Op::fill_random, "fill_random", [](OpRun& r) {
    Tensor a = r.out({1031}), b = r.out({3, 5});
    RandomFill s;
    s.key = 0x9e3779b97f4a7c15ull;
    s.stddev = 0.5f;
    r.b.fill_random(a, s);
    r.keep("normal", a);
    s.distribution = RandomFill::Distribution::truncated_normal;
    r.b.fill_random(b, s);
    r.keep("truncated_normal", b);
  })->tol_f32 = 0;
  c.back().tol_bf16 = 0;
  // ---- matmul
  add(Op::matmul, "matmul", [](OpRun& r) {
    Tensor a = r.in({5, 7}), b = r.in({7, 6}), c = r.out({5, 6});
    r.b.matmul(a, b, c, false, false);
    r.keep("plain", c);
    Tensor at = r.in({7, 5}), bt = r.in({6, 7}), c2 = r.in({5, 6});
    r.b.matmul(at, bt, c2, true, true, 0.5f, 1.f);
    r.keep("transposed, alpha and beta", c2);
    Tensor ab = r.in({2, 5, 7}), cb = r.out({2, 5, 6});
    r.b.matmul(ab, b, cb, false, false);
    r.keep("batched, shared b", cb);
    Tensor v = r.in({1, 64}), w = r.in({64, 33}), o = r.out({1, 33});
    r.b.matmul(v, w, o, false, false);
    r.keep("matrix-vector", o);
    Tensor wt = r.in({33, 64}), o2 = r.out({1, 33});
    r.b.matmul(v, wt, o2, false, true);
    r.keep("matrix-vector, transposed", o2);
  });
  // int8 rows (mt/q8.h): decode's few rows and a prefill's many. The CPU quantizes decode's rows
  // of x too (ops.def), the composed and CUDA ones do not; so x's values here are what that
  // quantization keeps exactly (each block: integers up to 127 in magnitude, one of them +-127,
  // times a power of two, exact in bf16 too), and every backend computes the same product to
  // the usual rounding.
  add(Op::matmul_q8, "matmul_q8", [](OpRun& r) {
    const int64_t k = 96, n = 9;  // rows of 102 bytes: 2-byte aligned only
    Tensor w = r.q8_rows({n}, k);
    Tensor x1 = r.q8_exact({1, k}), y1 = r.out({1, n});
    r.b.matmul_q8(x1, w, y1);
    r.keep("one row", y1);
    Tensor x2 = r.q8_exact({3, 4, k}), y2 = r.out({3, 4, n});
    r.b.matmul_q8(x2, w, y2);
    r.keep("twelve rows", y2);
    // K = 768: rows of 816 bytes, 16-byte aligned (the CUDA matrix-vector kernel's wide loads),
    // K / 16 = 48 lane chunks (a warp's lanes take one or two); 1, 2, 3 and 8 rows of x (its
    // instances for 1, 2, 4 and 8 rows, one of them partly filled).
    const int64_t kw = 768;
    Tensor w2 = r.q8_rows({n}, kw);
    for (int64_t rows : {1, 2, 3, 8}) {
      Tensor xw = r.q8_exact({rows, kw}), yw = r.out({rows, n});
      r.b.matmul_q8(xw, w2, yw);
      r.keep(std::to_string(rows) + " rows, aligned", yw);
    }
  });
  // Experts' int8 rows [E, N, K + K / 16]: an expert with no rows, decode's few rows an expert
  // (the CPU's one fork over every expert), and an expert of 10 rows (each expert on its own, a
  // prefill's GEMM); x's values exact in q8_0 as matmul_q8's case says.
  add(Op::grouped_matmul_q8, "grouped_matmul_q8", [](OpRun& r) {
    const int64_t e = 4, k = 64, n = 9;
    Tensor w = r.q8_rows({e, n}, k);
    for (const std::vector<int64_t>& counts :
         {std::vector<int64_t>{1, 0, 2, 1}, std::vector<int64_t>{3, 10, 0, 1}}) {
      int64_t m = 0;
      for (const int64_t c : counts) m += c;
      Tensor x = r.q8_exact({m, k}), y = r.out({m, n});
      r.b.grouped_matmul_q8(x, w, counts, y);
      r.keep(std::to_string(m) + " rows", y);
    }
  });
  // ---- embedding
  add(Op::embedding_forward, "embedding_forward", [](OpRun& r) {
    Tensor table = r.in({11, 9}), ids = r.ints({2, 3}, 0, 11), o = r.out({2, 3, 9});
    r.b.embedding_forward(table, ids, o);
    r.keep("out", o);
  });
  // A table of int8 rows (a tied embedding under quantization=int8): rows looked up, widened to
  // the run's dtype; row 10 twice, row 0 (the first) and 10 (the last) at the edges.
  add(Op::embedding_q8_forward, "embedding_q8_forward", [](OpRun& r) {
    const int64_t d = 64;
    Tensor table = r.q8_rows({11}, d);
    Tensor ids = r.given_ints({2, 3}, {10, 0, 4, 10, 7, 1}), o = r.out({2, 3, d});
    r.b.embedding_q8_forward(table, ids, o);
    r.keep("out", o);
  });
  add(Op::embedding_backward, "embedding_backward", [](OpRun& r) {
    Tensor dout = r.in({7, 9}), dtable = r.f32({11, 9});
    Tensor ids = r.given_ints({7}, {3, 0, 3, 10, 5, 3, 0});  // repeated rows add up
    r.b.embedding_backward(dout, ids, dtable);
    r.keep("dtable", dtable);
  });
  // ---- normalisation
  for (bool plus_one : {false, true}) {
    const std::string p = plus_one ? " (1 + w)" : "";
    add(Op::rmsnorm_forward, "rmsnorm_forward" + p, [plus_one](OpRun& r) {
      Tensor x = r.in({6, 40}), w = r.in({40}), o = r.out({6, 40});
      Tensor rstd = r.out_as({6}, DType::f32);
      r.b.rmsnorm_forward(x, w, 1e-5f, plus_one, o, rstd);
      r.keep("out", o);
      r.keep("rstd", rstd);
    });
    add(Op::rmsnorm_backward, "rmsnorm_backward" + p, [plus_one](OpRun& r) {
      Tensor x = r.in({6, 40}), w = r.in({40}), o = r.out({6, 40});
      Tensor rstd = r.out_as({6}, DType::f32);
      r.b.rmsnorm_forward(x, w, 1e-5f, plus_one, o, rstd);
      Tensor dout = r.in({6, 40}), dx = r.in({6, 40}), dw = r.f32({40});
      r.b.rmsnorm_backward(dout, x, w, rstd, plus_one, dx, dw);
      r.keep("dx", dx);
      r.keep("dw", dw);
    });
  }
  for (bool bias : {true, false}) {
    const std::string p = bias ? "" : " (no bias)";
    add(Op::layernorm_forward, "layernorm_forward" + p, [bias](OpRun& r) {
      Tensor x = r.in({6, 40}), w = r.in({40}), b = bias ? r.in({40}) : Tensor();
      Tensor o = r.out({6, 40}), mean = r.out_as({6}, DType::f32), rstd = r.out_as({6}, DType::f32);
      r.b.layernorm_forward(x, w, b, 1e-5f, o, mean, rstd);
      r.keep("out", o);
      r.keep("mean", mean);
      r.keep("rstd", rstd);
    });
    add(Op::layernorm_backward, "layernorm_backward" + p, [bias](OpRun& r) {
      Tensor x = r.in({6, 40}), w = r.in({40}), b = bias ? r.in({40}) : Tensor();
      Tensor o = r.out({6, 40}), mean = r.out_as({6}, DType::f32), rstd = r.out_as({6}, DType::f32);
      r.b.layernorm_forward(x, w, b, 1e-5f, o, mean, rstd);
      Tensor dout = r.in({6, 40}), dx = r.in({6, 40}), dw = r.f32({40});
      Tensor db = bias ? r.f32({40}) : Tensor();
      r.b.layernorm_backward(dout, x, w, mean, rstd, dx, dw, db);
      r.keep("dx", dx);
      r.keep("dw", dw);
      if (bias) r.keep("db", db);
    });
  }
  // ---- rotary embedding
  std::vector<std::pair<std::string, RopeSpec>> ropes;
  ropes.push_back({"standard", RopeSpec{}});
  RopeSpec llama3;
  llama3.type = RopeSpec::Type::llama3;
  llama3.theta = 500000.f;
  llama3.factor = 8.f;
  llama3.original_max_position = 64;
  ropes.push_back({"llama3", llama3});
  RopeSpec yarn;
  yarn.type = RopeSpec::Type::yarn;
  yarn.factor = 4.f;
  yarn.original_max_position = 32;
  ropes.push_back({"yarn", yarn});
  RopeSpec partial;
  partial.rotary_dim = 4;
  partial.interleaved = true;
  ropes.push_back({"partial, interleaved", partial});
  for (const auto& [name, spec] : ropes) {
    add(Op::rope_forward, "rope_forward " + name, [spec = spec](OpRun& r) {
      Tensor x = r.in({2, 5, 3, 8}), pos = r.ints({2, 5}, 0, 100), o = r.out({2, 5, 3, 8});
      r.b.rope_forward(x, pos, spec, o);
      r.keep("out", o);
    });
    add(Op::rope_backward, "rope_backward " + name, [spec = spec](OpRun& r) {
      Tensor dout = r.in({2, 5, 3, 8}), pos = r.ints({2, 5}, 0, 100), dx = r.in({2, 5, 3, 8});
      r.b.rope_backward(dout, pos, spec, dx);
      r.keep("dx", dx);
    });
  }
  // ---- activations
  for (int a = 0; a < 5; ++a) {
    const Activation act = kActs[a];
    const std::string n = kActNames[a];
    add(Op::activation_forward, "activation_forward " + n, [act](OpRun& r) {
      Tensor x = r.in({99}, 2.f), o = r.out({99});
      r.b.activation_forward(act, x, o);
      r.keep("out", o);
    });
    add(Op::activation_backward, "activation_backward " + n, [act](OpRun& r) {
      Tensor x = r.in({99}, 2.f), dout = r.in({99}), dx = r.in({99});
      r.b.activation_backward(act, dout, x, dx);
      r.keep("dx", dx);
    });
    add(Op::gated_forward, "gated_forward " + n, [act](OpRun& r) {
      Tensor g = r.in({3, 33}, 2.f), u = r.in({3, 33}), o = r.out({3, 33});
      r.b.gated_forward(act, g, u, o);
      r.keep("out", o);
    });
    add(Op::gated_backward, "gated_backward " + n, [act](OpRun& r) {
      Tensor g = r.in({3, 33}, 2.f), u = r.in({3, 33}), dout = r.in({3, 33});
      Tensor dg = r.in({3, 33}), du = r.in({3, 33});
      r.b.gated_backward(act, dout, g, u, dg, du);
      r.keep("dgate", dg);
      r.keep("dup", du);
    });
  }
  add(Op::softcap_forward, "softcap_forward", [](OpRun& r) {
    Tensor x = r.in({2, 61}, 20.f), o = r.out({2, 61});
    r.b.softcap_forward(x, 15.f, o);
    r.keep("out", o);
  });
  add(Op::softcap_backward, "softcap_backward", [](OpRun& r) {
    Tensor x = r.in({2, 61}, 20.f), o = r.out({2, 61});
    r.b.softcap_forward(x, 15.f, o);
    Tensor dout = r.in({2, 61}), dx = r.in({2, 61});
    r.b.softcap_backward(dout, o, 15.f, dx);
    r.keep("dx", dx);
  });
  // ---- softmax and loss
  add(Op::softmax_forward, "softmax_forward", [](OpRun& r) {
    Tensor x = r.in({6, 13}, 3.f), o = r.out({6, 13});
    r.b.softmax_forward(x, o);
    r.keep("out", o);
  });
  add(Op::softmax_backward, "softmax_backward", [](OpRun& r) {
    Tensor x = r.in({6, 13}, 3.f), o = r.out({6, 13});
    r.b.softmax_forward(x, o);
    Tensor dout = r.in({6, 13}), dx = r.in({6, 13});
    r.b.softmax_backward(dout, o, dx);
    r.keep("dx", dx);
  });
  add(Op::cross_entropy_forward, "cross_entropy_forward", [](OpRun& r) {
    Tensor logits = r.in({6, 29}, 3.f);
    Tensor targets = r.given_ints({6}, {4, -1, 28, 0, 17, 4});  // -1: ignored
    Tensor loss = r.out_as({6}, DType::f32), lse = r.out_as({6}, DType::f32);
    r.b.cross_entropy_forward(logits, targets, 1e-3f, loss, lse);
    r.keep("loss", loss);
    r.keep("lse", lse);
  });
  add(Op::cross_entropy_backward, "cross_entropy_backward", [](OpRun& r) {
    Tensor logits = r.in({6, 29}, 3.f);
    Tensor targets = r.given_ints({6}, {4, -1, 28, 0, 17, 4});
    Tensor loss = r.out_as({6}, DType::f32), lse = r.out_as({6}, DType::f32);
    r.b.cross_entropy_forward(logits, targets, 1e-3f, loss, lse);
    Tensor dloss = r.f32({6}), dlogits = r.in({6, 29});
    r.b.cross_entropy_backward(dloss, logits, targets, lse, 1e-3f, dlogits);
    r.keep("dlogits", dlogits);
  });
  // ---- mixture of experts and rows
  for (bool sigmoid : {false, true})
    for (bool normalize : {false, true}) {
      const std::string n =
          std::string(sigmoid ? " sigmoid" : " softmax") + (normalize ? ", normalized" : "");
      add(Op::topk_route_forward, "topk_route_forward" + n, [=](OpRun& r) {
        Tensor logits = r.in({10, 8}, 2.f);
        Tensor w = r.out_as({10, 3}, DType::f32), idx = r.out_as({10, 3}, DType::i32),
               probs = r.out_as({10, 8}, DType::f32);
        r.b.topk_route_forward(logits, 3, sigmoid, normalize, w, idx, probs);
        r.keep("weights", w);
        r.keep("indices", idx);
        r.keep("probs", probs);
      });
      add(Op::topk_route_backward, "topk_route_backward" + n, [=](OpRun& r) {
        Tensor logits = r.in({10, 8}, 2.f);
        Tensor w = r.out_as({10, 3}, DType::f32), idx = r.out_as({10, 3}, DType::i32),
               probs = r.out_as({10, 8}, DType::f32);
        r.b.topk_route_forward(logits, 3, sigmoid, normalize, w, idx, probs);
        Tensor dw = r.f32({10, 3}), dlogits = r.in({10, 8});
        r.b.topk_route_backward(dw, w, idx, probs, sigmoid, normalize, dlogits);
        r.keep("dlogits", dlogits);
      });
    }
  add(Op::gather_rows, "gather_rows", [](OpRun& r) {
    Tensor x = r.in({9, 12}), idx = r.given_ints({7}, {8, 0, 3, 3, 5, 1, 8}), o = r.out({7, 12});
    r.b.gather_rows(x, idx, o);
    r.keep("out", o);
  });
  for (bool weighted : {true, false})
    add(Op::scatter_add_rows, weighted ? "scatter_add_rows weighted" : "scatter_add_rows",
        [weighted](OpRun& r) {
          Tensor src = r.in({7, 12}), idx = r.given_ints({7}, {8, 0, 3, 3, 5, 1, 8});
          Tensor w = weighted ? r.f32({7}) : Tensor(), o = r.in({9, 12});
          r.b.scatter_add_rows(src, idx, w, o);
          r.keep("out", o);
        });
  add(Op::scatter_rows, "scatter_rows", [](OpRun& r) {
    Tensor src = r.in({5, 12}), idx = r.given_ints({5}, {8, 0, 3, 6, 1}), o = r.in({9, 12});
    r.b.scatter_rows(src, idx, o);
    r.keep("out", o);
  });
  add(Op::scatter_rows_each, "scatter_rows_each", [](OpRun& r) {
    Tensor idx = r.given_ints({4}, {8, 0, 6, 1});
    std::vector<Tensor> srcs{r.in({4, 12}), r.in({4, 5})}, outs{r.in({9, 12}), r.in({9, 5})};
    r.b.scatter_rows_each(srcs, idx, outs);
    r.keep("k", outs[0]);
    r.keep("v", outs[1]);
  });
  // The int8 KV cache: every row quantized, then five rewritten (4 values a scale), read back.
  auto q8_rows = [](OpRun& r) {
    Tensor all = r.in({9, 12}), every = r.given_ints({9}, {0, 1, 2, 3, 4, 5, 6, 7, 8});
    Tensor q = r.b.empty({9, 12}, DType::i8), s = r.out_as({9, 3}, DType::f32);
    r.b.scatter_rows_q8(all, every, q, s);
    Tensor src = r.in({5, 12}), idx = r.given_ints({5}, {8, 0, 3, 6, 1});
    r.b.scatter_rows_q8(src, idx, q, s);
    return std::pair{q, s};
  };
  add(Op::scatter_rows_q8, "scatter_rows_q8", [q8_rows](OpRun& r) {
    auto [q, s] = q8_rows(r);
    r.keep("scales", s);
    Tensor o = r.out_as({9, 12}, DType::f32);
    r.b.dequantize_rows_q8(q, s, o);
    r.keep("rows", o);
  });
  add(Op::dequantize_rows_q8, "dequantize_rows_q8", [q8_rows](OpRun& r) {
    auto [q, s] = q8_rows(r);
    Tensor o = r.out({3, 3, 12});  // any shape of as many elements, in the run's dtype
    r.b.dequantize_rows_q8(q, s, o);
    r.keep("out", o);
  });
  for (bool trans : {false, true}) {
    const std::string n = trans ? " (transposed weights)" : "";
    add(Op::grouped_matmul, "grouped_matmul" + n, [trans](OpRun& r) {
      Tensor x = r.in({7, 6}), w = trans ? r.in({4, 5, 6}) : r.in({4, 6, 5});
      Tensor off = r.given_ints({5}, {0, 2, 2, 6, 7});  // expert 1 gets no rows
      Tensor o = r.out({7, 5});
      r.b.grouped_matmul(x, w, off, trans, o);
      r.keep("out", o);
    });
    add(Op::grouped_matmul_weight_grad, "grouped_matmul_weight_grad" + n, [trans](OpRun& r) {
      Tensor x = r.in({7, 6}), dout = r.in({7, 5});
      Tensor off = r.given_ints({5}, {0, 2, 2, 6, 7});
      Tensor dw = trans ? r.f32({4, 5, 6}) : r.f32({4, 6, 5});
      r.b.grouped_matmul_weight_grad(x, dout, off, trans, dw);
      r.keep("dw", dw);
    });
  }
  // ---- optimizer
  add(Op::adamw_update, "adamw_update", [](OpRun& r) {
    // m in the case's dtype: a bf16 first moment is mu_dtype=bfloat16.
    Tensor p = r.in({45}), g = r.in({45}), m = r.in({45}, 0.1f), v = r.positive_f32({45});
    AdamWParams a;
    a.lr = 1e-2f;
    a.weight_decay = 0.1f;
    a.step = 3;
    a.grad_scale = 0.5f;
    r.b.adamw_update(p, g, m, v, a);
    r.keep("param", p);
    r.keep("m", m);
    r.keep("v", v);
  });
  return c;
}

// ---- the table's own checks -------------------------------------------------------------

TEST(OpTable, EveryOpHasACase) {
  std::set<Op> covered;
  for (const OpCase& c : cases()) covered.insert(c.op);
  for (const OpInfo& info : all_ops())
    EXPECT_TRUE(covered.count(info.op)) << info.name << " has no case in backend_ops_test.cpp";
}

TEST(OpTable, DescriptionsSplitSignatures) {
  const auto& ops = all_ops();
  ASSERT_GT(ops.size(), 30u);
  for (size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(static_cast<size_t>(ops[i].op), i);
    EXPECT_EQ(op_info(ops[i].op).name, ops[i].name);
    EXPECT_EQ(find_op(ops[i].name), ops[i].op);
    EXPECT_FALSE(ops[i].outputs.empty() && ops[i].result == "void") << ops[i].name;
  }
  const OpInfo& s = op_info(Op::softcap_forward);
  EXPECT_FALSE(s.required);
  ASSERT_EQ(s.inputs.size(), 1u);
  EXPECT_EQ(s.inputs[0].name, "x");
  EXPECT_EQ(s.inputs[0].type, "const Tensor&");
  ASSERT_EQ(s.outputs.size(), 1u);
  EXPECT_EQ(s.outputs[0].name, "out");
  EXPECT_EQ(s.outputs[0].type, "Tensor&");
  ASSERT_EQ(s.attributes.size(), 1u);
  EXPECT_EQ(s.attributes[0].name, "cap");
  const OpInfo& m = op_info(Op::matmul);
  EXPECT_TRUE(m.required);
  std::vector<std::string> attrs;
  for (const OpParam& p : m.attributes) attrs.push_back(p.name);
  EXPECT_EQ(attrs, (std::vector<std::string>{"trans_a", "trans_b", "alpha", "beta"}));
  EXPECT_EQ(op_info(Op::fill).outputs.at(0).type, "Tensor&");
  EXPECT_EQ(op_info(Op::sum_squares_each).outputs.at(0).name, "sums");
  EXPECT_EQ(op_info(Op::adamw_update).attributes.at(0).type, "const AdamWParams&");
  EXPECT_FALSE(find_op("no_such_op"));
}

TEST(OpTable, BackendsSayWhatTheyRunThemselves) {
  Backend& cpu = test::cpu();
  test::RequiredOnlyBackend lacking(cpu);
  for (const OpInfo& info : all_ops()) {
    EXPECT_TRUE(cpu.supports(info.op)) << info.name;
    EXPECT_EQ(lacking.supports(info.op), info.required) << info.name;
  }
  // The profiler forwards the question and times a composed op under its own name.
  ProfilingBackend prof(lacking);
  EXPECT_FALSE(prof.supports(Op::softcap_forward));
  Tensor x = test::from_vector(prof, {4}, {1, 2, 3, 4}), o = prof.empty({4}, DType::f32);
  prof.softcap_forward(x, 2.f, o);
  ASSERT_TRUE(prof.times().count("softcap_forward"));
  EXPECT_EQ(prof.times().at("softcap_forward").calls, 1);
}

// ---- every case on every backend ----------------------------------------------------------

struct Device {
  std::unique_ptr<Backend> owned;
  std::unique_ptr<test::RequiredOnlyBackend> lacking;
  Backend* backend = nullptr;
  std::string skip;
};

Device make_device(const std::string& name) {
  Device d;
  auto composed = [&d](Backend& inner) {
    d.lacking = std::make_unique<test::RequiredOnlyBackend>(inner);
    d.backend = d.lacking.get();
  };
  if (name == "cpu_composed") {
    composed(test::cpu());
  } else if (name == "emulated_cuda" || name == "emulated_cuda_composed") {
#if defined(__SANITIZE_ADDRESS__)
    d.skip = "the emulated GPU threads switch stacks with _longjmp, which AddressSanitizer does "
             "not follow (the sanitizer pass leaves the emulation out)";
    return d;
#endif
    d.owned = test::emulated_cuda();
    d.backend = d.owned.get();
    if (name == "emulated_cuda_composed") composed(*d.owned);
  } else if (name == "cuda") {
    try {
      d.owned = test::plugins().make_backend("cuda", config_from_pairs({}));
      d.backend = d.owned.get();
    } catch (const Error& e) {
      d.skip = std::string("no cuda backend here: ") + e.what();
    }
  }
  return d;
}

class BackendOps : public ::testing::TestWithParam<std::string> {};

TEST_P(BackendOps, EveryOpMatchesTheCpuBackend) {
  Device dev = make_device(GetParam());
  if (!dev.skip.empty()) GTEST_SKIP() << dev.skip;
  ASSERT_NE(dev.backend, nullptr);
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " (MT_TEST_SEED)");
  Backend& cpu = test::cpu();
  int compared = 0;
  for (const OpCase& c : cases())
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(c.label + (dt == DType::f32 ? " f32" : " bf16"));
      OpRun want(cpu, dt, seed);
      OpRun got(*dev.backend, dt, seed);
      ASSERT_NO_THROW(c.run(want));
      ASSERT_NO_THROW(c.run(got));
      ASSERT_EQ(got.outs.size(), want.outs.size());
      const double tol = dt == DType::f32 ? c.tol_f32 : c.tol_bf16;
      for (size_t i = 0; i < want.outs.size(); ++i) {
        ASSERT_EQ(got.outs[i].size(), want.outs[i].size()) << want.names[i];
        EXPECT_LE(test::scaled_err(got.outs[i], want.outs[i]), tol) << want.names[i];
        ++compared;
      }
    }
  EXPECT_GT(compared, 200);
}

INSTANTIATE_TEST_SUITE_P(Backends, BackendOps,
                         ::testing::Values("cpu_composed", "emulated_cuda",
                                           "emulated_cuda_composed", "cuda"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace mt
