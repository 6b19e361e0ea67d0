// Graph: the differentiable op set model plugins write their forward passes with.
//
// Each op runs its backend's forward kernel at once (eager) and, while the graph records and
// some input needs a gradient, appends an entry to the tape that knows how to run the matching
// backward kernels. backward() replays the tape in reverse, accumulating into each tensor's
// gradient; parameters marked with track() accumulate into the gradient buffers they were given
// (so gradient accumulation over micro-batches is free).
//
// Rematerialisation (remat_policy) is the core's, at decoder-layer granularity: see remat().
#pragma once

#include <functional>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/export.h"
#include "mt/model.h"
#include "mt/tensor.h"

namespace mt {

// Autograd identity of a tensor: its gradient, allocated on first use.
struct GradNode {
  Shape shape;
  DType dtype = DType::f32;
  Tensor grad;        // undefined until some consumer's backward produced a gradient
  // A tracked parameter: its grad is the caller's buffer, never freed by backward (FSDP's
  // gathered whole weights are leaves too, their buffer made on first use, freed by the
  // gather's own backward).
  bool leaf = false;
  // The buffer's contents are undefined: the first backward to reach it overwrites it (a matmul
  // with beta = 0, a copy) instead of zero-filling and accumulating. Leaves may be marked fresh
  // at the start of a step to skip zeroing parameter gradients (see Graph::finish_fresh).
  bool fresh = false;
  // On the output of a recorded cast of a parameter (mixed precision's bf16 copy of an f32
  // master): the parameter's node. A matmul's gradient for that operand goes straight into the
  // parameter's buffer, in its dtype (Megatron's gradient-accumulation fusion), instead of
  // through a bf16 gradient and the cast's backward.
  std::shared_ptr<GradNode> cast_of;
};

enum class RematPolicy : uint8_t { none, minimal, full };
bool parse_remat_policy(const std::string& s, RematPolicy& out);

class Communicator;

class MT_API Graph {
 public:
  explicit Graph(Backend& backend, bool record = true);
  ~Graph();
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  Backend& backend() const { return *backend_; }
  bool recording() const { return record_; }

  // ---- tensor parallelism (Megatron) ----------------------------------------------------------
  // The ranks a layer's split weights are divided among (set by the core; remat's graphs inherit
  // it); null or one rank: both ops below are the identity and cost nothing. `seconds`, when
  // given, accumulates the time the sums take (with their host copies).
  void set_tensor_group(Communicator* group, double* seconds = nullptr) {
    groups_.tensor = group;
    groups_.seconds = seconds;
  }
  Communicator* tensor_group() const { return groups_.tensor; }
  // Before a column-parallel projection (wq, w_gate, ...): x itself; the backward sums x's
  // gradient over the group (each rank's part of the projection contributes its share).
  Tensor tensor_parallel_input(const Tensor& x);
  // After a row-parallel projection (wo, w_down, ...): the sum of every rank's x, in rank order
  // (the same bits on each); the backward passes the gradient through.
  Tensor tensor_parallel_sum(const Tensor& x);

  // ---- what the caller keeps of a layer's output ------------------------------------------------
  // False where nothing will read the layers' auxiliary losses, metrics and statistics
  // (LayerOutput::aux and ::stats): decode, scoring, evaluation. A layer may then leave them out
  // (blocks::moe skips its router losses and load metrics, and the host copy of the routing they
  // need). Set by the core for each layer it runs; true by default; remat's graphs inherit it.
  void set_wants_aux(bool on) { groups_.wants_aux = on; }
  bool wants_aux() const { return groups_.wants_aux; }

  // ---- vocabulary parallelism (logical_axis_rules "vocab:tensor") -----------------------------
  // `table` holds rows [first, first + table.dim(0)) of the embedding of a `vocab`-token
  // vocabulary: this rank's part, the tensor group's ranks holding the others in rank order.
  // Then embedding(table, ids) looks up the ids this rank holds (zeros for the others) and sums
  // the group's rows, which is the whole table's lookup exactly (each row comes from one rank);
  // blocks::lm_head gives this rank's columns of the logits; and cross_entropy over such logits
  // combines the ranks' log-sum-exps (one all-gather of two values a row), the whole
  // vocabulary's loss. Set by the core with the tensor group (none: the memory plan's trace,
  // which makes the shapes and communicates nothing).
  void set_vocab_part(const Tensor& table, int64_t first, int64_t vocab);
  bool vocab_parallel() const;
  // The memory plan's trace (no tensor group): the f32 bytes every tensor-parallel sum above
  // would all-reduce, forward and backward, are added to *sum_bytes, and each rank's bytes of
  // the all-gathers to *gather_bytes (remat's graphs count theirs too). Set by the core.
  void count_tensor_collectives(double* sum_bytes, double* gather_bytes);

  // ---- expert parallelism (MaxText's expert axis) ----------------------------------------------
  // The `ranks` ranks (this one the `rank`-th) among which blocks::moe's experts are divided,
  // each with a batch of its own (set by the core; remat's graphs inherit it). `group` null with
  // ranks > 1: the memory plan's trace (the ops below make tensors of the right shapes and
  // communicate nothing). One rank: both ops are the identity.
  // `tensor_ranks` > 1: the group spans that many tensor ranks of each batch (rank x
  // tensor_ranks + t, the tensor ranks innermost), which hold the same tokens: each dispatches
  // its share of them and the tensor group sums the shares' outputs.
  void set_expert_group(Communicator* group, int ranks, int rank, int tensor_ranks = 1) {
    groups_.expert = group;
    groups_.expert_ranks = ranks;
    groups_.expert_rank = rank;
    groups_.expert_tensor_ranks = tensor_ranks;
  }
  Communicator* expert_group() const { return groups_.expert; }
  int expert_ranks() const { return groups_.expert_ranks; }
  int expert_rank() const { return groups_.expert_rank; }
  int expert_tensor_ranks() const { return groups_.expert_tensor_ranks; }
  // All-to-all (blocks::moe's dispatch and combine): x's rows (f32 or bf16 [rows, ...], rows =
  // the sum of send_rows; may be 0) go send_rows[r] to expert rank r, one rank's after another;
  // the result holds recv_rows[r] rows from rank r, in rank order (recv_rows[r] must be what
  // rank r sends here: expert_gather_counts tells it). The backward sends the gradient back the
  // same way. Recorded on every rank whenever the graph records, and its backward runs whether
  // or not a gradient reached it (zeros then), so every rank makes the same collectives even
  // where it sends or receives nothing. No group (the plan's trace): rows of the right count.
  Tensor expert_exchange(const Tensor& x, const std::vector<int64_t>& send_rows,
                         const std::vector<int64_t>& recv_rows);
  // Every expert rank's `mine` (the same length on each), one after another in rank order (no
  // gradient); no group: `mine` repeated, as if every rank had the same.
  std::vector<int64_t> expert_gather_counts(const std::vector<int64_t>& mine);

  // Marks `param` as a leaf whose gradient accumulates (+=) into `grad` (same shape).
  static void track(Tensor& param, Tensor grad);
  // A new handle to the same data with no autograd history (gradients stop here).
  static Tensor detach(const Tensor& x);

  // ---- differentiable ops (shapes as the backend kernels, backend.h) ------------------------
  // a [..., M, K] (or [..., K, M] with trans_a), b [K, N] (shared) or [..., K, N] batched
  // (transposed with trans_b). A shared 2-D b requires trans_a == false.
  Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);
  // x @ w for the projection weight `w` of p ([K, N]), in whichever layout it is stored
  // (Params::transposed: [N, K] for inference, as ParamSpec::projection allows).
  Tensor project(const Tensor& x, const Params& p, std::string_view w);
  // grouped_matmul(x, w, offsets) for the expert projection weight `w` of p ([E, K, N]), in
  // whichever layout inference stored it ([E, N, K] transposed, or each expert's int8 rows:
  // Params::layout); `counts` (the rows of each expert, on the host: ExpertOrder::counts) must
  // agree with `offsets`. Int8 weights have no gradient: inference only.
  Tensor grouped_project(const Tensor& x, const Params& p, std::string_view w,
                         const Tensor& offsets, const std::vector<int64_t>& counts);
  Tensor add(const Tensor& a, const Tensor& b);
  Tensor mul(const Tensor& a, const Tensor& b);
  Tensor scale(const Tensor& x, float s);
  Tensor reshape(const Tensor& x, const Shape& shape);
  Tensor cast(const Tensor& x, DType dtype);
  Tensor embedding(const Tensor& table, const Tensor& ids);  // ids [B, T] -> [B, T, D]
  // The same for the table `table` of p (ParamSpec::table) in whichever layout it is stored:
  // as declared, or int8 rows (quantization=int8, a tied table: inference only), widened to
  // p.dtype() row by row (Backend::embedding_q8_forward).
  Tensor embedding(const Params& p, std::string_view table, const Tensor& ids);
  Tensor rmsnorm(const Tensor& x, const Tensor& w, float eps, bool plus_one = false);
  Tensor layernorm(const Tensor& x, const Tensor& w, const Tensor& b, float eps);
  Tensor rope(const Tensor& x, const Tensor& positions, const RopeSpec& spec);
  Tensor activation(Activation act, const Tensor& x);
  Tensor gated(Activation act, const Tensor& gate, const Tensor& up);
  Tensor softcap(const Tensor& x, float cap);
  Tensor softmax(const Tensor& x);
  // q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D]
  Tensor attention(AttentionKernel& kernel, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& q_segment, const Tensor& kv_segment, const AttentionSpec& spec);
  // Decode (not differentiable). write_kv_cache stores k, v [B, T, Hkv, D] at cache.write_rows
  // (overwriting: a sliding-window cache is a ring buffer); write_cache stores x [B, T, entry...]
  // into any one of the cache's tensors the same way. cached_attention is what an attention layer
  // calls: for a fresh cache the tokens attend among themselves (spec's causal/window masks) and
  // are stored; otherwise they are stored and q [B, T, Hq, D] attends to the cache's valid rows.
  // An int8 cache (KVCache::scales) is quantized as it is written, and widened to the compute
  // dtype when read: cache_values gives entry i's tensor in `dtype` (itself when not int8).
  void write_cache(KVCache& cache, size_t entry, const Tensor& x);
  void write_kv_cache(KVCache& cache, const Tensor& k, const Tensor& v);
  Tensor cache_values(const KVCache& cache, size_t entry, DType dtype);
  Tensor attention_decode(AttentionKernel& kernel, const Tensor& q, const KVCache& cache,
                          const AttentionSpec& spec);
  Tensor cached_attention(AttentionKernel& kernel, const Tensor& q, const Tensor& k,
                          const Tensor& v, KVCache& cache, const AttentionSpec& spec);
  // logits [N, V], targets [N] i32 -> scalar [1] f32 = weight * sum of per-row losses
  // (rows with target < 0 count 0). weight = 1 / (number of counted rows) gives the mean.
  Tensor cross_entropy(const Tensor& logits, const Tensor& targets, float z_loss, float weight);
  // cross_entropy over each row's logits as given, also in a vocabulary-parallel model: for
  // logits that are not the vocabulary's (a router's z-loss), which cross_entropy would take for
  // this rank's columns of the vocabulary there.
  Tensor row_cross_entropy(const Tensor& logits, const Tensor& targets, float z_loss, float weight);

  // ---- split and concat on the last dimension (graph_ops.cpp; Backend::copy_columns) --------
  // x [..., D] -> pieces [..., sizes[i]], the sizes (each >= 0) summing to D; each piece is a
  // new tensor in x's dtype.
  std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes);
  // xs[i] [..., D_i], all of one leading shape -> [..., sum of D_i] in xs[0]'s dtype.
  Tensor concat(const std::vector<Tensor>& xs);

  // ---- mixture of experts (graph_ops.cpp) ---------------------------------------------------
  struct Routing {
    Tensor weights;  // [N, k] f32: the chosen experts' weights (differentiable)
    Tensor indices;  // [N, k] i32: the chosen experts, by descending score
    Tensor probs;    // [N, E] f32: every expert's score, softmax or sigmoid (differentiable)
  };
  // logits [N, E] (any leading shape) -> top-k routing (Backend::topk_route_forward).
  Routing route(const Tensor& logits, int k, bool sigmoid, bool normalize);
  // x [N, D], idx [M] i32 in [0, N) -> [M, D]: out[m] = x[idx[m]]
  Tensor gather_rows(const Tensor& x, const Tensor& idx);
  // src [M, D], idx [M] i32 in [0, rows), w [M] f32 or undefined (all 1) -> [rows, D] in src's
  // dtype: out[r] = sum over m with idx[m] = r of w[m] * src[m]. Differentiable in src and w.
  Tensor scatter_add_rows(const Tensor& src, const Tensor& idx, const Tensor& w, int64_t rows);
  // x [M, K] with rows grouped by expert (rows offsets[e]..offsets[e+1] use w[e]), w [E, K, N]
  // ([E, N, K] if trans_w), offsets [E + 1] i32 -> [M, N]. Differentiable in x and w.
  Tensor grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets,
                        bool trans_w = false);
  // Token copies sorted by expert, for a dropless MoE layer: from indices [N, k] i32 (route's),
  // the M = N k token-slots (n * k + j) ordered by expert (stably, so by slot within an expert).
  // Computed on the host (the indices are read back: one synchronisation per layer); a device
  // sort can replace it without changing the interface.
  struct ExpertOrder {
    Tensor slots;                 // [M] i32: the token-slot of each sorted row
    Tensor tokens;                // [M] i32: its token (slot / k)
    Tensor offsets;               // [E + 1] i32: expert e's rows are offsets[e]..offsets[e+1]
    std::vector<int64_t> counts;  // [E] rows per expert, on the host
    std::vector<int64_t> routed;  // [E] token-slots routed to each expert, dropped ones included
  };
  ExpertOrder sort_by_expert(const Tensor& indices, int64_t num_experts);
  // With token dropping (capacity >= 0; < 0 is the dropless sort above): the tokens form groups
  // of `group_size` (sequences), and within each group an expert takes at most `capacity` slots,
  // claimed in slot order; the slots past it are left out (M = the kept slots), as MaxText's
  // dropping MoE does.
  ExpertOrder sort_by_expert(const Tensor& indices, int64_t num_experts, int64_t capacity,
                             int64_t group_size);

  // Runs f(g, x) as one rematerialisable block (a decoder layer). none: recorded as usual.
  // full: f runs without recording; the backward re-runs it, recording, from the saved input.
  // minimal: like full, but the forward keeps every matmul output and the re-run reuses them,
  // so only the cheap ops are recomputed. remat_layer also carries the layer's auxiliary
  // losses: each comes back as a tensor whose gradient reaches f's parameters through the re-run.
  // f is copied (the backward calls it after these return): what it captures must outlive the
  // backward, so capture by value.
  Tensor remat(RematPolicy policy, const std::function<Tensor(Graph&, const Tensor&)>& f,
               const Tensor& x);
  LayerOutput remat_layer(RematPolicy policy,
                          const std::function<LayerOutput(Graph&, const Tensor&)>& f,
                          const Tensor& x);

  // Backpropagates from `y` with seed gradient `dy` (same shape as y), or 1 for a scalar y.
  void backward(const Tensor& y, const Tensor& dy = Tensor());
  // From several roots at once (y_i with seed dy_i, or 1 for a scalar y_i with no seed): one
  // pass over the tape, so a tensor reached from several roots gets the sum.
  void backward(const std::vector<std::pair<Tensor, Tensor>>& roots);

  // Marks a tracked parameter's gradient as undefined (to be overwritten by the next backward)
  // instead of zeroing it; finish_fresh() zeroes those no backward reached.
  static void mark_fresh(const Tensor& param);
  static void finish_fresh(Backend& backend, const Tensor& param);

  size_t tape_size() const;

  struct Impl;
  // The tape, for the core's own ops (core/src/graph_internal.h); opaque to plugins.
  Impl& internals() const { return *impl_; }

 private:
  Backend* backend_;
  bool record_;
  std::unique_ptr<Impl> impl_;
  // cross_entropy over this rank's columns of a vocabulary-parallel model's logits.
  Tensor vocab_cross_entropy(const Tensor& logits, const Tensor& targets, float z_loss,
                             float weight);
  // The ranks this graph's collectives run over, and whether the layers' auxiliary outputs are
  // wanted: passed on to remat's graphs.
  struct Groups {
    Communicator* tensor = nullptr;
    double* seconds = nullptr;  // the collectives' time, tensor and expert alike
    Communicator* expert = nullptr;
    int expert_ranks = 1, expert_rank = 0, expert_tensor_ranks = 1;
    bool wants_aux = true;
  } groups_;
};

}  // namespace mt
