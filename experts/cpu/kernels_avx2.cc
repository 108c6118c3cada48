// AVX2 + FMA kernels (Haswell and later, AMD Zen): 6 rows x 16 columns per tile.
// Compiled with -mavx2 -mfma -mf16c; only called when the CPU supports them.
#include <immintrin.h>

#include "experts/cpu/elementwise.h"
#include "experts/cpu/kernels.h"

namespace moerun::kernels_internal {
namespace {

constexpr int kMr = 6;
constexpr int kNr = 16;

template <DType BT>
inline void LoadB(const uint8_t* b, int64_t k, __m256* b0, __m256* b1) {
  if constexpr (BT == DType::kF32) {
    const float* p = reinterpret_cast<const float*>(b) + k * kNr;
    *b0 = _mm256_loadu_ps(p);
    *b1 = _mm256_loadu_ps(p + 8);
  } else if constexpr (BT == DType::kBF16) {
    // 32-bit lane j holds column j (low half) and column j + 8 (high half).
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + k * kNr * 2));
    *b0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    *b1 = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(int(0xffff0000u))));
  } else {
    const __m128i* p = reinterpret_cast<const __m128i*>(b + k * kNr * 2);
    *b0 = _mm256_cvtph_ps(_mm_loadu_si128(p));
    *b1 = _mm256_cvtph_ps(_mm_loadu_si128(p + 1));
  }
}

template <int R, DType BT>
void TileT(int64_t k, const float* a, const uint8_t* b, float* c, int64_t ldc, bool accumulate) {
  __m256 c0[R], c1[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    c0[i] = accumulate ? _mm256_loadu_ps(c + i * ldc) : _mm256_setzero_ps();
    c1[i] = accumulate ? _mm256_loadu_ps(c + i * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    __m256 b0, b1;
    LoadB<BT>(b, kk, &b0, &b1);
    const float* ak = a + kk * kMr;
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 av = _mm256_broadcast_ss(ak + i);
      c0[i] = _mm256_fmadd_ps(av, b0, c0[i]);
      c1[i] = _mm256_fmadd_ps(av, b1, c1[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(c + i * ldc, c0[i]);
    _mm256_storeu_ps(c + i * ldc + 8, c1[i]);
  }
}

template <DType BT>
void TileRows(int rows, int64_t k, const float* a, const uint8_t* b, float* c, int64_t ldc,
              bool acc) {
  switch (rows) {
    case 1:
      TileT<1, BT>(k, a, b, c, ldc, acc);
      break;
    case 2:
      TileT<2, BT>(k, a, b, c, ldc, acc);
      break;
    case 3:
      TileT<3, BT>(k, a, b, c, ldc, acc);
      break;
    case 4:
      TileT<4, BT>(k, a, b, c, ldc, acc);
      break;
    case 5:
      TileT<5, BT>(k, a, b, c, ldc, acc);
      break;
    default:
      TileT<6, BT>(k, a, b, c, ldc, acc);
      break;
  }
}

void Tile(int rows, int64_t k, const float* a, const void* b, DType bt, float* c, int64_t ldc,
          bool accumulate) {
  const auto* bb = static_cast<const uint8_t*>(b);
  switch (bt) {
    case DType::kBF16:
      TileRows<DType::kBF16>(rows, k, a, bb, c, ldc, accumulate);
      break;
    case DType::kF16:
      TileRows<DType::kF16>(rows, k, a, bb, c, ldc, accumulate);
      break;
    default:
      TileRows<DType::kF32>(rows, k, a, bb, c, ldc, accumulate);
      break;
  }
}

}  // namespace

const CpuKernels& Avx2Kernels() {
  static const CpuKernels k{Isa::kAvx2,           kMr, kNr, 256, &Tile, &elementwise::Activate,
                            &elementwise::AddBias};
  return k;
}

}  // namespace moerun::kernels_internal
