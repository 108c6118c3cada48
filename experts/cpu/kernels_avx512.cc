// AVX-512 kernels (Skylake-SP and later, AMD Zen 4): 12 rows x 32 columns per tile.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c; only called when the CPU
// and OS support them.
#ifdef MOERUN_AVX512_EMULATION
// Test builds only: the same code over emulated intrinsics (experts/cpu/avx512_emulation.h).
#include "experts/cpu/avx512_emulation.h"
#define MOERUN_AVX512_KERNELS Avx512KernelsEmulated
#else
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* helpers.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#define MOERUN_AVX512_KERNELS Avx512Kernels
#endif

#include "experts/cpu/elementwise.h"
#include "experts/cpu/kernels.h"

namespace moerun::kernels_internal {
namespace {

constexpr int kMr = 12;
constexpr int kNr = 32;

template <DType BT>
inline void LoadB(const uint8_t* b, int64_t k, __m512* b0, __m512* b1) {
  if constexpr (BT == DType::kF32) {
    const float* p = reinterpret_cast<const float*>(b) + k * kNr;
    *b0 = _mm512_loadu_ps(p);
    *b1 = _mm512_loadu_ps(p + 16);
  } else if constexpr (BT == DType::kBF16) {
    // 32-bit lane j holds column j (low half) and column j + 16 (high half).
    const __m512i raw = _mm512_loadu_si512(b + k * kNr * 2);
    *b0 = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    *b1 = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int(0xffff0000u))));
  } else {
    const __m256i* p = reinterpret_cast<const __m256i*>(b + k * kNr * 2);
    *b0 = _mm512_cvtph_ps(_mm256_loadu_si256(p));
    *b1 = _mm512_cvtph_ps(_mm256_loadu_si256(p + 1));
  }
}

template <int R, DType BT>
void TileT(int64_t k, const float* a, const uint8_t* b, float* c, int64_t ldc, bool accumulate) {
  __m512 c0[R], c1[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    c0[i] = accumulate ? _mm512_loadu_ps(c + i * ldc) : _mm512_setzero_ps();
    c1[i] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    __m512 b0, b1;
    LoadB<BT>(b, kk, &b0, &b1);
    const float* ak = a + kk * kMr;
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const __m512 av = _mm512_set1_ps(ak[i]);
      c0[i] = _mm512_fmadd_ps(av, b0, c0[i]);
      c1[i] = _mm512_fmadd_ps(av, b1, c1[i]);
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    _mm512_storeu_ps(c + i * ldc, c0[i]);
    _mm512_storeu_ps(c + i * ldc + 16, c1[i]);
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
    case 6:
      TileT<6, BT>(k, a, b, c, ldc, acc);
      break;
    case 7:
      TileT<7, BT>(k, a, b, c, ldc, acc);
      break;
    case 8:
      TileT<8, BT>(k, a, b, c, ldc, acc);
      break;
    case 9:
      TileT<9, BT>(k, a, b, c, ldc, acc);
      break;
    case 10:
      TileT<10, BT>(k, a, b, c, ldc, acc);
      break;
    case 11:
      TileT<11, BT>(k, a, b, c, ldc, acc);
      break;
    default:
      TileT<12, BT>(k, a, b, c, ldc, acc);
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

const CpuKernels& MOERUN_AVX512_KERNELS() {
  static const CpuKernels k{Isa::kAvx512,         kMr, kNr, 192, &Tile, &elementwise::Activate,
                            &elementwise::AddBias};
  return k;
}

}  // namespace moerun::kernels_internal
