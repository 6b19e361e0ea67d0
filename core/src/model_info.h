// Facts about a configured model the core derives from its parameter declarations.
#pragma once

#include <cstdint>
#include <string>

#include "mt/model.h"

namespace mt {

struct ParamCounts {
  int64_t total = 0;
  int64_t matmul = 0;     // weights that multiply activations (the LM head included)
  int64_t embedding = 0;  // the lookup table when it is not also the LM head
};

ParamCounts count_parameters(const Model& m, bool tied_embedding);

// Training FLOPs per token (DESIGN.md): 6 x matmul parameters + attention
// 12 x layers x heads x head_dim x seq_len, halved for causal attention.
double training_flops_per_token(const Model& m, bool tied_embedding, int64_t seq_len,
                                bool causal = true);

// Refuses (UsageError) a model whose parameters or activations of one micro-batch of
// `batch` x `seq_len` tokens have sizes that do not fit in 64 bits, naming the parameter or
// activation and the model's dimensions, before anything is allocated. Counts overflow too.
void check_model_sizes(const Model& m, int64_t batch, int64_t seq_len);

// "6.74B", "15.2M", "1.3K"
std::string human_count(double n);

}  // namespace mt
