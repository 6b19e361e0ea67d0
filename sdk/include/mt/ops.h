// The op set as data (mt/ops.def): an enum value per op, and each op's name, kind and signature
// split into inputs, outputs and attributes, for the profiler, `mt plugins`, the test table and
// anything else that walks the ops.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mt/export.h"

namespace mt {

enum class Op : uint16_t {
#define MT_OP(kind, ret, name, params, args) name,
#include "mt/ops.def"
#undef MT_OP
};

struct OpParam {
  std::string type;  // as written in ops.def: "const Tensor&", "float", "Activation", ...
  std::string name;
};

struct OpInfo {
  Op op{};
  std::string name;                 // "softcap_forward"
  bool required = false;            // false: the core composes it where a backend lacks it
  std::string result;               // "void", "double"
  std::vector<OpParam> inputs;      // const Tensor& (and the tensor lists of sum_squares_each)
  std::vector<OpParam> outputs;     // Tensor& (written or accumulated into)
  std::vector<OpParam> attributes;  // everything else
  std::string signature;            // "softcap_forward(const Tensor& x, float cap, Tensor& out)"
};

// Every op in ops.def order.
MT_API const std::vector<OpInfo>& all_ops();
MT_API const OpInfo& op_info(Op op);
MT_API std::optional<Op> find_op(std::string_view name);

}  // namespace mt
