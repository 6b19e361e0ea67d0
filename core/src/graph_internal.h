// Graph's internals, shared by the files that define its ops (graph.cpp, graph_*.cpp): the
// tape, the gradient buffers an op's backward sees, and the recording helper. Not part of the
// SDK: plugins see graph.h only.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mt/error.h"
#include "mt/graph.h"

namespace mt {
namespace graph_detail {

// The gradient buffers of an entry's inputs as its backward sees them. d[i] is input i's
// buffer ready to accumulate into (zero-filled first if it was fresh), or nullptr when the input
// needs no gradient. Ops that can overwrite instead (matmul with beta = 0, copies) ask
// overwrite(i) first, which says whether the buffer is fresh and takes the freshness away. A
// fresh intermediate's buffer is only allocated when first asked for, so an op whose input
// gradient equals (a view of) its output gradient can adopt(i, dout) instead: no copy at all.
class Grads {
 public:
  Grads(Backend& be, std::vector<GradNode*> nodes, bool dout_owned)
      : be_(&be), nodes_(std::move(nodes)), dout_owned_(dout_owned) {}
  size_t size() const { return nodes_.size(); }
  Tensor* operator[](size_t i) const {
    GradNode* n = nodes_[i];
    if (!n) return nullptr;
    allocate(n);
    if (n->fresh) {
      be_->fill(n->grad, 0.f);
      n->fresh = false;
    }
    return &n->grad;
  }
  bool overwrite(size_t i) const {
    GradNode* n = nodes_[i];
    if (!n || !n->fresh) return false;
    allocate(n);
    n->fresh = false;
    return true;
  }
  Tensor* raw(size_t i) const {
    GradNode* n = nodes_[i];
    if (!n) return nullptr;
    allocate(n);
    return &n->grad;
  }
  // When input i is a recorded cast of a parameter: that parameter's gradient buffer, with
  // `overwrite` saying whether it is fresh (and taking the freshness away). The cast's own
  // entry then finds no gradient for its output (unless another consumer gave one) and adds
  // nothing.
  Tensor* master(size_t i, bool& overwrite) const {
    GradNode* n = nodes_[i];
    if (!n || !n->cast_of || !n->cast_of->leaf) return nullptr;
    GradNode* s = n->cast_of.get();
    if (!s->grad.defined()) {  // a leaf whose buffer is made on first use (FSDP's gathers)
      s->grad = be_->empty(s->shape, s->dtype);
      s->fresh = true;
    }
    overwrite = s->fresh;
    s->fresh = false;
    return &s->grad;
  }
  // Makes `g` input i's gradient buffer when that input is a fresh intermediate (never a
  // parameter's buffer, never the caller's seed): the entry's output gradient g views is dead
  // once this entry is done, so later accumulations into it harm nothing.
  bool adopt(size_t i, const Tensor& g) const {
    GradNode* n = nodes_[i];
    if (!n || !n->fresh || n->leaf || n->grad.defined() || !dout_owned_ || g.dtype() != n->dtype ||
        g.shape() != n->shape)
      return false;
    n->grad = g;
    n->fresh = false;
    return true;
  }

 private:
  void allocate(GradNode* n) const {
    if (!n->grad.defined()) n->grad = be_->empty(n->shape, n->dtype);
  }
  Backend* be_;
  std::vector<GradNode*> nodes_;
  bool dout_owned_;  // the output gradient is the graph's own buffer, not the caller's seed
};

struct Entry {
  std::vector<std::shared_ptr<GradNode>> inputs;  // null where an input needs no gradient
  std::shared_ptr<GradNode> output;
  // Further outputs (a rematerialised layer's auxiliary losses): the entry's backward runs when
  // any output has a gradient, and reads these nodes' gradients itself. dout is undefined when
  // only further outputs have one.
  std::vector<std::shared_ptr<GradNode>> more_outputs;
  std::function<void(const Tensor& dout, const Grads& dins)> backward;
  // A collective every rank must make: the backward runs even when no output has a gradient
  // (dout undefined: zeros).
  bool collective = false;
};

inline bool tracked(const Tensor& t) {
  return t.defined() && t.grad_node() != nullptr;
}

// Records `out` as produced from `inputs` when the graph records and some input is tracked.
inline void record(bool on, std::vector<Entry>& tape, Tensor& out,
                   std::vector<const Tensor*> inputs,
                   std::function<void(const Tensor&, const Grads&)> bw) {
  if (!on) return;
  bool any = false;
  for (const Tensor* t : inputs) any = any || tracked(*t);
  if (!any) return;
  Entry e;
  for (const Tensor* t : inputs) e.inputs.push_back(tracked(*t) ? t->grad_node() : nullptr);
  auto node = std::make_shared<GradNode>();
  node->shape = out.shape();
  node->dtype = out.dtype();
  out.set_grad_node(node);
  e.output = std::move(node);
  e.backward = std::move(bw);
  tape.push_back(std::move(e));
}

inline Shape matmul_shape(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  MT_CHECK(a.ndim() >= 2 && b.ndim() >= 2,
           "matmul needs matrices, got " + a.str() + " and " + b.str());
  const int64_t m = ta ? a.dim(-1) : a.dim(-2);
  const int64_t ka = ta ? a.dim(-2) : a.dim(-1);
  const int64_t kb = tb ? b.dim(-1) : b.dim(-2);
  const int64_t n = tb ? b.dim(-2) : b.dim(-1);
  MT_CHECK(ka == kb, "matmul inner dimensions differ: " + a.str() + (ta ? "^T" : "") + " @ " +
                         b.str() + (tb ? "^T" : ""));
  Shape s(a.shape().begin(), a.shape().end() - 2);
  s.push_back(m);
  s.push_back(n);
  return s;
}

// 2-D view with the leading dimensions flattened into rows.
inline Tensor rows2d(const Tensor& t) {
  return t.view({t.numel() / t.dim(-1), t.dim(-1)});
}

// The gradient buffer for input i, or a zeroed scratch tensor when that input needs none
// (kernels always write every gradient they compute).
inline Tensor grad_or_scratch(Backend& be, const Grads& d, size_t i, const Tensor& like) {
  if (d[i]) return *d[i];
  return be.zeros(like.shape(), like.dtype());
}

}  // namespace graph_detail

struct Graph::Impl {
  std::vector<graph_detail::Entry> tape;
  // remat_policy=minimal: the forward pass saves matmul outputs in order; the re-run in the
  // backward replays them instead of recomputing.
  std::vector<Tensor>* matmul_save = nullptr;
  const std::vector<Tensor>* matmul_replay = nullptr;
  size_t replay_pos = 0;
  // Graph::set_vocab_part: this rank's rows of the embedding and where they start.
  Tensor vocab_table;
  int64_t vocab_first = 0;
  // Graph::count_tensor_collectives (the memory plan's trace), passed on to remat's graphs.
  double* planned_sum_bytes = nullptr;
  double* planned_gather_bytes = nullptr;
};

}  // namespace mt
