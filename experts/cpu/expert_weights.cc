#include "experts/cpu/expert_weights.h"

#include <algorithm>

namespace moerun {

ExpertWeights PackExpert(const CpuKernels& kernels, DType dtype, int64_t hidden, int64_t inter,
                         const ExpertSource& src, int threads) {
  const int nr = kernels.nr;
  ExpertWeights w;
  w.hidden = hidden;
  w.inter = inter;
  w.pairs = (inter + nr - 1) / nr;
  w.w13 = PackedMatrix(dtype, 2 * w.pairs * nr, hidden, nr);
  w.w2 = PackedMatrix(dtype, hidden, inter, nr);
  // Row n of w13 is hidden column j of the gate (even panels) or of the up projection (odd).
  auto column = [nr](int64_t n) { return (n / nr / 2) * nr + n % nr; };
  auto is_gate = [nr](int64_t n) { return (n / nr) % 2 == 0; };
  if (IsBlockScaled(dtype)) {
    w.w13.FillQuant(
        [&](int64_t n, uint8_t* codes, float* scales) {
          const int64_t j = column(n);
          if (j >= inter) return false;
          return is_gate(n) ? src.qgate(j, codes, scales) : src.qup(j, codes, scales);
        },
        threads);
    w.w2.FillQuant(src.qdown, threads);
  } else {
    w.w13.Fill(
        [&](int64_t n, float* row) {
          const int64_t j = column(n);
          if (j >= inter) {
            std::fill(row, row + hidden, 0.0f);
          } else if (is_gate(n)) {
            src.gate(j, row);
          } else {
            src.up(j, row);
          }
        },
        threads);
    w.w2.Fill(src.down, threads);
  }
  const size_t padded_inter = static_cast<size_t>(w.pairs * nr);
  if (!src.bias_gate.empty()) {
    w.bias_gate.assign(padded_inter, 0.0f);
    std::copy(src.bias_gate.begin(), src.bias_gate.end(), w.bias_gate.begin());
    w.bias_up.assign(padded_inter, 0.0f);
    std::copy(src.bias_up.begin(), src.bias_up.end(), w.bias_up.begin());
  }
  if (!src.bias_down.empty()) {
    w.bias_down.assign(static_cast<size_t>(w.w2.n_padded()), 0.0f);
    std::copy(src.bias_down.begin(), src.bias_down.end(), w.bias_down.begin());
  }
  return w;
}

}  // namespace moerun
