#include "attention/checks.h"

#include "mt/error.h"

namespace mt::cpu::attention {

bool float_dtype(const Tensor& t) {
  return t.dtype() == DType::f32 || t.dtype() == DType::bf16;
}

Dims check_inputs(const std::string& op, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& q_seg, const Tensor& kv_seg) {
  const std::string shapes = " (q " + (q.defined() ? q.str() : "undefined") + ", k " +
                             (k.defined() ? k.str() : "undefined") + ", v " +
                             (v.defined() ? v.str() : "undefined") + ")";
  MT_CHECK(q.defined() && k.defined() && v.defined(), op + ": q, k and v are required" + shapes);
  MT_CHECK(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4,
           op + ": q, k, v must be [B, T, H, D]" + shapes);
  MT_CHECK(k.shape() == v.shape(), op + ": k and v shapes differ" + shapes);
  MT_CHECK(q.dim(0) == k.dim(0) && q.dim(3) == k.dim(3),
           op + ": batch or head_dim of q and k differ" + shapes);
  MT_CHECK(k.dim(2) > 0 && q.dim(2) % k.dim(2) == 0,
           op + ": query heads must be a multiple of kv heads" + shapes);
  MT_CHECK(float_dtype(q) && float_dtype(k) && float_dtype(v),
           op + ": q, k, v must be f32 or bf16");
  MT_CHECK(q_seg.defined() == kv_seg.defined(),
           op + ": give both q_segment and kv_segment or neither");
  if (q_seg.defined()) {
    MT_CHECK(q_seg.dtype() == DType::i32 && kv_seg.dtype() == DType::i32,
             op + ": segment ids must be i32");
    MT_CHECK(q_seg.shape() == (Shape{q.dim(0), q.dim(1)}) &&
                 kv_seg.shape() == (Shape{k.dim(0), k.dim(1)}),
             op + ": segment ids must be [B, T] and [B, S], got " + q_seg.str() + " and " +
                 kv_seg.str() + shapes);
  }
  return {q.dim(0), q.dim(1), k.dim(1), q.dim(2), k.dim(2), q.dim(3)};
}

void check_same(const std::string& op, const char* what, const Tensor& t, const Shape& shape,
                bool f32_only) {
  MT_CHECK(t.defined() && t.shape() == shape, op + ": " + what + " must be " + shape_str(shape) +
                                                  ", got " + (t.defined() ? t.str() : "undefined"));
  MT_CHECK(f32_only ? t.dtype() == DType::f32 : float_dtype(t),
           op + ": " + what + " has an unsupported dtype " + t.str());
}

namespace {
void check_spec(const std::string& op, const AttentionSpec& spec) {
  MT_CHECK(spec.window >= 0 && spec.softcap >= 0.f,
           op + ": window and softcap must be >= 0, got window " + std::to_string(spec.window) +
               " softcap " + std::to_string(spec.softcap));
}
}  // namespace

Dims check_forward(const std::string& op, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& q_seg, const Tensor& kv_seg, const AttentionSpec& spec,
                   const Tensor& out, const Tensor& lse) {
  const Dims n = check_inputs(op, q, k, v, q_seg, kv_seg);
  check_spec(op, spec);
  check_same(op, "out", out, q.shape(), false);
  check_same(op, "lse", lse, {n.B, n.Hq, n.T}, true);
  return n;
}

Dims check_backward(const std::string& op, const Tensor& dout, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& q_seg, const Tensor& kv_seg, const Tensor& out,
                    const Tensor& lse, const AttentionSpec& spec, const Tensor& dq,
                    const Tensor& dk, const Tensor& dv) {
  const Dims n = check_inputs(op, q, k, v, q_seg, kv_seg);
  check_spec(op, spec);
  check_same(op, "dout", dout, q.shape(), false);
  check_same(op, "out", out, q.shape(), false);
  check_same(op, "lse", lse, {n.B, n.Hq, n.T}, true);
  check_same(op, "dq", dq, q.shape(), false);
  check_same(op, "dk", dk, k.shape(), false);
  check_same(op, "dv", dv, v.shape(), false);
  return n;
}

Dims check_decode(const std::string& op, const Tensor& q, const Tensor& k_cache,
                  const Tensor& v_cache, const Tensor& lengths, const AttentionSpec& spec,
                  const Tensor& out) {
  const Dims n = check_inputs(op, q, k_cache, v_cache, Tensor(), Tensor());
  check_spec(op, spec);
  check_same(op, "out", out, q.shape(), false);
  MT_CHECK(lengths.defined() && lengths.dtype() == DType::i32 && lengths.shape() == Shape{n.B},
           op + ": lengths must be i32 [" + std::to_string(n.B) + "]");
  const int32_t* len = lengths.ptr<int32_t>();
  for (int64_t b = 0; b < n.B; ++b)
    MT_CHECK(len[b] >= n.T && len[b] <= n.S, op + ": lengths[" + std::to_string(b) +
                                                 "] = " + std::to_string(len[b]) +
                                                 " must be in [T, Smax] = [" + std::to_string(n.T) +
                                                 ", " + std::to_string(n.S) + "]");
  return n;
}

}  // namespace mt::cpu::attention
