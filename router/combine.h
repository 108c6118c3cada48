// Combine: a token's output is the weighted sum of its k expert outputs, in slot order (the
// gate's order), plus an optional shared-expert term:
//   out[h] = 0; for s in 0..k-1: out[h] = out[h] + w[s] * y_s[h];   out[h] = out[h] + c * shared[h]
// Each step rounds separately (no fused multiply-add), so the result is the same on every CPU and
// independent of where the k outputs were computed. Pure function.
#pragma once

#include <cstdint>

namespace moerun {

// rows[s] points at the expert output of slot s; shared may be null.
void CombineToken(int k, int64_t hidden, const float* const* rows, const float* w,
                  const float* shared, float shared_scale, float* out);

}  // namespace moerun
