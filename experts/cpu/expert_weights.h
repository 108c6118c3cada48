// The weights of one expert FFN, packed for one CPU kernel variant:
//   h = act(x W_gate^T + b_gate, x W_up^T + b_up);  y = h W_down^T + b_down
// W_gate and W_up [inter][hidden] are packed together as one matrix whose panels alternate
// (gate panel q, up panel q), so that one GEMM pass yields both halves of each hidden column;
// W_down [hidden][inter] is packed on its own. Biases are zero-padded to whole panels.
// Immutable after packing; safe to share between threads.
#pragma once

#include <cstdint>
#include <vector>

#include "experts/cpu/kernels.h"
#include "experts/cpu/packed_matrix.h"

namespace moerun {

struct ExpertWeights {
  int64_t hidden = 0;
  int64_t inter = 0;
  int64_t pairs = 0;             // gate/up panel pairs = ceil(inter / nr)
  PackedMatrix w13;              // N = 2 * pairs * nr, K = hidden
  PackedMatrix w2;               // N = hidden (padded), K = inter
  std::vector<float> bias_gate;  // empty, or pairs * nr
  std::vector<float> bias_up;    // empty, or pairs * nr
  std::vector<float> bias_down;  // empty, or w2.n_padded()

  size_t bytes() const { return w13.bytes() + w2.bytes(); }
};

// Where an expert's weights come from: float rows for the plain types, code rows for the
// block-scaled ones (FP8, MXFP4: the readers PackExpert uses are the ones of the type it packs).
struct ExpertSource {
  RowReader gate;                                    // row n < inter of W_gate [inter][hidden]
  RowReader up;                                      // row n < inter of W_up [inter][hidden]
  RowReader down;                                    // row n < hidden of W_down [hidden][inter]
  QuantRowReader qgate, qup, qdown;                  // the same rows, as codes and scales
  std::vector<float> bias_gate, bias_up, bias_down;  // empty or [inter], [inter], [hidden]
};

ExpertWeights PackExpert(const CpuKernels& kernels, DType dtype, int64_t hidden, int64_t inter,
                         const ExpertSource& src, int threads = 1);

}  // namespace moerun
