// A model family for the tests of the SDK v2 contract (tests/unit/family_contract_test.cpp),
// built into build/tests/families and loaded from there only. Layers of two kinds alternate:
// even layers attend within sliding_window_size (q/k norms, SwiGLU MLP), odd layers attend to
// everything (q/k/v and output biases, a plain gelu MLP) and report an auxiliary loss, the mean
// square of their MLP output (weighted by 0.5). Its Hugging Face names fuse q, k and v into one
// qkv tensor (column slices) and stack a per-layer pair of matrices `pair` [2, d, 4] from two
// tensors; `pair` is not used by the forward pass (it exists to test the mapping).
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "mt/blocks.h"
#include "mt/config.h"
#include "mt/graph.h"
#include "mt/model.h"
#include "mt/plugin.h"

namespace {

using mt::Tensor;
namespace blocks = mt::blocks;

struct Dims {
  int64_t vocab, d, heads, kv, hd, mlp, layers, window;
  explicit Dims(const mt::Config& c)
      : vocab(c.get_int("vocab_size")),
        d(c.get_int("base_emb_dim")),
        heads(c.get_int("base_num_query_heads")),
        kv(c.get_int("base_num_kv_heads")),
        hd(c.get_int("head_dim")),
        mlp(c.get_int("base_mlp_dim")),
        layers(c.get_int("base_num_decoder_layers")),
        window(c.get_int("sliding_window_size")) {}
};

class Layer final : public mt::DecoderLayer {
 public:
  Layer(const Dims& d, bool global) : global_(global) {
    attn_.d_model = d.d;
    attn_.heads = d.heads;
    attn_.kv_heads = d.kv;
    attn_.head_dim = d.hd;
    attn_.rope.theta = 10000.f;
    attn_.attn.window = global ? 0 : d.window;
    attn_.qk_norm = !global;
    attn_.qkv_bias = global;
    attn_.out_bias = global;
    mlp_.d_model = d.d;
    mlp_.hidden = d.mlp;
    mlp_.gated = !global;
    mlp_.act = global ? mt::Activation::gelu_tanh : mt::Activation::silu;
    d_ = d.d;
  }
  std::vector<mt::ParamSpec> parameters() const override {
    std::vector<mt::ParamSpec> r = blocks::norm_params("attn_norm", d_, norm_);
    for (auto& p : blocks::attention_params(attn_)) r.push_back(p);
    for (auto& p : blocks::norm_params("mlp_norm", d_, norm_)) r.push_back(p);
    for (auto& p : blocks::mlp_params(mlp_)) r.push_back(p);
    r.push_back(blocks::dense_param("pair", 2, 4));
    r.back().shape = {2, d_, 4};
    return r;
  }
  mt::LayerOutput forward(mt::Graph& g, const mt::Params& p, const Tensor& x,
                          const mt::LayerInputs& in) const override {
    Tensor r =
        g.add(x, blocks::attention(g, p, attn_, blocks::norm(g, p, "attn_norm", x, norm_), in));
    Tensor m = blocks::mlp(g, p, mlp_, blocks::norm(g, p, "mlp_norm", r, norm_));
    mt::LayerOutput out(g.add(r, m));
    if (global_) {
      // mean(m^2) = (m*m) [1, n] @ ones [n, 1] / n
      const int64_t n = m.numel();
      Tensor ones = g.backend().empty({n, 1}, m.dtype());
      g.backend().fill(ones, 1.f / static_cast<float>(n));
      Tensor sq = g.reshape(g.mul(m, m), {1, n});
      Tensor mean = g.reshape(g.matmul(sq, ones), {1});
      if (mean.dtype() != mt::DType::f32) mean = g.cast(mean, mt::DType::f32);
      out.aux.push_back({"test_aux", mean, 0.5f});
    }
    return out;
  }
  mt::CacheSpec cache_spec() const override { return blocks::attention_cache_spec(attn_); }

 private:
  bool global_;
  int64_t d_ = 0;
  blocks::NormSpec norm_;
  blocks::AttentionBlockSpec attn_;
  blocks::MlpSpec mlp_;
};

class Model final : public mt::Model {
 public:
  explicit Model(const mt::Config& c) : d_(c) {
    for (int64_t i = 0; i < d_.layers; ++i)
      layers_.push_back(std::make_unique<Layer>(d_, i % 2 == 1));
  }
  mt::ModelDims dims() const override {
    mt::ModelDims m;
    m.vocab_size = d_.vocab;
    m.d_model = d_.d;
    m.num_layers = d_.layers;
    m.num_query_heads = d_.heads;
    m.num_kv_heads = d_.kv;
    m.head_dim = d_.hd;
    m.mlp_dim = d_.mlp;
    return m;
  }
  std::vector<mt::ParamSpec> top_parameters() const override {
    std::vector<mt::ParamSpec> r = {
        blocks::embedding_param("embedding", d_.vocab, d_.d, 1.f, false)};
    for (auto& p : blocks::norm_params("final_norm", d_.d, {})) r.push_back(p);
    r.push_back(blocks::dense_param("lm_head", d_.d, d_.vocab));
    return r;
  }
  int num_layers() const override { return static_cast<int>(layers_.size()); }
  const mt::DecoderLayer& layer(int i) const override { return *layers_[static_cast<size_t>(i)]; }
  Tensor embed(mt::Graph& g, const mt::Params& top, const Tensor& tokens) const override {
    return g.embedding(top["embedding"], tokens);
  }
  Tensor head(mt::Graph& g, const mt::Params& top, const Tensor& h) const override {
    return blocks::lm_head(g, top, blocks::norm(g, top, "final_norm", h, {}), false);
  }
  HfName hf_name(const std::string& n) const override {
    HfName h;
    if (n == "embedding" || n == "final_norm" || n == "lm_head") {
      h.name = n;
      h.transposed = n == "lm_head";
      return h;
    }
    const auto dot = n.find('.', 7);
    const std::string layer = n.substr(0, dot), p = n.substr(dot + 1);
    const int64_t q = d_.heads * d_.hd, kv = d_.kv * d_.hd;
    h.transposed = p.rfind('w', 0) == 0;  // matrices are stored [out, in]
    if (p == "wq" || p == "wk" || p == "wv") {
      h.name = layer + ".qkv";
      h.slice_begin = p == "wq" ? 0 : p == "wk" ? q : q + kv;
      h.slice_end = h.slice_begin + (p == "wq" ? q : kv);
      return h;
    }
    if (p == "pair") {
      h.stack = {layer + ".pair.0", layer + ".pair.1"};
      h.transposed = true;
      return h;
    }
    h.name = n;
    return h;
  }

 private:
  Dims d_;
  std::vector<std::unique_ptr<Layer>> layers_;
};

class Family final : public mt::ModelFamily {
 public:
  std::string name() const override { return "contract_test"; }
  void validate(const mt::Config&) const override {}
  std::unique_ptr<mt::Model> build(const mt::Config& c) const override {
    return std::make_unique<Model>(c);
  }
};

void register_family(mt::Registry& r) {
  r.add_model_family("contract_test", [] { return std::make_unique<Family>(); });
}

}  // namespace

MT_PLUGIN(mt::PluginKind::model, "contract_test", "1.0.0", register_family, nullptr)
