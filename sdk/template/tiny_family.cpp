// The "tiny" model family: the smallest complete family plugin, as a template.
// Each decoder layer is a pre-norm residual MLP: x + W2 silu(W1 rmsnorm(x)).
// A real family (plugins/models/llama) follows the same shape with attention added.
#include <memory>
#include <vector>

#include "mt/config.h"
#include "mt/graph.h"
#include "mt/model.h"
#include "mt/plugin.h"

namespace {

class TinyLayer final : public mt::DecoderLayer {
 public:
  TinyLayer(int64_t d, int64_t f) : d_(d), f_(f) {}
  std::vector<mt::ParamSpec> parameters() const override {
    return {{"norm", {d_}, mt::Init::ones, 0.f, false, false},
            {"w1", {d_, f_}, mt::Init::normal, 0.02f, true, true},
            {"w2", {f_, d_}, mt::Init::normal, 0.02f, true, true}};
  }
  mt::Tensor forward(mt::Graph& g, const std::vector<mt::Tensor>& p, const mt::Tensor& x,
                     const mt::LayerInputs&) const override {
    mt::Tensor h = g.rmsnorm(x, p[0], 1e-5f);
    h = g.activation(mt::Activation::silu, g.matmul(h, p[1]));
    return g.add(x, g.matmul(h, p[2]));
  }

 private:
  int64_t d_, f_;
};

class TinyModel final : public mt::Model {
 public:
  explicit TinyModel(const mt::Config& c)
      : vocab_(c.get_int("vocab_size")), d_(c.get_int("base_emb_dim")) {
    for (int64_t i = 0; i < c.get_int("base_num_decoder_layers"); ++i)
      layers_.push_back(std::make_unique<TinyLayer>(d_, c.get_int("base_mlp_dim")));
  }
  mt::ModelDims dims() const override {
    mt::ModelDims m;
    m.vocab_size = vocab_;
    m.d_model = d_;
    m.num_layers = static_cast<int64_t>(layers_.size());
    return m;
  }
  std::vector<mt::ParamSpec> top_parameters() const override {
    return {{"embedding", {vocab_, d_}, mt::Init::normal, 1.f, true, false},
            {"final_norm", {d_}, mt::Init::ones, 0.f, false, false},
            {"lm_head", {d_, vocab_}, mt::Init::normal, 0.02f, true, true}};
  }
  int num_layers() const override { return static_cast<int>(layers_.size()); }
  const mt::DecoderLayer& layer(int i) const override { return *layers_[static_cast<size_t>(i)]; }
  mt::Tensor embed(mt::Graph& g, const std::vector<mt::Tensor>& top,
                   const mt::Tensor& tokens) const override {
    return g.embedding(top[0], tokens);
  }
  mt::Tensor head(mt::Graph& g, const std::vector<mt::Tensor>& top,
                  const mt::Tensor& hidden) const override {
    return g.matmul(g.rmsnorm(hidden, top[1], 1e-5f), top[2]);
  }

 private:
  int64_t vocab_, d_;
  std::vector<std::unique_ptr<TinyLayer>> layers_;
};

class TinyFamily final : public mt::ModelFamily {
 public:
  std::string name() const override { return "tiny"; }
  void validate(const mt::Config& c) const override {
    if (c.get_int("base_emb_dim") < 1) c.reject("base_emb_dim", "must be at least 1.");
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
