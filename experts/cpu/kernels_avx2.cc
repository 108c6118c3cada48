// AVX2 + FMA kernels (Haswell and later, AMD Zen): 6 rows x 16 columns per tile.
// Compiled with -mavx2 -mfma -mf16c; only called when the CPU supports them.
#include <immintrin.h>

#include <algorithm>

#include "experts/cpu/elementwise.h"
#include "experts/cpu/kernels.h"
#include "experts/cpu/packed_matrix.h"

namespace moerun::kernels_internal {
namespace {

constexpr int kMr = 6;
constexpr int kNr = 16;

// Calls fn.template operator()<R>() for R = rows (1..kMr): one compiled tile per height.
template <int R = 1, typename Fn>
inline void ForRows(int rows, Fn&& fn) {
  if constexpr (R < kMr) {
    if (rows != R) return ForRows<R + 1>(rows, fn);
  }
  fn.template operator()<R>();
}

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

// Block-scaled weights (kernels.h): per k block, sums in registers from zero, then
// c = fma(sum, scale, c) through memory.
template <DType BT>
inline void LoadCodes(const uint8_t* row, __m256* b0, __m256* b1) {
  if constexpr (BT == DType::kF8E4M3) {
    // 16 codes -> F16 bits (sign to bit 15, exponent and mantissa to bits 13..7): e4m3 x 2^-8.
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(int16_t(0xBFFF)));
    *b0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    *b1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  } else {
    // 8 bytes: column j in the low nibble of byte j, column j + 8 in its high nibble.
    const __m256 mag = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256i sign = _mm256_set1_epi32(int(0x80000000u));
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row)));
    const __m256 lo = _mm256_permutevar8x32_ps(mag, x);  // uses index bits 2..0
    const __m256 hi = _mm256_permutevar8x32_ps(mag, _mm256_srli_epi32(x, 4));
    *b0 = _mm256_xor_ps(lo, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(x, 28), sign)));
    *b1 = _mm256_xor_ps(hi, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(x, 24), sign)));
  }
}

// 2^(s - 127) for 8 e8m0 bytes (s = 0: the subnormal 2^-127).
inline __m256 E8m0x8(const uint8_t* s) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
  const __m256i zero = _mm256_and_si256(_mm256_cmpeq_epi32(x, _mm256_setzero_si256()),
                                        _mm256_set1_epi32(0x00400000));
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_slli_epi32(x, 23), zero));
}

// kDecoded: the codes' values come from dq [k][kNr] (written by Decode) instead of the codes.
template <int R, DType BT, bool kDecoded = false>
void QuantTileT(int64_t k, const float* a, const uint8_t* b, float* c, int64_t ldc, bool accumulate,
                const float* dq = nullptr) {
  constexpr bool kFp8 = BT == DType::kF8E4M3;
  constexpr int kBk = BlockK(BT);
  constexpr int kHeader = QuantHeaderBytes(BT, kNr);
  constexpr int kRowBytes = QuantRowBytes(BT, kNr);
  for (int64_t k0 = 0; k0 < k; k0 += kBk, b += kHeader + kBk * kRowBytes) {
    const int64_t len = std::min<int64_t>(kBk, k - k0);
    __m256 s0[R], s1[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) s0[i] = s1[i] = _mm256_setzero_ps();
    const uint8_t* codes = b + kHeader;
    const float* ak = a + k0 * kMr;
    for (int64_t kk = 0; kk < len; ++kk, codes += kRowBytes, ak += kMr) {
      __m256 b0, b1;
      if constexpr (kDecoded) {
        b0 = _mm256_loadu_ps(dq + (k0 + kk) * kNr);
        b1 = _mm256_loadu_ps(dq + (k0 + kk) * kNr + 8);
      } else {
        LoadCodes<BT>(codes, &b0, &b1);
      }
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256 av = _mm256_broadcast_ss(ak + i);
        s0[i] = _mm256_fmadd_ps(av, b0, s0[i]);
        s1[i] = _mm256_fmadd_ps(av, b1, s1[i]);
      }
    }
    __m256 q0, q1;
    if constexpr (kFp8) {
      q0 = q1 = _mm256_broadcast_ss(reinterpret_cast<const float*>(b));
    } else {
      q0 = E8m0x8(b);
      q1 = E8m0x8(b + 8);
    }
    const bool acc = accumulate || k0 > 0;
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 c0 = acc ? _mm256_loadu_ps(c + i * ldc) : _mm256_setzero_ps();
      const __m256 c1 = acc ? _mm256_loadu_ps(c + i * ldc + 8) : _mm256_setzero_ps();
      _mm256_storeu_ps(c + i * ldc, _mm256_fmadd_ps(s0[i], q0, c0));
      _mm256_storeu_ps(c + i * ldc + 8, _mm256_fmadd_ps(s1[i], q1, c1));
    }
  }
}

void Tile(int rows, int64_t k, const float* a, const void* b, DType bt, float* c, int64_t ldc,
          bool accumulate) {
  const auto* bb = static_cast<const uint8_t*>(b);
  switch (bt) {
    case DType::kF8E4M3:
      ForRows(rows, [&]<int R>() { QuantTileT<R, DType::kF8E4M3>(k, a, bb, c, ldc, accumulate); });
      break;
    case DType::kF4:
      ForRows(rows, [&]<int R>() { QuantTileT<R, DType::kF4>(k, a, bb, c, ldc, accumulate); });
      break;
    case DType::kBF16:
      ForRows(rows, [&]<int R>() { TileT<R, DType::kBF16>(k, a, bb, c, ldc, accumulate); });
      break;
    case DType::kF16:
      ForRows(rows, [&]<int R>() { TileT<R, DType::kF16>(k, a, bb, c, ldc, accumulate); });
      break;
    default:
      ForRows(rows, [&]<int R>() { TileT<R, DType::kF32>(k, a, bb, c, ldc, accumulate); });
      break;
  }
}

// Writes the values of k rows of one panel's codes (from a block start) to dq [k][kNr].
template <DType BT>
void DecodeT(int64_t k, const uint8_t* b, float* dq) {
  constexpr int kBk = BlockK(BT);
  constexpr int kHeader = QuantHeaderBytes(BT, kNr);
  constexpr int kRowBytes = QuantRowBytes(BT, kNr);
  for (int64_t k0 = 0; k0 < k; k0 += kBk, b += kHeader + kBk * kRowBytes) {
    const int64_t len = std::min<int64_t>(kBk, k - k0);
    const uint8_t* codes = b + kHeader;
    for (int64_t kk = 0; kk < len; ++kk, codes += kRowBytes) {
      __m256 b0, b1;
      LoadCodes<BT>(codes, &b0, &b1);
      _mm256_storeu_ps(dq + (k0 + kk) * kNr, b0);
      _mm256_storeu_ps(dq + (k0 + kk) * kNr + 8, b1);
    }
  }
}

void Decode(int64_t k, const void* b, DType bt, float* dq) {
  const auto* bb = static_cast<const uint8_t*>(b);
  if (bt == DType::kF8E4M3) {
    DecodeT<DType::kF8E4M3>(k, bb, dq);
  } else {
    DecodeT<DType::kF4>(k, bb, dq);
  }
}

void TileDecoded(int rows, int64_t k, const float* a, const float* dq, const void* b, DType bt,
                 float* c, int64_t ldc, bool accumulate) {
  const auto* bb = static_cast<const uint8_t*>(b);
  if (bt == DType::kF8E4M3) {
    ForRows(rows, [&]<int R>() {
      QuantTileT<R, DType::kF8E4M3, true>(k, a, bb, c, ldc, accumulate, dq);
    });
  } else {
    ForRows(rows,
            [&]<int R>() { QuantTileT<R, DType::kF4, true>(k, a, bb, c, ldc, accumulate, dq); });
  }
}

}  // namespace

const CpuKernels& Avx2Kernels() {
  static const CpuKernels k{
      Isa::kAvx2, kMr,         kNr, 256, &Tile, &elementwise::Activate, &elementwise::AddBias,
      &Decode,    &TileDecoded};
  return k;
}

}  // namespace moerun::kernels_internal
