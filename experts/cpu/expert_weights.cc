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
  w.w13.Fill(
      [&](int64_t n, float* row) {
        const int64_t panel = n / nr;
        const int64_t j = (panel / 2) * nr + n % nr;  // hidden column this row produces
        if (j >= inter) {
          std::fill(row, row + hidden, 0.0f);
        } else if (panel % 2 == 0) {
          src.gate(j, row);
        } else {
          src.up(j, row);
        }
      },
      threads);
  w.w2 = PackedMatrix(dtype, hidden, inter, nr);
  w.w2.Fill(src.down, threads);
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
