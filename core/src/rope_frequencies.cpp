// Rotary frequencies of every rope variant, shared by all backends so their rotations agree.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "mt/backend.h"

namespace mt {

namespace {

// HF find_correction_dim: the dimension whose wavelength fits num_rotations times in max_pos.
double correction_dim(double num_rotations, double dim, double base, double max_pos) {
  return dim * std::log(max_pos / (num_rotations * 2 * std::numbers::pi)) / (2 * std::log(base));
}

}  // namespace

RopeFrequencies rope_frequencies(const RopeSpec& spec, int64_t R) {
  const int64_t half = R / 2;
  const double base = spec.theta;
  std::vector<double> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) inv[i] = 1.0 / std::pow(base, double(2 * i) / double(R));
  RopeFrequencies t;
  switch (spec.type) {
    case RopeSpec::Type::standard:
      break;
    case RopeSpec::Type::linear:  // HF _compute_linear_scaling_rope_parameters: inv_freq / factor
      for (auto& f : inv) f /= double(spec.factor);
      break;
    case RopeSpec::Type::llama3: {
      const double factor = spec.factor, lo = spec.low_freq_factor, hi = spec.high_freq_factor;
      const double old_len = double(spec.original_max_position);
      const double low_wavelen = old_len / lo, high_wavelen = old_len / hi;
      for (auto& f : inv) {
        const double wavelen = 2 * std::numbers::pi / f;
        if (wavelen > low_wavelen) {
          f = f / factor;  // low frequencies: fully interpolated
        } else if (!(wavelen < high_wavelen)) {
          // medium frequencies: smooth blend between interpolated and original
          const double smooth = (old_len / wavelen - lo) / (hi - lo);
          f = (1 - smooth) * f / factor + smooth * f;
        }  // high frequencies: unchanged
      }
      break;
    }
    case RopeSpec::Type::yarn: {
      const double factor = spec.factor, dim = double(R);
      const double max_pos = double(spec.original_max_position);
      // HF find_correction_range with truncate=True.
      double low = std::floor(correction_dim(spec.beta_fast, dim, base, max_pos));
      double high = std::ceil(correction_dim(spec.beta_slow, dim, base, max_pos));
      low = std::max(low, 0.0);
      high = std::min(high, dim - 1);
      if (low == high) high += 0.001;  // HF linear_ramp_factor: avoid a zero-width ramp
      for (int64_t i = 0; i < half; ++i) {
        const double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
        const double extrapolation = 1 - ramp;  // weight of the unscaled frequency
        const double pos_freq = std::pow(base, double(2 * i) / dim);
        inv[i] =
            (1.0 / (factor * pos_freq)) * (1 - extrapolation) + (1.0 / pos_freq) * extrapolation;
      }
      t.mscale = spec.attention_factor != 0.f ? double(spec.attention_factor)
                 : factor <= 1                ? 1.0
                                              : 0.1 * std::log(factor) + 1.0;
      break;
    }
  }
  t.inv_freq.resize(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) t.inv_freq[i] = static_cast<float>(inv[i]);
  return t;
}

}  // namespace mt
