// Graph's ops for the SDK v2 families: split and concat on the last dimension, and the ops of a
// mixture-of-experts layer (routing, row gathers and weighted scatter-adds, grouped matmuls),
// each with its backward. The recording conventions are graph.cpp's (graph_internal.h).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "graph_internal.h"
#include "mt/error.h"
#include "mt/graph.h"

namespace mt {

using namespace graph_detail;

namespace {

// The shape of x with its last dimension replaced.
Shape with_last(const Shape& s, int64_t last) {
  Shape r = s;
  r.back() = last;
  return r;
}

// A node for one of an entry's outputs (graph_internal.h's record() makes the first itself).
std::shared_ptr<GradNode> output_node(Tensor& t) {
  auto n = std::make_shared<GradNode>();
  n->shape = t.shape();
  n->dtype = t.dtype();
  t.set_grad_node(n);
  return n;
}

// [0, 1, ..., m) on the backend (the identity index of a row scaling done by scatter_add_rows).
Tensor iota(Backend& be, int64_t m) {
  std::vector<int32_t> v(static_cast<size_t>(m));
  std::iota(v.begin(), v.end(), 0);
  Tensor t = be.empty({m}, DType::i32);
  if (m) be.copy_from_host(t, v.data());
  return t;
}

}  // namespace

// ---- split and concat ---------------------------------------------------------------------------

std::vector<Tensor> Graph::split(const Tensor& x, const std::vector<int64_t>& sizes) {
  MT_CHECK(x.defined() && x.ndim() >= 1 && !sizes.empty(),
           "split: x " + (x.defined() ? x.str() : std::string("undefined")) + " into " +
               std::to_string(sizes.size()) + " pieces (want x [..., D] and at least one size)");
  std::string list;
  int64_t total = 0;
  bool ok = true;
  for (int64_t s : sizes) {
    list += (list.empty() ? "" : ", ") + std::to_string(s);
    ok = ok && s >= 0;
    total += s;
  }
  MT_CHECK(ok && total == x.dim(-1), "split: sizes [" + list + "] of x " + x.str() +
                                         " (want sizes >= 0 summing to its last dimension)");
  std::vector<Tensor> pieces;
  // One row not differentiated (a decode step of one sequence, its fused projection's output):
  // the pieces are views of x where each starts 16-byte aligned (the kernels' wide loads), no
  // copies.
  if (x.numel() == x.dim(-1) && !(record_ && tracked(x))) {
    const size_t elt = dtype_size(x.dtype());
    bool aligned = true;
    int64_t at = 0;
    for (int64_t s : sizes) {
      aligned = aligned && (static_cast<size_t>(at) * elt) % 16 == 0;
      at += s;
    }
    if (aligned) {
      const Tensor flat = x.view({x.numel()});
      at = 0;
      for (int64_t s : sizes) {
        pieces.push_back(flat.slice0(at, at + s).view(with_last(x.shape(), s)));
        at += s;
      }
      return pieces;
    }
  }
  std::vector<int64_t> cols;
  int64_t col = 0;
  for (int64_t s : sizes) {
    pieces.push_back(backend_->empty(with_last(x.shape(), s), x.dtype()));
    cols.push_back(col);
    col += s;
  }
  backend_->split_columns(x, pieces);  // one launch on a device (decode's fused projections)
  if (!record_ || !tracked(x)) return pieces;
  // One entry with every piece as an output: the backward writes x's gradient once, copying
  // into a fresh buffer when every piece has a gradient (no zero fill), else accumulating.
  Entry e;
  e.inputs.push_back(x.grad_node());
  e.output = output_node(pieces[0]);
  for (size_t i = 1; i < pieces.size(); ++i) e.more_outputs.push_back(output_node(pieces[i]));
  std::vector<std::shared_ptr<GradNode>> more = e.more_outputs;
  Backend* be = backend_;
  e.backward = [be, more, cols, sizes](const Tensor& dout, const Grads& d) {
    std::vector<const Tensor*> g;
    g.push_back(dout.defined() ? &dout : nullptr);
    for (const auto& n : more) g.push_back(n->grad.defined() ? &n->grad : nullptr);
    bool all = true;
    for (size_t i = 0; i < g.size(); ++i) all = all && (g[i] || sizes[i] == 0);
    const bool copy = all && d.overwrite(0);
    Tensor* dx = copy ? d.raw(0) : d[0];
    if (!dx) return;
    for (size_t i = 0; i < g.size(); ++i)
      if (g[i]) be->copy_columns(*g[i], 0, *dx, cols[i], sizes[i], /*accumulate=*/!copy);
  };
  impl_->tape.push_back(std::move(e));
  return pieces;
}

Tensor Graph::concat(const std::vector<Tensor>& xs) {
  MT_CHECK(!xs.empty(), "concat: no tensors");
  std::string list;
  bool ok = true;
  int64_t total = 0;
  for (const Tensor& t : xs) {
    list += (list.empty() ? "" : ", ") + (t.defined() ? t.str() : std::string("undefined"));
    ok = ok && t.defined() && t.ndim() == xs[0].ndim() && t.ndim() >= 1;
    if (!ok) continue;
    for (int i = 0; i + 1 < t.ndim(); ++i) ok = ok && t.dim(i) == xs[0].dim(i);
    total += t.dim(-1);
  }
  MT_CHECK(ok, "concat: " + list + " (want tensors [..., D_i] of one leading shape)");
  Tensor out = backend_->empty(with_last(xs[0].shape(), total), xs[0].dtype());
  std::vector<int64_t> cols, widths;
  int64_t col = 0;
  for (const Tensor& t : xs) {
    backend_->copy_columns(t, 0, out, col, t.dim(-1), /*accumulate=*/false);
    cols.push_back(col);
    widths.push_back(t.dim(-1));
    col += t.dim(-1);
  }
  std::vector<const Tensor*> inputs;
  for (const Tensor& t : xs) inputs.push_back(&t);
  Backend* be = backend_;
  record(record_, impl_->tape, out, inputs, [be, cols, widths](const Tensor& dout, const Grads& d) {
    for (size_t i = 0; i < d.size(); ++i) {
      if (!d.raw(i)) continue;
      const bool fresh = d.overwrite(i);
      be->copy_columns(dout, cols[i], *d.raw(i), 0, widths[i], /*accumulate=*/!fresh);
    }
  });
  return out;
}

// ---- mixture of experts -------------------------------------------------------------------------

Graph::Routing Graph::route(const Tensor& logits, int k, bool sigmoid, bool normalize) {
  MT_CHECK(logits.defined() && logits.ndim() >= 1,
           "route: logits " + (logits.defined() ? logits.str() : std::string("undefined")) +
               " (want [N, E])");
  const int64_t E = logits.dim(-1), N = E ? logits.numel() / E : 0;
  MT_CHECK(k >= 1 && k <= E, "route: k = " + std::to_string(k) + " for logits " + logits.str() +
                                 " (want 1 <= k <= E)");
  Routing r;
  r.weights = backend_->empty({N, k}, DType::f32);
  r.indices = backend_->empty({N, k}, DType::i32);
  r.probs = backend_->empty({N, E}, DType::f32);
  const Tensor l2 = logits.view({N, E});
  backend_->topk_route_forward(l2, k, sigmoid, normalize, r.weights, r.indices, r.probs);
  if (!record_ || !tracked(logits)) return r;
  // One entry with two outputs: the weights (output) and the scores (a further output, which the
  // load-balancing loss differentiates).
  Entry e;
  e.inputs.push_back(logits.grad_node());
  e.output = output_node(r.weights);
  e.more_outputs.push_back(output_node(r.probs));
  std::shared_ptr<GradNode> probs_node = e.more_outputs[0];
  Backend* be = backend_;
  const Tensor w = detach(r.weights), idx = r.indices, p = detach(r.probs);
  e.backward = [be, w, idx, p, sigmoid, normalize, probs_node, N, E](const Tensor& dout,
                                                                     const Grads& d) {
    Tensor* g = d[0];
    if (!g) return;
    Tensor dl = g->view({N, E});
    if (dout.defined()) be->topk_route_backward(dout, w, idx, p, sigmoid, normalize, dl);
    if (!probs_node->grad.defined()) return;
    const Tensor& dp = probs_node->grad;
    if (!sigmoid) {
      be->softmax_backward(dp, p, dl);  // dl += p * (dp - sum(dp * p))
      return;
    }
    // sigmoid: dl += dp * p * (1 - p) = dp p - (dp p) p
    Tensor a = be->empty({N, E}, DType::f32), b = be->empty({N, E}, DType::f32);
    be->mul(dp, p, a);
    be->mul(a, p, b);
    be->axpy(1.f, a, dl);
    be->axpy(-1.f, b, dl);
  };
  impl_->tape.push_back(std::move(e));
  return r;
}

Tensor Graph::gather_rows(const Tensor& x, const Tensor& idx) {
  MT_CHECK(x.defined() && x.ndim() >= 1 && idx.defined() && idx.dtype() == DType::i32,
           "gather_rows: x " + (x.defined() ? x.str() : std::string("undefined")) + ", idx " +
               (idx.defined() ? idx.str() : std::string("undefined")) +
               " (want x [N, D] and idx [M] i32)");
  const int64_t M = idx.numel(), D = x.dim(-1);
  Tensor out = backend_->empty({M, D}, x.dtype());
  const Tensor x2 = rows2d(x), id = idx.view({M});
  backend_->gather_rows(x2, id, out);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&x}, [be, id, D](const Tensor& dout, const Grads& d) {
    Tensor dx = d[0]->view({d[0]->numel() / std::max<int64_t>(D, 1), D});
    be->scatter_add_rows(dout, id, Tensor(), dx);
  });
  return out;
}

Tensor Graph::scatter_add_rows(const Tensor& src, const Tensor& idx, const Tensor& w,
                               int64_t rows) {
  MT_CHECK(src.defined() && src.ndim() >= 1 && idx.defined() && idx.dtype() == DType::i32 &&
               src.numel() == idx.numel() * src.dim(-1) && rows >= 0 &&
               (!w.defined() || w.numel() == idx.numel()),
           "scatter_add_rows: src " + (src.defined() ? src.str() : std::string("undefined")) +
               ", idx " + (idx.defined() ? idx.str() : std::string("undefined")) + ", w " +
               (w.defined() ? w.str() : std::string("none")) + " into " + std::to_string(rows) +
               " rows (want src [M, D], idx [M] i32, w [M] or none)");
  const int64_t M = idx.numel(), D = src.dim(-1);
  Tensor out = backend_->zeros({rows, D}, src.dtype());
  const Tensor s2 = src.view({M, D}), id = idx.view({M});
  const Tensor w1 = w.defined() ? w.view({M}) : Tensor();
  backend_->scatter_add_rows(s2, id, w1, out);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&src, &w},
         [be, s2, id, w1, M, D](const Tensor& dout, const Grads& d) {
           if (!d.raw(0) && !d.raw(1)) return;
           // Every source row's output gradient: g[m] = dout[idx[m]].
           Tensor g = be->empty({M, D}, dout.dtype());
           be->gather_rows(dout, id, g);
           if (d.raw(0) && !w1.defined()) {
             Tensor ds = d.raw(0)->view({M, D});
             if (d.overwrite(0))
               be->cast(g, ds);
             else
               be->axpy(1.f, g, ds);
           } else if (d.raw(0)) {
             // dsrc[m] += w[m] g[m]: a weighted scatter onto the identity index.
             Tensor ds = d[0]->view({M, D});
             be->scatter_add_rows(g, iota(*be, M), w1, ds);
           }
           if (d.raw(1)) {
             // dw[m] += <g[m], src[m]>: the products' row sums as a product with ones.
             Tensor prod = be->empty({M, D}, DType::f32);
             be->mul(g, s2, prod);
             Tensor ones = be->empty({D, 1}, DType::f32);
             be->fill(ones, 1.f);
             const float beta = d.overwrite(1) ? 0.f : 1.f;
             Tensor dw = d.raw(1)->view({M, 1});
             be->matmul(prod, ones, dw, false, false, 1.f, beta);
           }
         });
  return out;
}

Tensor Graph::grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets,
                             bool trans_w) {
  MT_CHECK(x.defined() && x.ndim() >= 1 && w.defined() && w.ndim() == 3 && offsets.defined(),
           "grouped_matmul: x " + (x.defined() ? x.str() : std::string("undefined")) + ", w " +
               (w.defined() ? w.str() : std::string("undefined")) +
               " (want x [M, K], w [E, K, N] or [E, N, K] and offsets [E + 1])");
  const int64_t K = trans_w ? w.dim(2) : w.dim(1), N = trans_w ? w.dim(1) : w.dim(2);
  MT_CHECK(x.dim(-1) == K, "grouped_matmul: x " + x.str() + " @ w " + w.str() +
                               (trans_w ? "^T" : "") + ": inner dimensions differ");
  const int64_t M = x.numel() / std::max<int64_t>(K, 1);
  Tensor out = backend_->empty(with_last(x.shape(), N), x.dtype());
  const Tensor x2 = x.view({M, K});
  Tensor o2 = out.view({M, N});
  backend_->grouped_matmul(x2, w, offsets, trans_w, o2);
  Backend* be = backend_;
  record(record_, impl_->tape, out, {&x, &w},
         [be, x2, w, offsets, trans_w, M, K, N](const Tensor& dout, const Grads& d) {
           const Tensor d2 = dout.view({M, N});
           if (d.raw(0)) {
             // dx = dout @ w[e]^T per expert: the same kernel with the weight transposed.
             if (d.overwrite(0)) {
               Tensor dx = d.raw(0)->view({M, K});
               be->grouped_matmul(d2, w, offsets, !trans_w, dx);
             } else {
               Tensor tmp = be->empty({M, K}, d.raw(0)->dtype());
               be->grouped_matmul(d2, w, offsets, !trans_w, tmp);
               be->axpy(1.f, tmp, *d[0]);
             }
           }
           // dw[e] += x_e^T dout_e; a parameter's bf16 copy writes into the f32 master's buffer.
           bool fresh = false;
           Tensor* dw = d.master(1, fresh);
           if (dw) {
             if (fresh) be->fill(*dw, 0.f);
           } else {
             dw = d[1];
           }
           if (dw) be->grouped_matmul_weight_grad(x2, d2, offsets, trans_w, *dw);
         });
  return out;
}

Graph::ExpertOrder Graph::sort_by_expert(const Tensor& indices, int64_t num_experts) {
  return sort_by_expert(indices, num_experts, -1, 0);
}

Graph::ExpertOrder Graph::sort_by_expert(const Tensor& indices, int64_t num_experts,
                                         int64_t capacity, int64_t group_size) {
  MT_CHECK(
      indices.defined() && indices.dtype() == DType::i32 && indices.ndim() >= 1 && num_experts >= 1,
      "sort_by_expert: indices " + (indices.defined() ? indices.str() : std::string("undefined")) +
          " for " + std::to_string(num_experts) + " experts (want indices [N, k] i32)");
  const int64_t M = indices.numel(), k = indices.dim(-1);
  MT_CHECK(M < INT_MAX && k >= 1, "sort_by_expert: indices " + indices.str() +
                                      " (want [N, k] with k >= 1 and fewer than 2^31 slots)");
  const int64_t N = M / k;
  const bool dropping = capacity >= 0;
  MT_CHECK(!dropping || (group_size >= 1 && N % group_size == 0),
           "sort_by_expert: capacity " + std::to_string(capacity) + " per group of " +
               std::to_string(group_size) + " tokens for indices " + indices.str() +
               " (want groups that divide the " + std::to_string(N) + " tokens)");
  std::vector<int32_t> id(static_cast<size_t>(M));
  if (M) backend_->copy_to_host(indices, id.data());
  ExpertOrder r;
  const auto E = static_cast<size_t>(num_experts);
  r.counts.assign(E, 0);
  r.routed.assign(E, 0);
  // keep[m]: slot m is computed. Dropping: the m-th slot's place in its expert's queue within its
  // group (slots in order: token by token, a token's choices by rank) is at most `capacity`.
  std::vector<char> keep(static_cast<size_t>(M), 1);
  std::vector<int64_t> in_group(E, 0);
  const int64_t group_slots = dropping ? group_size * k : 0;
  for (int64_t m = 0; m < M; ++m) {
    const int32_t e = id[static_cast<size_t>(m)];
    MT_CHECK(e >= 0 && e < num_experts, "sort_by_expert: indices[" + std::to_string(m) +
                                            "] = " + std::to_string(e) + " is outside [0, " +
                                            std::to_string(num_experts) + ")");
    const auto ue = static_cast<size_t>(e);
    ++r.routed[ue];
    if (dropping) {
      if (m % group_slots == 0) std::fill(in_group.begin(), in_group.end(), 0);
      if (++in_group[ue] > capacity) {
        keep[static_cast<size_t>(m)] = 0;
        continue;
      }
    }
    ++r.counts[ue];
  }
  // A stable counting sort of the kept slots by expert.
  std::vector<int32_t> offsets(E + 1, 0);
  for (size_t e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + static_cast<int32_t>(r.counts[e]);
  const int64_t kept = offsets[E];
  std::vector<int32_t> next(offsets.begin(), offsets.end() - 1);
  std::vector<int32_t> slots(static_cast<size_t>(kept)), tokens(static_cast<size_t>(kept));
  for (int64_t m = 0; m < M; ++m) {
    if (!keep[static_cast<size_t>(m)]) continue;
    const int32_t at = next[static_cast<size_t>(id[static_cast<size_t>(m)])]++;
    slots[static_cast<size_t>(at)] = static_cast<int32_t>(m);
    tokens[static_cast<size_t>(at)] = static_cast<int32_t>(m / k);
  }
  r.slots = backend_->empty({kept}, DType::i32);
  r.tokens = backend_->empty({kept}, DType::i32);
  r.offsets = backend_->empty({num_experts + 1}, DType::i32);
  if (kept) {
    backend_->copy_from_host(r.slots, slots.data());
    backend_->copy_from_host(r.tokens, tokens.data());
  }
  backend_->copy_from_host(r.offsets, offsets.data());
  return r;
}

}  // namespace mt
