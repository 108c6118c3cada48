#include "experts/cpu/gemm.h"

#include <algorithm>

namespace moerun {

void GemmPacked(const CpuKernels& kernels, ThreadPool* pool, int64_t m, const float* a, int64_t lda,
                const PackedMatrix& b, float* c, int64_t ldc, AlignedBuffer* apack) {
  const int mr = kernels.mr;
  const int nr = kernels.nr;
  const int64_t k = b.k();
  const int64_t mblocks = (m + mr - 1) / mr;
  apack->Reserve(static_cast<size_t>(mblocks * k * mr) * sizeof(float));
  float* ap = apack->as<float>();
  const int64_t kc = KcFor(kernels, b.dtype());
  pool->ParallelFor(mblocks, [&](int64_t mb, int) {
    const int rows = static_cast<int>(std::min<int64_t>(mr, m - mb * mr));
    float* dst = ap + mb * k * mr;
    for (int i = 0; i < rows; ++i) {
      const float* src = a + (mb * mr + i) * lda;
      for (int64_t kk = 0; kk < k; ++kk) dst[kk * mr + i] = src[kk];
    }
    for (int64_t k0 = 0; k0 < k; k0 += kc) {
      const int64_t klen = std::min<int64_t>(kc, k - k0);
      for (int64_t p = 0; p < b.panels(); ++p) {
        kernels.tile(rows, klen, dst + k0 * mr, b.PanelAt(p, k0), b.dtype(),
                     c + mb * mr * ldc + p * nr, ldc, k0 > 0);
      }
    }
  });
}

}  // namespace moerun
