// The op set's table (mt/ops.h), made from mt/ops.def's entries: each signature is split into
// inputs, outputs and attributes by its parameter types.
#include "mt/ops.h"

#include <string>
#include <string_view>
#include <vector>

#include "mt/error.h"

namespace mt {
namespace {

std::string trim(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return std::string(s);
}

// "(const Tensor& x, float alpha = 1.f)" -> {("const Tensor&", "x"), ("float", "alpha")}
std::vector<OpParam> parse_params(std::string_view params) {
  MT_CHECK(params.size() >= 2 && params.front() == '(' && params.back() == ')',
           "ops.def: parameters must be parenthesised: " + std::string(params));
  params = params.substr(1, params.size() - 2);
  std::vector<OpParam> out;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= params.size(); ++i) {
    const char c = i < params.size() ? params[i] : ',';
    if (c == '<' || c == '(') ++depth;
    if (c == '>' || c == ')') --depth;
    if (c != ',' || depth != 0) continue;
    std::string p = trim(params.substr(start, i - start));
    start = i + 1;
    if (const size_t eq = p.find('='); eq != std::string::npos) p = trim(p.substr(0, eq));
    const size_t cut = p.find_last_of(" &*");
    MT_CHECK(cut != std::string::npos && cut + 1 < p.size(), "ops.def: unnamed parameter " + p);
    std::string type = trim(p.substr(0, cut + 1));
    // The stringised list keeps "Tensor & x" as written; types are normalised to "Tensor&".
    if (const size_t amp = type.find(" &"); amp != std::string::npos) type.erase(amp, 1);
    out.push_back({type, p.substr(cut + 1)});
  }
  return out;
}

OpInfo make(Op op, const char* name, bool required, const char* result, const char* params) {
  OpInfo info;
  info.op = op;
  info.name = name;
  info.required = required;
  info.result = result;
  for (OpParam& p : parse_params(params)) {
    const std::string& t = p.type;
    const bool is_const = t.rfind("const ", 0) == 0;
    const bool is_ref = !t.empty() && t.back() == '&';
    const bool tensors = t.find("Tensor") != std::string::npos;
    const bool list_out = t == "std::vector<double>&";
    if (tensors && is_const)
      info.inputs.push_back(std::move(p));
    else if ((tensors && is_ref) || list_out)
      info.outputs.push_back(std::move(p));
    else
      info.attributes.push_back(std::move(p));
  }
  info.signature = std::string(name) + params;
  return info;
}

}  // namespace

const std::vector<OpInfo>& all_ops() {
  static const std::vector<OpInfo> ops = [] {
    std::vector<OpInfo> v;
#define MT_OP(kind, ret, name, params, args) \
  v.push_back(make(Op::name, #name, std::string_view(#kind) == "required", #ret, #params));
#include "mt/ops.def"
#undef MT_OP
    return v;
  }();
  return ops;
}

const OpInfo& op_info(Op op) {
  const auto& ops = all_ops();
  const auto i = static_cast<size_t>(op);
  MT_CHECK(i < ops.size(), "op_info: no op number " + std::to_string(i));
  return ops[i];
}

std::optional<Op> find_op(std::string_view name) {
  for (const OpInfo& info : all_ops())
    if (info.name == name) return info.op;
  return std::nullopt;
}

}  // namespace mt
