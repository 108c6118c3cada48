// Elementwise math shared by every kernel variant: included by each ISA's translation unit so the
// compiler vectorises it for that ISA. Only +, -, *, / and comparisons, never fused (the build
// uses -ffp-contract=off), so every variant produces the same bits as the scalar code; the CUDA
// kernels call Act too (built with --fmad=false: the same bits on the GPU).
#pragma once

#include <cstdint>

#include "base/fast_exp.h"
#include "base/host_device.h"
#include "experts/cpu/kernels.h"

namespace moerun::elementwise {
// Internal linkage: each ISA's translation unit keeps its own copy (one compiled for AVX-512 must
// never be picked by the linker for another).
namespace {

MOERUN_HD inline float Sigmoid(float x) { return 1.0f / (1.0f + ExpF(-x)); }
MOERUN_HD inline float Silu(float x) { return x / (1.0f + ExpF(-x)); }

MOERUN_HD inline float Act(const ActParams& p, float g, float u) {
  switch (p.kind) {
    case ActKind::kSwiGlu:
      return Silu(g) * u;
    case ActKind::kSwiGluClamped: {
      float s = Silu(g);
      if (p.limit > 0.0f) {
        s = s > p.limit ? p.limit : s;
        u = u > p.limit ? p.limit : u;
        u = u < -p.limit ? -p.limit : u;
      }
      return s * u;
    }
    case ActKind::kGptOss: {
      g = g > p.limit ? p.limit : g;
      u = u > p.limit ? p.limit : u;
      u = u < -p.limit ? -p.limit : u;
      const float glu = g / (1.0f + ExpF(-(p.alpha * g)));
      return (u + 1.0f) * glu;
    }
  }
  return 0.0f;
}

// Vectorisable forms of the kernel-table functions (see kernels.h for their contracts).
template <ActKind K>
inline void ActivateRowT(const ActParams& p, int64_t cols, const float* g, const float* u,
                         const float* bg, const float* bu, float* out) {
  ActParams q = p;
  q.kind = K;
  if (bg != nullptr) {
    for (int64_t j = 0; j < cols; ++j) out[j] = Act(q, g[j] + bg[j], u[j] + bu[j]);
  } else {
    for (int64_t j = 0; j < cols; ++j) out[j] = Act(q, g[j], u[j]);
  }
}

inline void Activate(const ActParams& p, int rows, int pairs, int nr, const float* c, int64_t ldc,
                     const float* bias_g, const float* bias_u, int64_t j0, int64_t inter, float* h,
                     int64_t h_stride) {
  float tmp[64];
  for (int i = 0; i < rows; ++i) {
    const float* row = c + i * ldc;
    for (int q = 0; q < pairs; ++q) {
      const int64_t jbase = j0 + static_cast<int64_t>(q) * nr;
      if (jbase >= inter) break;
      const int64_t cols = inter - jbase < nr ? inter - jbase : nr;
      const float* g = row + 2 * q * nr;
      const float* u = g + nr;
      const float* bg = bias_g ? bias_g + jbase : nullptr;
      const float* bu = bias_u ? bias_u + jbase : nullptr;
      switch (p.kind) {
        case ActKind::kSwiGlu:
          ActivateRowT<ActKind::kSwiGlu>(p, cols, g, u, bg, bu, tmp);
          break;
        case ActKind::kSwiGluClamped:
          ActivateRowT<ActKind::kSwiGluClamped>(p, cols, g, u, bg, bu, tmp);
          break;
        case ActKind::kGptOss:
          ActivateRowT<ActKind::kGptOss>(p, cols, g, u, bg, bu, tmp);
          break;
      }
      float* dst = h + jbase * h_stride + i;
      for (int64_t j = 0; j < cols; ++j) dst[j * h_stride] = tmp[j];
    }
  }
}

inline void AddBias(int rows, int64_t n, const float* bias, float* y, int64_t ldy) {
  for (int i = 0; i < rows; ++i) {
    float* r = y + i * ldy;
    for (int64_t j = 0; j < n; ++j) r[j] = r[j] + bias[j];
  }
}

}  // namespace
}  // namespace moerun::elementwise
