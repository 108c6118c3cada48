// Portable kernels: plain C++ with std::fma, for any CPU. Bitwise equal to the SIMD variants.
#include <cmath>

#include "experts/cpu/elementwise.h"
#include "experts/cpu/kernels.h"
#include "experts/cpu/packed_matrix.h"

namespace moerun::kernels_internal {
namespace {

constexpr int kMr = 4;
constexpr int kNr = 16;

void Tile(int rows, int64_t k, const float* a, const void* b, DType bt, float* c, int64_t ldc,
          bool accumulate) {
  float acc[kMr][kNr];
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < kNr; ++j) acc[i][j] = accumulate ? c[i * ldc + j] : 0.0f;
  }
  int slot[kNr];
  for (int j = 0; j < kNr; ++j) slot[j] = PanelSlot(bt, kNr, j);
  float bv[kNr];
  for (int64_t kk = 0; kk < k; ++kk) {
    for (int j = 0; j < kNr; ++j) bv[j] = LoadAsF32(b, bt, kk * kNr + slot[j]);
    const float* ak = a + kk * kMr;
    for (int i = 0; i < rows; ++i) {
      for (int j = 0; j < kNr; ++j) acc[i][j] = std::fma(ak[i], bv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < kNr; ++j) c[i * ldc + j] = acc[i][j];
  }
}

}  // namespace

const CpuKernels& ScalarKernels() {
  static const CpuKernels k{Isa::kScalar,         kMr, kNr, 256, &Tile, &elementwise::Activate,
                            &elementwise::AddBias};
  return k;
}

}  // namespace moerun::kernels_internal
