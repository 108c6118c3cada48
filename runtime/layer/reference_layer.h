// The plain reference for one MoE layer: a loop over tokens, and for each token over its experts,
// with every dot product accumulated in double. Slow and obviously right; the fast layer is tested
// against it (and benchmarked against it). Reads weights through PackedMatrix::At, so it shares
// nothing with the kernels but the weight values and the gate function. Thread-compatible.
#pragma once

#include <cstdint>

#include "runtime/model/layer_weights.h"

namespace moerun {

// x [tokens][hidden] -> out [tokens][hidden].
void ReferenceForward(const MoeLayerWeights& w, const float* x, int64_t tokens, float* out);

}  // namespace moerun
