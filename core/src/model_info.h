// Facts about a configured model the core derives from its parameter declarations.
#pragma once

#include <cstdint>
#include <string>

#include "mt/config.h"
#include "mt/model.h"

namespace mt {

struct ParamCounts {
  int64_t total = 0;
  int64_t matmul = 0;        // weights that multiply activations (the LM head included)
  double active_matmul = 0;  // of those, what one token uses (ParamSpec::active: top-k experts)
  int64_t embedding = 0;     // lookup tables that are not also the LM head
  // Multi-token prediction modules (Model::mtp_depths; counted in total and matmul, not in
  // active_matmul, which is what inference runs per token): their parameters, and the matmul
  // parameters a training token runs in them, the shared LM head once per depth included.
  int64_t mtp = 0;
  double mtp_active_matmul = 0;
};

// From the parameter declarations: ParamSpec::matmul says what multiplies activations (a tied
// embedding declares matmul = true), ParamSpec::active what share of it a token uses.
ParamCounts count_parameters(const Model& m);

// Model::flops_per_token's default (DESIGN.md): 6 x active matmul parameters + attention's
// 12 x heads x head_dim x the keys a query attends to, per layer: seq_len / 2 when causal,
// fewer within a layer's sliding window (its CacheSpec window). A training token also runs the
// multi-token prediction depths: their active matmul parameters and their layers' attention.
double default_flops_per_token(const Model& m, int64_t seq_len);

// Refuses (UsageError) a model whose parameters or activations of one micro-batch of
// `batch` x `seq_len` tokens have sizes that do not fit in 64 bits, naming the parameter or
// activation and the model's dimensions, before anything is allocated. Counts overflow too.
void check_model_sizes(const Model& m, int64_t batch, int64_t seq_len);

// "6.74B", "15.2M", "1.3K"
std::string human_count(double n);

// The model's name for messages: model_name, else "the model at hf_path=<dir>" (a Hugging Face
// directory names none), else "the configured model".
std::string model_label(const Config& cfg);

}  // namespace mt
