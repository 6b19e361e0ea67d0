// The "tiny" model family: the smallest complete family plugin, as a template.
// Each decoder layer is a pre-norm residual MLP, x + s * w_out silu(w_in rmsnorm(x)), made of the
// SDK's shared blocks (mt/blocks.h); s is the family's own config key tiny_residual_scale.
// A real family (plugins/models/llama) follows the same shape with attention added.
#include <memory>
#include <vector>

#include "mt/blocks.h"
#include "mt/config.h"
#include "mt/graph.h"
#include "mt/model.h"
#include "mt/plugin.h"

namespace {

class TinyLayer final : public mt::DecoderLayer {
 public:
  TinyLayer(int64_t d, int64_t f, float scale) : scale_(scale) {
    mlp_.d_model = d;
    mlp_.hidden = f;
    mlp_.act = mt::Activation::silu;
    mlp_.gated = false;  // w_out(silu(x @ w_in))
    d_ = d;
  }
  // Parameters by name: "norm", then the block's "w_in" and "w_out".
  std::vector<mt::ParamSpec> parameters() const override {
    std::vector<mt::ParamSpec> r = mt::blocks::norm_params("norm", d_, norm_);
    for (auto& p : mt::blocks::mlp_params(mlp_)) r.push_back(p);
    return r;
  }
  mt::LayerOutput forward(mt::Graph& g, const mt::Params& p, const mt::Tensor& x,
                          const mt::LayerInputs&) const override {
    const mt::Tensor y = mt::blocks::mlp(g, p, mlp_, mt::blocks::norm(g, p, "norm", x, norm_));
    return g.add(x, g.scale(y, scale_));
  }
  // No attention, so nothing to keep per token when decoding.
  mt::CacheSpec cache_spec() const override { return {}; }

 private:
  int64_t d_ = 0;
  float scale_ = 1.f;
  mt::blocks::NormSpec norm_;  // RMSNorm, eps 1e-5
  mt::blocks::MlpSpec mlp_;
};

class TinyModel final : public mt::Model {
 public:
  explicit TinyModel(const mt::Config& c)
      : vocab_(c.get_int("vocab_size")), d_(c.get_int("base_emb_dim")) {
    for (int64_t i = 0; i < c.get_int("base_num_decoder_layers"); ++i)
      layers_.push_back(std::make_unique<TinyLayer>(
          d_, c.get_int("base_mlp_dim"), static_cast<float>(c.get_float("tiny_residual_scale"))));
  }
  // The default flops_per_token counts attention from num_query_heads x head_dim: a family whose
  // layers attend sets them (and num_kv_heads), or MFU and mt plan leave attention out. These
  // layers do not attend.
  mt::ModelDims dims() const override {
    mt::ModelDims m;
    m.vocab_size = vocab_;
    m.d_model = d_;
    m.num_layers = static_cast<int64_t>(layers_.size());
    return m;
  }
  std::vector<mt::ParamSpec> top_parameters() const override {
    return {mt::blocks::embedding_param("embedding", vocab_, d_, 1.f, /*tied=*/false),
            {"final_norm", {d_}, mt::Init::ones, 0.f, false, false},
            mt::blocks::dense_param("lm_head", d_, vocab_)};
  }
  int num_layers() const override { return static_cast<int>(layers_.size()); }
  const mt::DecoderLayer& layer(int i) const override { return *layers_[static_cast<size_t>(i)]; }
  mt::Tensor embed(mt::Graph& g, const mt::Params& top, const mt::Tensor& tokens) const override {
    return g.embedding(top["embedding"], tokens);
  }
  mt::Tensor head(mt::Graph& g, const mt::Params& top, const mt::Tensor& hidden) const override {
    return g.matmul(g.rmsnorm(hidden, top["final_norm"], 1e-5f), top["lm_head"]);
  }

 private:
  int64_t vocab_, d_;
  std::vector<std::unique_ptr<TinyLayer>> layers_;
};

class TinyFamily final : public mt::ModelFamily {
 public:
  std::string name() const override { return "tiny"; }
  // The family's own keys, in configs/base.yml's format: `mt config` shows them and any config
  // layer may set them once decoder_block is tiny. The loader checks the [constraint].
  std::string config_schema() const override {
    return "tiny_residual_scale: 1.0  # scales each layer's MLP branch before the residual add "
           "[>0]\n";
  }
  // Rules the schema cannot say, refused with Config::reject (exit 2, naming where it was set).
  void validate(const mt::Config& c) const override {
    if (c.get_int("base_emb_dim") < 1) c.reject("base_emb_dim", "must be at least 1.");
    if (c.get_float("tiny_residual_scale") > 10)
      c.reject("tiny_residual_scale",
               "is unstable: above 10 the residual stream grows with every layer until the "
               "loss diverges.");
  }
  std::unique_ptr<mt::Model> build(const mt::Config& c) const override {
    return std::make_unique<TinyModel>(c);
  }
};

void register_tiny(mt::Registry& r) {
  r.add_model_family("tiny", [] { return std::make_unique<TinyFamily>(); });
}

}  // namespace

MT_PLUGIN(mt::PluginKind::model, "tiny", "1.0.0", register_tiny, nullptr)
