#include "mt/graph.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "communicator.h"
#include "graph_internal.h"
#include "mt/error.h"
#include "mt/q8.h"

namespace mt {

using namespace graph_detail;

bool parse_remat_policy(const std::string& s, RematPolicy& out) {
  if (s == "none") out = RematPolicy::none;
  else if (s == "minimal") out = RematPolicy::minimal;
  else if (s == "full") out = RematPolicy::full;
  else return false;
  return true;
}

Graph::Graph(Backend& backend, bool record)
    : backend_(&backend), record_(record), impl_(std::make_unique<Impl>()) {}
Graph::~Graph() = default;

size_t Graph::tape_size() const { return impl_->tape.size(); }

void Graph::track(Tensor& param, Tensor grad) {
  MT_CHECK(grad.shape() == param.shape(),
           "gradient buffer " + grad.str() + " does not match parameter " + param.str());
  auto n = std::make_shared<GradNode>();
  n->shape = param.shape();
  n->dtype = grad.dtype();
  n->grad = std::move(grad);
  n->leaf = true;
  param.set_grad_node(std::move(n));
}

Tensor Graph::detach(const Tensor& x) { return x.view(x.shape()); }

void Graph::mark_fresh(const Tensor& param) {
  if (const auto& n = param.grad_node()) n->fresh = true;
}

void Graph::finish_fresh(Backend& backend, const Tensor& param) {
  const auto& n = param.grad_node();
  if (n && n->fresh) {
    backend.fill(n->grad, 0.f);
    n->fresh = false;
  }
}

Tensor Graph::project(const Tensor& x, const Params& p, std::string_view w) {
  switch (p.layout(w)) {
    case WeightLayout::transposed:
      return matmul(x, p.stored(w), false, true);
    case WeightLayout::q8: {
      // Inference only: int8 weights have no gradient.
      const Tensor& q = p.stored(w);
      MT_CHECK(!recording() || !x.grad_node(),
               "project: the int8 weight '" + std::string(w) + "' in a recorded graph");
      Shape ys = x.shape();
      ys.back() = q.dim(0);
      Tensor y = backend().empty(ys, x.dtype());
      backend().matmul_q8(x, q, y);
      return y;
    }
    default:
      return matmul(x, p[w]);
  }
}

Tensor Graph::grouped_project(const Tensor& x, const Params& p, std::string_view w,
                              const Tensor& offsets, const std::vector<int64_t>& counts) {
  switch (p.layout(w)) {
    case WeightLayout::transposed:
      return grouped_matmul(x, p.stored(w), offsets, true);
    case WeightLayout::q8: {
      // Inference only, as project's: each expert's rows of x against its int8 rows [N, K + K /
      // 8] (the counts are on the host already).
      const Tensor& q = p.stored(w);
      MT_CHECK(!recording() || !x.grad_node(),
               "grouped_project: the int8 weight '" + std::string(w) + "' in a recorded graph");
      MT_CHECK(q.ndim() == 3 && x.ndim() == 2,
               "grouped_project: int8 experts " + q.str() + " and x " + x.str());
      Tensor y = backend().empty({x.dim(0), q.dim(1)}, x.dtype());
      backend().grouped_matmul_q8(x, q, counts, y);
      return y;
    }
    default:
      return grouped_matmul(x, p[w], offsets);
  }
}

Tensor Graph::matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  const bool shared_b = b.ndim() == 2 && a.ndim() > 2;
  MT_CHECK(!(shared_b && ta), "matmul with a shared 2-D right operand needs trans_a == false");
  Tensor c;
  if (impl_->matmul_replay) {
    MT_CHECK(impl_->replay_pos < impl_->matmul_replay->size(),
             "remat replay ran more matmuls than the forward pass");
    c = detach((*impl_->matmul_replay)[impl_->replay_pos++]);
    MT_CHECK(c.shape() == matmul_shape(a, b, ta, tb), "remat replay: matmul shapes differ");
  } else {
    c = backend_->empty(matmul_shape(a, b, ta, tb), a.dtype());
    backend_->matmul(a, b, c, ta, tb, 1.f, 0.f);
    if (impl_->matmul_save) impl_->matmul_save->push_back(c);
  }
  Backend* be = backend_;
  record(record_, impl_->tape, c, {&a, &b},
         [be, a, b, ta, tb, shared_b](const Tensor& dc, const Grads& d) {
           // An operand that is a parameter's bf16 copy gets its gradient written into the
           // parameter's (f32) buffer by the product itself: no bf16 gradient, no conversion.
           auto target = [&d](size_t i, float& beta) {
             bool fresh = false;
             Tensor* g = d.master(i, fresh);
             if (!g) {
               g = d.raw(i);
               fresh = g && d.overwrite(i);
             }
             beta = fresh ? 0.f : 1.f;
             return g;
           };
           float beta = 0.f;
           if (Tensor* g = target(0, beta)) {
             if (!ta)
               be->matmul(dc, b, *g, false, !tb, 1.f, beta);
             else if (!tb)
               be->matmul(b, dc, *g, false, true, 1.f, beta);
             else
               be->matmul(b, dc, *g, true, true, 1.f, beta);
           }
           if (Tensor* g = target(1, beta)) {
             const Tensor a2 = shared_b ? rows2d(a) : a;
             const Tensor dc2 = shared_b ? rows2d(dc) : dc;
             if (!ta && !tb)
               be->matmul(a2, dc2, *g, true, false, 1.f, beta);
             else if (!ta && tb)
               be->matmul(dc2, a2, *g, true, false, 1.f, beta);
             else if (!tb)
               be->matmul(a, dc, *g, false, false, 1.f, beta);
             else
               be->matmul(dc, a, *g, true, true, 1.f, beta);
           }
         });
  return c;
}

Tensor Graph::add(const Tensor& a, const Tensor& b) {
  MT_CHECK(a.shape() == b.shape(), "add: shapes differ: " + a.str() + " + " + b.str());
  Tensor out = backend_->empty(a.shape(), a.dtype());
  backend_->add(a, b, out);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&a, &b},
         [be](const Tensor& dout, const Grads& d) {
           // One fresh input takes dout's buffer itself (after the other has read it, when
           // that one accumulates); the other gets a copy.
           bool adopted = false;
           for (size_t i = 0; i < 2; ++i) {
             if (!adopted && d.adopt(i, dout)) {
               adopted = true;
               continue;
             }
             Tensor* g = d.raw(i);
             if (!g) continue;
             if (d.overwrite(i)) be->cast(dout, *g);  // a copy (converting if dtypes differ)
             else be->axpy(1.f, dout, *g);
           }
         });
  return out;
}

Tensor Graph::mul(const Tensor& a, const Tensor& b) {
  MT_CHECK(a.shape() == b.shape(), "mul: shapes differ: " + a.str() + " * " + b.str());
  Tensor out = backend_->empty(a.shape(), a.dtype());
  backend_->mul(a, b, out);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&a, &b},
         [be, a, b](const Tensor& dout, const Grads& d) {
           const Tensor* other[2] = {&b, &a};
           Tensor tmp;
           for (size_t i = 0; i < 2; ++i) {
             Tensor* g = d.raw(i);
             if (!g) continue;
             if (d.overwrite(i)) {
               be->mul(dout, *other[i], *g);
               continue;
             }
             if (!tmp.defined()) tmp = be->empty(dout.shape(), dout.dtype());
             be->mul(dout, *other[i], tmp);
             be->axpy(1.f, tmp, *g);
           }
         });
  return out;
}

Tensor Graph::scale(const Tensor& x, float s) {
  Tensor out = backend_->empty(x.shape(), x.dtype());
  backend_->scale(x, s, out);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&x},
         [be, s](const Tensor& dout, const Grads& d) {
           if (d.overwrite(0)) be->scale(dout, s, *d.raw(0));
           else be->axpy(s, dout, *d[0]);
         });
  return out;
}

Tensor Graph::reshape(const Tensor& x, const Shape& shape) {
  Tensor out = x.view(shape);
  Backend* be = backend_;
  const Shape xs = x.shape();
  record(record_, impl_->tape, out, {&x},
         [be, xs](const Tensor& dout, const Grads& d) {
           if (d.adopt(0, dout.view(xs))) return;  // the same numbers: no copy
           if (d.overwrite(0)) be->cast(dout.view(xs), *d.raw(0));
           else be->axpy(1.f, dout.view(xs), *d[0]);
         });
  return out;
}

Tensor Graph::cast(const Tensor& x, DType dtype) {
  Tensor out = backend_->empty(x.shape(), dtype);
  backend_->cast(x, out);
  Backend* be = backend_;
  const bool of_parameter = record_ && tracked(x) && x.grad_node()->leaf;
  record(record_, impl_->tape, out, {&x},
         [be](const Tensor& dout, const Grads& d) {
           // A fresh buffer (a parameter's master gradient at the first micro-batch) is
           // written by the conversion itself; otherwise dout is widened and added in one pass
           // (axpy converts per operand; bf16 -> f32 is exact, so the bits are those of a cast
           // followed by an add).
           if (d.overwrite(0)) be->cast(dout, *d.raw(0));
           else be->axpy(1.f, dout, *d[0]);
         });
  if (of_parameter) out.grad_node()->cast_of = x.grad_node();
  return out;
}

void Graph::set_vocab_part(const Tensor& table, int64_t first, int64_t vocab) {
  MT_CHECK(table.defined() && table.ndim() == 2 && first >= 0 && first + table.dim(0) <= vocab,
           "set_vocab_part: a table " + (table.defined() ? table.str() : std::string("(none)")) +
               " from row " + std::to_string(first) + " does not fit a vocabulary of " +
               std::to_string(vocab) + " tokens");
  impl_->vocab_table = table;
  impl_->vocab_first = first;
}

bool Graph::vocab_parallel() const {
  return impl_->vocab_table.defined();
}

void Graph::count_tensor_collectives(double* sum_bytes, double* gather_bytes) {
  impl_->planned_sum_bytes = sum_bytes;
  impl_->planned_gather_bytes = gather_bytes;
}

namespace {

// i32 values on the backend (undefined when there are none).
Tensor upload_i32(Backend& be, const std::vector<int32_t>& v) {
  if (v.empty()) return Tensor();
  Tensor t = be.empty({static_cast<int64_t>(v.size())}, DType::i32);
  be.copy_from_host(t, v.data());
  return t;
}

}  // namespace

Tensor Graph::embedding(const Tensor& table, const Tensor& ids) {
  MT_CHECK(table.ndim() == 2, "embedding table must be [V, D], got " + table.str());
  if (impl_->vocab_table.defined() && table.same_as(impl_->vocab_table)) {
    // This rank's rows of the vocabulary: the tokens whose id it holds get their rows, the others
    // zeros, and the group's sum is the whole lookup (x + 0 is exact).
    const int64_t n = ids.numel(), rows = table.dim(0), d = table.dim(1);
    std::vector<int32_t> at, local;  // those tokens, and their ids' rows here
    if (groups_.tensor) {
      std::vector<int32_t> host(static_cast<size_t>(n));
      backend_->copy_to_host(ids.view({n}), host.data());
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = static_cast<int64_t>(host[static_cast<size_t>(i)]) - impl_->vocab_first;
        if (r >= 0 && r < rows) {
          at.push_back(static_cast<int32_t>(i));
          local.push_back(static_cast<int32_t>(r));
        }
      }
    } else {  // the memory plan's trace: the shapes of a rank holding every token's id
      at.assign(static_cast<size_t>(n), 0);
      local.assign(static_cast<size_t>(n), 0);
    }
    Shape s = ids.shape();
    s.push_back(d);
    Tensor part = backend_->zeros(s, table.dtype());
    const Tensor at_t = upload_i32(*backend_, at), local_t = upload_i32(*backend_, local);
    const auto m = static_cast<int64_t>(at.size());
    if (m > 0) {
      Tensor found = backend_->empty({m, d}, table.dtype());
      backend_->embedding_forward(table, local_t, found);
      Tensor rows2 = part.view({n, d});
      backend_->scatter_rows(found, at_t, rows2);
    }
    Backend* be = backend_;
    record(record_, impl_->tape, part, {&table},
           [be, at_t, local_t, m, d](const Tensor& dout, const Grads& g) {
             Tensor* dtable = g[0];  // (zeroed when fresh, even if no token is this rank's)
             if (!dtable || m == 0) return;
             Tensor rows = be->empty({m, d}, dout.dtype());
             be->gather_rows(rows2d(dout), at_t, rows);
             be->embedding_backward(rows, local_t, *dtable);
           });
    return tensor_parallel_sum(part);
  }
  Shape s = ids.shape();
  s.push_back(table.dim(1));
  Tensor out = backend_->empty(s, table.dtype());
  const Tensor flat_ids = ids.view({ids.numel()});
  Tensor out2 = out.view({ids.numel(), table.dim(1)});
  backend_->embedding_forward(table, flat_ids, out2);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&table},
         [be, flat_ids](const Tensor& dout, const Grads& d) {
           be->embedding_backward(rows2d(dout), flat_ids, *d[0]);
         });
  return out;
}

Tensor Graph::embedding(const Params& p, std::string_view table, const Tensor& ids) {
  if (p.layout(table) != WeightLayout::q8) return embedding(p[table], ids);
  // Inference only: an int8 table has no gradient (and is never split among ranks).
  const Tensor& q = p.stored(table);
  const int64_t d = q.ndim() == 2 ? q8_row_values(q.dim(1)) : -1;
  MT_CHECK(d > 0, "embedding: the int8 table '" + std::string(table) + "' is " + q.str());
  Shape s = ids.shape();
  s.push_back(d);
  Tensor out = backend_->empty(s, p.dtype());
  Tensor out2 = out.view({ids.numel(), d});
  backend_->embedding_q8_forward(q, ids.view({ids.numel()}), out2);
  return out;
}

Tensor Graph::rmsnorm(const Tensor& x, const Tensor& w, float eps, bool plus_one) {
  Tensor out = backend_->empty(x.shape(), x.dtype());
  Tensor rstd = backend_->empty({x.numel() / x.dim(-1)}, DType::f32);
  backend_->rmsnorm_forward(x, w, eps, plus_one, out, rstd);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&x, &w},
         [be, x, w, rstd, plus_one](const Tensor& dout, const Grads& d) {
           Tensor dx = grad_or_scratch(*be, d, 0, x);
           Tensor dw = grad_or_scratch(*be, d, 1, w);
           be->rmsnorm_backward(dout, x, w, rstd, plus_one, dx, dw);
         });
  return out;
}

Tensor Graph::layernorm(const Tensor& x, const Tensor& w, const Tensor& b, float eps) {
  Tensor out = backend_->empty(x.shape(), x.dtype());
  const int64_t n = x.numel() / x.dim(-1);
  Tensor mean = backend_->empty({n}, DType::f32);
  Tensor rstd = backend_->empty({n}, DType::f32);
  backend_->layernorm_forward(x, w, b, eps, out, mean, rstd);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&x, &w, &b},
         [be, x, w, b, mean, rstd](const Tensor& dout, const Grads& d) {
           Tensor dx = grad_or_scratch(*be, d, 0, x);
           Tensor dw = grad_or_scratch(*be, d, 1, w);
           Tensor db = b.defined() ? grad_or_scratch(*be, d, 2, b) : Tensor();
           be->layernorm_backward(dout, x, w, mean, rstd, dx, dw, db);
         });
  return out;
}

Tensor Graph::rope(const Tensor& x, const Tensor& positions, const RopeSpec& spec) {
  Tensor out = backend_->empty(x.shape(), x.dtype());
  backend_->rope_forward(x, positions, spec, out);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&x},
         [be, positions, spec](const Tensor& dout, const Grads& d) {
           be->rope_backward(dout, positions, spec, *d[0]);
         });
  return out;
}

Tensor Graph::activation(Activation act, const Tensor& x) {
  Tensor out = backend_->empty(x.shape(), x.dtype());
  backend_->activation_forward(act, x, out);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&x},
         [be, act, x](const Tensor& dout, const Grads& d) {
           be->activation_backward(act, dout, x, *d[0]);
         });
  return out;
}

Tensor Graph::gated(Activation act, const Tensor& gate, const Tensor& up) {
  MT_CHECK(gate.shape() == up.shape(), "gated: shapes differ: " + gate.str() + ", " + up.str());
  Tensor out = backend_->empty(gate.shape(), gate.dtype());
  backend_->gated_forward(act, gate, up, out);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&gate, &up},
         [be, act, gate, up](const Tensor& dout, const Grads& d) {
           Tensor dg = grad_or_scratch(*be, d, 0, gate);
           Tensor du = grad_or_scratch(*be, d, 1, up);
           be->gated_backward(act, dout, gate, up, dg, du);
         });
  return out;
}

Tensor Graph::softcap(const Tensor& x, float cap) {
  Tensor out = backend_->empty(x.shape(), x.dtype());
  backend_->softcap_forward(x, cap, out);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&x},
         [be, out, cap](const Tensor& dout, const Grads& d) {
           be->softcap_backward(dout, Graph::detach(out), cap, *d[0]);
         });
  return out;
}

Tensor Graph::softmax(const Tensor& x) {
  Tensor out = backend_->empty(x.shape(), x.dtype());
  backend_->softmax_forward(x, out);
  Backend* be = backend_;
  // The closure holds a detached handle: holding `out` itself would keep its GradNode alive in
  // a cycle through the tape entry (harmless, but it hides the node's lifetime).
  Tensor saved = detach(out);
  record(record_, impl_->tape, out, {&x},
         [be, saved](const Tensor& dout, const Grads& d) {
           be->softmax_backward(dout, saved, *d[0]);
         });
  return out;
}

Tensor Graph::attention(AttentionKernel& kernel, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& q_segment, const Tensor& kv_segment,
                        const AttentionSpec& spec) {
  MT_CHECK(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4,
           "attention needs q [B, T, Hq, D], k and v [B, S, Hkv, D]; got " + q.str() + ", " +
               k.str() + ", " + v.str());
  Tensor out = backend_->empty(q.shape(), q.dtype());
  Tensor lse = backend_->empty({q.dim(0), q.dim(2), q.dim(1)}, DType::f32);
  kernel.forward(q, k, v, q_segment, kv_segment, spec, out, lse);
  Backend* be = backend_;
  Tensor saved = detach(out);
  AttentionKernel* kp = &kernel;
  record(record_, impl_->tape, out, {&q, &k, &v},
         [be, kp, q, k, v, q_segment, kv_segment, saved, lse, spec](
             const Tensor& dout, const Grads& d) {
           Tensor dq = grad_or_scratch(*be, d, 0, q);
           Tensor dk = grad_or_scratch(*be, d, 1, k);
           Tensor dv = grad_or_scratch(*be, d, 2, v);
           kp->backward(dout, q, k, v, q_segment, kv_segment, saved, lse, spec, dq, dk, dv);
         });
  return out;
}

namespace {
// x [B, T, entry...] as the rows to write, [n, w], and cache entry `entry` as rows of w values.
std::pair<Tensor, Tensor> cache_rows(const KVCache& cache, size_t entry, const Tensor& x) {
  MT_CHECK(entry < cache.tensors.size(), "write_cache: entry " + std::to_string(entry) + " of " +
                                             std::to_string(cache.tensors.size()));
  const Tensor& dst = cache.tensors[entry];
  const int64_t n = cache.write_rows.numel();
  MT_CHECK(dst.ndim() >= 2 && x.ndim() == dst.ndim() && x.dim(0) * x.dim(1) == n &&
               Shape(x.shape().begin() + 2, x.shape().end()) ==
                   Shape(dst.shape().begin() + 2, dst.shape().end()),
           "write_cache: new entries " + x.str() + " do not fit the cache " + dst.str() + " (" +
               std::to_string(n) + " rows to write)");
  const int64_t w = n ? x.numel() / n : 0;
  return {x.view({n, w}), dst.view({w ? dst.numel() / w : 0, w})};
}

bool int8_entry(const KVCache& cache, size_t entry) {
  return entry < cache.scales.size() && cache.scales[entry].defined();
}
}  // namespace

void Graph::write_cache(KVCache& cache, size_t entry, const Tensor& x) {
  // One scatter_rows per tensor. The caller never names a row twice in one call, except the
  // sink row, never read, where tokens a ring buffer would overwrite within the call go.
  auto [src, rows] = cache_rows(cache, entry, x);
  if (int8_entry(cache, entry)) {  // int8 rows and scales
    Tensor& s = cache.scales[entry];
    Tensor srows = s.view({rows.dim(0), s.dim(-1)});
    backend_->scatter_rows_q8(src, cache.write_rows, rows, srows);
    return;
  }
  backend_->scatter_rows(src, cache.write_rows, rows);
}

Tensor Graph::cache_values(const KVCache& cache, size_t entry, DType dtype) {
  const Tensor& t = cache.tensors.at(entry);
  if (entry >= cache.scales.size() || !cache.scales[entry].defined()) return t;
  const Tensor& s = cache.scales[entry];
  MT_CHECK(t.ndim() >= 2 && s.ndim() == 3 && s.dim(0) == t.dim(0) && s.dim(1) == t.dim(1),
           "cache_values: int8 rows " + t.str() + " with scales " + s.str() +
               " (want [B, rows, ...] and [B, rows, G])");
  const int64_t B = t.dim(0), rows = t.dim(1), G = s.dim(2);
  const int64_t c = rows ? t.numel() / (B * rows) : 0;
  // Each sequence's first `read` rows (all of them when read_rows is 0), as [B, read, ...].
  const int64_t read = cache.read_rows > 0 ? std::min(cache.read_rows, rows) : rows;
  Shape shape = t.shape();
  shape[1] = read;
  Tensor out = backend_->empty(shape, dtype);
  if (read == rows) {
    Tensor dst = out.view({B * rows, c});
    backend_->dequantize_rows_q8(t.view({B * rows, c}), s.view({B * rows, G}), dst);
    return out;
  }
  for (int64_t b = 0; b < B; ++b) {
    Tensor dst = out.slice0(b, b + 1).view({read, c});
    backend_->dequantize_rows_q8(t.slice0(b, b + 1).view({rows, c}).slice0(0, read),
                                 s.slice0(b, b + 1).view({rows, G}).slice0(0, read), dst);
  }
  return out;
}

void Graph::write_kv_cache(KVCache& cache, const Tensor& k, const Tensor& v) {
  MT_CHECK(cache.tensors.size() >= 2 && k.ndim() == 4 && v.ndim() == 4,
           "write_kv_cache: k " + k.str() + " and v " + v.str() + " for a cache of " +
               std::to_string(cache.tensors.size()) + " tensors (want k and v [B, T, Hkv, D])" +
               (cache.tensors.size() < 2
                    ? ": the layer writes a KV cache its DecoderLayer::cache_spec() does not "
                      "declare (an attention layer returns blocks::attention_cache_spec(spec))"
                    : std::string()));
  if (int8_entry(cache, 0) || int8_entry(cache, 1)) {
    write_cache(cache, 0, k);
    write_cache(cache, 1, v);
    return;
  }
  // Both in one op: one launch on a device.
  auto [ks, kr] = cache_rows(cache, 0, k);
  auto [vs, vr] = cache_rows(cache, 1, v);
  std::vector<Tensor> outs{kr, vr};
  backend_->scatter_rows_each({ks, vs}, cache.write_rows, outs);
}

Tensor Graph::cached_attention(AttentionKernel& kernel, const Tensor& q, const Tensor& k,
                               const Tensor& v, KVCache& cache, const AttentionSpec& spec) {
  if (cache.fresh) {
    Graph plain(*backend_, /*record=*/false);
    Tensor out = plain.attention(kernel, q, k, v, Tensor(), Tensor(), spec);
    write_kv_cache(cache, k, v);
    return out;
  }
  write_kv_cache(cache, k, v);
  return attention_decode(kernel, q, cache, spec);
}

Tensor Graph::attention_decode(AttentionKernel& kernel, const Tensor& q, const KVCache& cache,
                               const AttentionSpec& spec) {
  Tensor out = backend_->empty(q.shape(), q.dtype());
  // An int8 cache is widened to q's dtype first (every row of it: the kernels read the compute
  // dtype).
  kernel.decode(q, cache_values(cache, 0, q.dtype()), cache_values(cache, 1, q.dtype()),
                cache.lengths, spec, out);
  return out;
}

Tensor Graph::cross_entropy(const Tensor& logits, const Tensor& targets, float z_loss,
                            float weight) {
  if (!impl_->vocab_table.defined()) return row_cross_entropy(logits, targets, z_loss, weight);
  MT_CHECK(logits.ndim() == 2 && targets.numel() == logits.dim(0),
           "cross_entropy needs logits [N, V] and targets [N]; got " + logits.str() + ", " +
               targets.str());
  return vocab_cross_entropy(logits, targets, z_loss, weight);
}

Tensor Graph::row_cross_entropy(const Tensor& logits, const Tensor& targets, float z_loss,
                                float weight) {
  MT_CHECK(logits.ndim() == 2 && targets.numel() == logits.dim(0),
           "cross_entropy needs logits [N, V] and targets [N]; got " + logits.str() + ", " +
               targets.str());
  const int64_t n = logits.dim(0);
  Tensor loss = backend_->empty({n}, DType::f32);
  Tensor lse = backend_->empty({n}, DType::f32);
  const Tensor tg = targets.view({n});
  backend_->cross_entropy_forward(logits, tg, z_loss, loss, lse);
  Tensor total = backend_->empty({1}, DType::f32);
  backend_->fill(total, static_cast<float>(weight * backend_->sum(loss)));
  Backend* be = backend_;
  record(record_, impl_->tape, total, {&logits},
         [be, logits, tg, lse, z_loss, weight, n](const Tensor& dout,
                                                  const Grads& d) {
           float g = 0.f;
           be->copy_to_host(dout, &g);
           Tensor dloss = be->empty({n}, DType::f32);
           be->fill(dloss, g * weight);
           be->cross_entropy_backward(dloss, logits, tg, lse, z_loss, *d[0]);
         });
  return total;
}

Tensor Graph::vocab_cross_entropy(const Tensor& logits, const Tensor& targets, float z_loss,
                                  float weight) {
  const int64_t n = logits.dim(0), cols = logits.dim(1), first = impl_->vocab_first;
  MT_CHECK(cols == impl_->vocab_table.dim(0),
           "cross_entropy of a vocabulary-parallel model takes this rank's " +
               std::to_string(impl_->vocab_table.dim(0)) + " columns of the logits; got " +
               logits.str());
  Communicator* group = groups_.tensor;
  MT_CHECK(!group || first == static_cast<int64_t>(group->rank()) * cols,
           "cross_entropy: tensor rank " + std::to_string(group ? group->rank() : 0) +
               " holds vocabulary rows from " + std::to_string(first) + ", not from rank x " +
               std::to_string(cols));
  // Targets as this rank sees them: its own column for a target it holds; for the forward -1
  // otherwise (no loss here), for the backward `cols` (a column past the logits, set to a large
  // negative number, whose gradient is dropped) when another rank holds the target: that row's
  // gradient here is its softmax part alone, computed as one rank computes it.
  std::vector<int32_t> host(static_cast<size_t>(n), -1), fwd(host.size()), bwd(host.size());
  const Tensor tg = targets.view({n});
  if (group) backend_->copy_to_host(tg, host.data());
  for (size_t i = 0; i < host.size(); ++i) {
    const int64_t r = static_cast<int64_t>(host[i]) - first;
    const bool own = host[i] >= 0 && r >= 0 && r < cols;
    fwd[i] = own ? static_cast<int32_t>(r) : -1;
    bwd[i] = own ? static_cast<int32_t>(r) : host[i] >= 0 ? static_cast<int32_t>(cols) : -1;
  }
  const Tensor fwd_t = upload_i32(*backend_, fwd), bwd_t = upload_i32(*backend_, bwd);
  Tensor loss = backend_->empty({n}, DType::f32), lse_part = backend_->empty({n}, DType::f32);
  backend_->cross_entropy_forward(logits, fwd_t, 0.f, loss, lse_part);
  // Every rank's log-sum-exp and loss of each row (one all-gather); then each row's
  // log-sum-exp over the whole vocabulary (the ranks' combined in rank order, the same bits on
  // each) and its loss from the rank holding its target.
  Tensor lse = backend_->empty({n}, DType::f32);
  double sum = 0;
  if (group && n > 0) {
    backend_->synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    const int ranks = group->size(), rank = group->rank();
    const auto slot = static_cast<size_t>(2 * n);
    std::vector<float> all(slot * static_cast<size_t>(ranks));
    part_to_host(lse_part, 0, n, all.data() + static_cast<size_t>(rank) * slot);
    part_to_host(loss, 0, n,
                 all.data() + static_cast<size_t>(rank) * slot + static_cast<size_t>(n));
    group->all_gather(all.data(), all.size());
    std::vector<float> whole(static_cast<size_t>(n));
    for (size_t i = 0; i < whole.size(); ++i) {
      float m = -std::numeric_limits<float>::infinity();
      for (int r = 0; r < ranks; ++r) m = std::max(m, all[static_cast<size_t>(r) * slot + i]);
      double e = 0;
      for (int r = 0; r < ranks; ++r)
        e += std::exp(static_cast<double>(all[static_cast<size_t>(r) * slot + i]) - m);
      const float l = m + static_cast<float>(std::log(e));
      whole[i] = l;
      if (host[i] < 0) continue;
      // The holder's loss is lse_part - x[target]; the row's, l - x[target] + z l^2.
      const auto o = static_cast<size_t>(host[i] / cols);
      MT_CHECK(o < static_cast<size_t>(ranks),
               "cross_entropy: target " + std::to_string(host[i]) + " is outside the " +
                   std::to_string(cols * ranks) + "-token vocabulary of the tensor group");
      const float part = all[o * slot + i], part_loss = all[o * slot + static_cast<size_t>(n) + i];
      sum += static_cast<double>((l - part) + part_loss + z_loss * l * l);
    }
    part_from_host(lse, 0, n, whole.data());
    if (groups_.seconds)
      *groups_.seconds +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } else if (!group && impl_->planned_gather_bytes) {
    *impl_->planned_gather_bytes += 8.0 * static_cast<double>(n);  // a log-sum-exp and a loss
  }
  Tensor total = backend_->empty({1}, DType::f32);
  backend_->fill(total, static_cast<float>(weight * sum));
  Backend* be = backend_;
  record(record_, impl_->tape, total, {&logits},
         [be, logits, bwd_t, lse, z_loss, weight, n, cols](const Tensor& dout, const Grads& d) {
           float g = 0.f;
           be->copy_to_host(dout, &g);
           Tensor* dlogits = d[0];
           if (!dlogits || n == 0) return;
           Tensor dloss = be->empty({n}, DType::f32);
           be->fill(dloss, g * weight);
           // The logits with one more column, far below any logit (exp gives 0 there).
           Tensor wide = be->empty({n, cols + 1}, logits.dtype());
           Tensor low = be->empty({n, 1}, logits.dtype());
           be->fill(low, -1e30f);
           be->copy_columns(logits, 0, wide, 0, cols, false);
           be->copy_columns(low, 0, wide, cols, 1, false);
           Tensor dwide = be->zeros({n, cols + 1}, dlogits->dtype());
           be->cross_entropy_backward(dloss, wide, bwd_t, lse, z_loss, dwide);
           be->copy_columns(dwide, 0, *dlogits, 0, cols, true);
         });
  return total;
}

namespace {

// x summed over the group's ranks in rank order, through an f32 host buffer (a bf16 x is
// rounded once, after the sum); the seconds it took (after a synchronize: no compute) are
// added to *seconds when given.
Tensor sum_over(Backend& be, Communicator& group, const Tensor& x, double* seconds) {
  be.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<float> host(static_cast<size_t>(x.numel()));
  part_to_host(x, 0, x.numel(), host.data());
  group.all_reduce_sum(host.data(), host.size());
  Tensor out = be.empty(x.shape(), x.dtype());
  part_from_host(out, 0, out.numel(), host.data());
  if (seconds)
    *seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace

namespace {

// An identity's backward: dout becomes input 0's gradient (adopted, written or added).
void pass_gradient(Backend& be, const Tensor& dout, const Grads& d) {
  if (d.adopt(0, dout)) return;
  if (d.overwrite(0))
    be.cast(dout, *d.raw(0));
  else
    be.axpy(1.f, dout, *d[0]);
}

}  // namespace

Tensor Graph::tensor_parallel_input(const Tensor& x) {
  if (!groups_.tensor && impl_->planned_sum_bytes) {
    // The memory plan's trace: the same values, and the sum the backward would make counted.
    Tensor out = x.view(x.shape());
    Backend* be = backend_;
    double* bytes = impl_->planned_sum_bytes;
    const double n = static_cast<double>(x.numel());
    record(record_, impl_->tape, out, {&x}, [be, bytes, n](const Tensor& dout, const Grads& d) {
      *bytes += 4.0 * n;
      pass_gradient(*be, dout, d);
    });
    return out;
  }
  if (!groups_.tensor || groups_.tensor->size() == 1) return x;
  Tensor out = x.view(x.shape());  // the same values, a node of its own
  Backend* be = backend_;
  Communicator* group = groups_.tensor;
  double* seconds = groups_.seconds;
  const size_t before = impl_->tape.size();
  const Shape shape = x.shape();
  record(record_, impl_->tape, out, {&x},
         [be, group, seconds, shape](const Tensor& dout, const Grads& d) {
           Tensor grad = dout;
           if (!grad.defined()) {  // unused on this rank (a share with no tokens): zeros
             grad = be->empty(shape, DType::f32);
             be->fill(grad, 0.f);
           }
           const Tensor sum = sum_over(*be, *group, grad, seconds);
           if (d.overwrite(0))
             be->cast(sum, *d.raw(0));
           else
             be->axpy(1.f, sum, *d[0]);
         });
  // Every rank of the group joins the backward's sum, also where nothing used `out`.
  if (impl_->tape.size() > before) impl_->tape.back().collective = true;
  return out;
}

Tensor Graph::tensor_parallel_sum(const Tensor& x) {
  if (!groups_.tensor && impl_->planned_sum_bytes) *impl_->planned_sum_bytes += 4.0 * x.numel();
  if (!groups_.tensor || groups_.tensor->size() == 1) return x;
  Tensor out = sum_over(*backend_, *groups_.tensor, x, groups_.seconds);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&x},
         [be](const Tensor& dout, const Grads& d) { pass_gradient(*be, dout, d); });
  return out;
}

namespace {

// x's rows (undefined: zeros) to the ranks, send[r] of them to rank r, and the rows from them,
// recv[r] from rank r, as a [sum recv, row...] tensor of `dtype`: one all-to-all through f32
// host buffers. No group: the right shape, nothing moved.
Tensor exchange_rows(Backend& be, Communicator* group, const Tensor& x, const Shape& row,
                     DType dtype, const std::vector<int64_t>& send,
                     const std::vector<int64_t>& recv, double* seconds) {
  int64_t sent = 0, got = 0;
  for (const int64_t r : send) sent += r;
  for (const int64_t r : recv) got += r;
  const int64_t width = shape_numel(row);
  Shape s = row;
  s.insert(s.begin(), got);
  Tensor out = be.empty(s, dtype);
  if (!group) return out;
  be.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<float> in(static_cast<size_t>(sent * width), 0.f),
      host(static_cast<size_t>(got * width));
  if (x.defined()) part_to_host(x, 0, sent * width, in.data());
  const std::vector<size_t> sr(send.begin(), send.end()), rr(recv.begin(), recv.end());
  group->all_to_all(in.data(), sr, host.data(), rr, static_cast<size_t>(width));
  part_from_host(out, 0, got * width, host.data());
  if (seconds)
    *seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

// Adds (or writes, where the gradient is fresh) g into input i's gradient, if it has one.
void accumulate(Backend& be, const Tensor& g, const Grads& d, size_t i) {
  if (d.overwrite(i))
    be.cast(g, *d.raw(i));
  else if (Tensor* t = d[i])
    be.axpy(1.f, g, *t);
}

}  // namespace

Tensor Graph::expert_exchange(const Tensor& x, const std::vector<int64_t>& send_rows,
                              const std::vector<int64_t>& recv_rows) {
  const int ranks = groups_.expert_ranks;
  MT_CHECK(x.defined() && x.ndim() >= 1 && (x.dtype() == DType::f32 || x.dtype() == DType::bf16),
           "expert_exchange: " + (x.defined() ? x.str() : std::string("undefined")) +
               " (want f32 or bf16 rows)");
  int64_t sent = 0;
  bool counts_ok = send_rows.size() == static_cast<size_t>(ranks) &&
                   recv_rows.size() == static_cast<size_t>(ranks);
  for (size_t r = 0; counts_ok && r < send_rows.size(); ++r) {
    counts_ok = send_rows[r] >= 0 && recv_rows[r] >= 0;
    sent += send_rows[r];
  }
  MT_CHECK(counts_ok && sent == x.dim(0),
           "expert_exchange: " + x.str() + " sent as " + std::to_string(send_rows.size()) +
               " counts of rows summing to " + std::to_string(sent) + " (want one count per " +
               "expert rank, " + std::to_string(ranks) + ", summing to its rows)");
  if (ranks <= 1) {
    MT_CHECK(recv_rows[0] == sent, "expert_exchange: one rank receives what it sends");
    return x;
  }
  Backend& be = *backend_;
  Communicator* group = groups_.expert;
  double* seconds = groups_.seconds;
  const Shape row(x.shape().begin() + 1, x.shape().end());
  Tensor out = exchange_rows(be, group, x, row, x.dtype(), send_rows, recv_rows, seconds);
  if (!record_) return out;
  Entry e;
  e.inputs.push_back(tracked(x) ? x.grad_node() : nullptr);
  auto node = std::make_shared<GradNode>();
  node->shape = out.shape();
  node->dtype = out.dtype();
  out.set_grad_node(node);
  e.output = node;
  e.collective = true;
  e.backward = [&be, group, seconds, row, send_rows, recv_rows](const Tensor& dout,
                                                                const Grads& d) {
    // The gradient's rows go back where they came from.
    const Tensor back =
        exchange_rows(be, group, dout, row, DType::f32, recv_rows, send_rows, seconds);
    if (back.numel()) accumulate(be, back, d, 0);
  };
  impl_->tape.push_back(std::move(e));
  return out;
}

std::vector<int64_t> Graph::expert_gather_counts(const std::vector<int64_t>& mine) {
  const int ranks = groups_.expert_ranks, rank = groups_.expert_rank;
  if (ranks <= 1) return mine;
  const size_t n = mine.size();
  std::vector<int64_t> all(n * static_cast<size_t>(ranks));
  Communicator* group = groups_.expert;
  if (!group) {
    for (int r = 0; r < ranks; ++r)
      std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(n * r));
    return all;
  }
  const auto t0 = std::chrono::steady_clock::now();
  // A sum of one rank's row and zeros: exact in f64 for any count.
  std::vector<double> buf(all.size(), 0.0);
  for (size_t i = 0; i < n; ++i)
    buf[n * static_cast<size_t>(rank) + i] = static_cast<double>(mine[i]);
  group->all_reduce_sum(buf.data(), buf.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = std::llround(buf[i]);
  if (groups_.seconds)
    *groups_.seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return all;
}

Tensor Graph::remat(RematPolicy policy, const std::function<Tensor(Graph&, const Tensor&)>& f,
                    const Tensor& x) {
  // f by value: the backward's re-run calls it after this returns.
  return remat_layer(
             policy, [f](Graph& g, const Tensor& h) { return LayerOutput(f(g, h)); }, x)
      .x;
}

LayerOutput Graph::remat_layer(RematPolicy policy,
                               const std::function<LayerOutput(Graph&, const Tensor&)>& f,
                               const Tensor& x) {
  if (policy == RematPolicy::none || !record_) return f(*this, x);
  auto saved = std::make_shared<std::vector<Tensor>>();
  LayerOutput out;
  {
    Graph fwd(*backend_, /*record=*/false);
    fwd.groups_ = groups_;
    fwd.count_tensor_collectives(impl_->planned_sum_bytes, impl_->planned_gather_bytes);
    if (policy == RematPolicy::minimal) fwd.impl_->matmul_save = saved.get();
    out = f(fwd, x);
  }
  // Recorded as one entry whose input is x and whose outputs are y and the auxiliary losses;
  // the parameters inside f are tracked leaves, so the re-run's own backward accumulates
  // straight into their gradient buffers.
  Backend* be = backend_;
  const Groups groups = groups_;
  double* const sum_bytes = impl_->planned_sum_bytes;
  double* const gather_bytes = impl_->planned_gather_bytes;
  const Tensor xs = x;
  auto fn = f;
  const bool minimal = policy == RematPolicy::minimal;
  Entry e;
  e.inputs.push_back(tracked(x) ? x.grad_node() : nullptr);
  auto node = [](Tensor& t) {
    auto n = std::make_shared<GradNode>();
    n->shape = t.shape();
    n->dtype = t.dtype();
    t.set_grad_node(n);
    return n;
  };
  e.output = node(out.x);
  for (auto& a : out.aux) e.more_outputs.push_back(node(a.value));
  std::vector<std::shared_ptr<GradNode>> aux_nodes = e.more_outputs;
  e.backward = [be, groups, sum_bytes, gather_bytes, xs, fn, saved, minimal, aux_nodes](
                   const Tensor& dy, const Grads& d) {
    Graph re(*be, /*record=*/true);
    re.groups_ = groups;
    re.count_tensor_collectives(sum_bytes, gather_bytes);
    if (minimal) re.impl_->matmul_replay = saved.get();
    Tensor xr = detach(xs);
    const bool fresh = d.overwrite(0);
    if (Tensor* g = d.raw(0)) {
      // The re-run's gradient for x lands straight in x's buffer, keeping its freshness.
      track(xr, *g);
      xr.grad_node()->fresh = fresh;
    }
    LayerOutput r = fn(re, xr);
    MT_CHECK(r.aux.size() == aux_nodes.size(),
             "remat: the layer's re-run gave " + std::to_string(r.aux.size()) +
                 " auxiliary losses, its forward " + std::to_string(aux_nodes.size()));
    std::vector<std::pair<Tensor, Tensor>> roots;
    if (dy.defined() && tracked(r.x)) roots.emplace_back(r.x, dy);
    for (size_t i = 0; i < aux_nodes.size(); ++i)
      if (aux_nodes[i]->grad.defined() && tracked(r.aux[i].value))
        roots.emplace_back(r.aux[i].value, aux_nodes[i]->grad);
    if (!roots.empty()) re.backward(roots);
    if (d.raw(0)) finish_fresh(*be, xr);
  };
  impl_->tape.push_back(std::move(e));
  return out;
}

void Graph::backward(const Tensor& y, const Tensor& dy) {
  backward({{y, dy}});
}

void Graph::backward(const std::vector<std::pair<Tensor, Tensor>>& roots) {
  auto& tape = impl_->tape;
  // The seeds the caller owns: an entry must not accumulate into (or adopt) them.
  std::vector<const GradNode*> seeded;
  for (const auto& [y, dy] : roots) {
    MT_CHECK(tracked(y), "backward: " + y.str() + " does not depend on any tracked tensor");
    GradNode& root = *y.grad_node();
    Tensor seed = dy;
    if (seed.defined()) {
      MT_CHECK(dy.shape() == y.shape(), "backward: seed " + dy.str() + " for " + y.str());
    } else {
      MT_CHECK(y.numel() == 1, "backward without a seed needs a scalar, got " + y.str());
      seed = backend_->empty(y.shape(), y.dtype());
      backend_->fill(seed, 1.f);
    }
    // A root another root already seeded, or one some recorded op consumed (its gradient will
    // be accumulated into), gets a buffer of its own.
    bool consumed = root.grad.defined();
    for (size_t i = 0; i < tape.size() && !consumed; ++i)
      for (const auto& in : tape[i].inputs) consumed = consumed || in.get() == &root;
    if (!consumed) {
      root.grad = seed;
      if (dy.defined()) seeded.push_back(&root);
      continue;
    }
    if (!root.grad.defined()) {
      root.grad = backend_->empty(y.shape(), root.dtype);
      backend_->cast(seed, root.grad);
    } else {
      Tensor own = backend_->empty(y.shape(), root.dtype);
      backend_->cast(root.grad, own);
      backend_->axpy(1.f, seed, own);
      root.grad = own;
      seeded.erase(std::remove(seeded.begin(), seeded.end(), &root), seeded.end());
    }
  }
  auto has_grad = [](const Entry& e) {
    if (e.output->grad.defined()) return true;
    for (const auto& n : e.more_outputs)
      if (n->grad.defined()) return true;
    return false;
  };
  for (size_t i = tape.size(); i-- > 0;) {
    Entry& e = tape[i];
    if (has_grad(e) || (e.collective && e.backward)) {
      std::vector<GradNode*> nodes(e.inputs.size(), nullptr);
      for (size_t j = 0; j < e.inputs.size(); ++j) {
        GradNode* n = e.inputs[j].get();
        if (!n) continue;
        if (!n->grad.defined()) n->fresh = true;  // allocated when first asked for (Grads)
        nodes[j] = n;
      }
      const bool owned = std::find(seeded.begin(), seeded.end(), e.output.get()) == seeded.end();
      e.backward(e.output->grad, Grads(*backend_, std::move(nodes), owned));
      if (!e.output->leaf) e.output->grad = Tensor();
      for (auto& n : e.more_outputs)
        if (!n->leaf) n->grad = Tensor();
    }
    // Free what this entry saved as soon as it is done.
    e.backward = nullptr;
  }
  tape.clear();
}

}  // namespace mt
