// AVX2 + FMA kernels (Haswell and later, AMD Zen): 6 rows x 16 columns per tile.
// Compiled with -mavx2 -mfma -mf16c; only called when the CPU supports them.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "experts/cpu/elementwise.h"
#include "experts/cpu/kernels.h"
#include "experts/cpu/packed_matrix.h"
#include "experts/cpu/tile_dispatch.h"

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

// Tall tiles (5 or 6 rows, one panel) also prefetch their panel this far ahead, as the
// AVX-512 ones do (kernels_avx512.cc): a slow single stream stalls at every page from DRAM.
constexpr int64_t kTallTilePrefetchBytes = 2048;

// W panels side by side (panel w at b + w * pstride, its columns at c + w * kNr): each panel's
// columns get exactly what a one-panel tile computes; W > 1 only keeps more FMA chains in flight.
template <int R, DType BT, int W = 1>
void TileT(int64_t k, const float* a, const uint8_t* b, float* c, int64_t ldc, bool accumulate,
           int64_t pstride = 0) {
  constexpr bool kPrefetch = R > 4 && W == 1;
  constexpr int64_t kRowBytes = BT == DType::kF32 ? kNr * 4 : kNr * 2;
  __m256 c0[W][R], c1[W][R];
#pragma GCC unroll 8
  for (int w = 0; w < W; ++w) {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const float* cw = c + i * ldc + w * kNr;
      c0[w][i] = accumulate ? _mm256_loadu_ps(cw) : _mm256_setzero_ps();
      c1[w][i] = accumulate ? _mm256_loadu_ps(cw + 8) : _mm256_setzero_ps();
    }
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* ak = a + kk * kMr;
    // One line every 64 bytes of the panel: every row (F32) or every other row (16-bit types).
    if constexpr (kPrefetch) {
      if (kRowBytes == 64 || (kk & 1) == 0) {
        __builtin_prefetch(b + kk * kRowBytes + kTallTilePrefetchBytes);
      }
    }
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      __m256 b0, b1;
      LoadB<BT>(b + w * pstride, kk, &b0, &b1);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m256 av = _mm256_broadcast_ss(ak + i);
        c0[w][i] = _mm256_fmadd_ps(av, b0, c0[w][i]);
        c1[w][i] = _mm256_fmadd_ps(av, b1, c1[w][i]);
      }
    }
  }
#pragma GCC unroll 8
  for (int w = 0; w < W; ++w) {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      _mm256_storeu_ps(c + i * ldc + w * kNr, c0[w][i]);
      _mm256_storeu_ps(c + i * ldc + w * kNr + 8, c1[w][i]);
    }
  }
}

// MXFP4 codes to floats without arithmetic: e2m1 values are the f32 bit patterns hi << 24 |
// lo << 16 (sign included), looked up by byte shuffles into 16-bit words (hi:lo), which become
// floats as bf16 do: the even words by a shift, the odd ones by a mask. F4Nibble's nr-16 order
// puts each vector's 8 columns in order that way. `x` holds one k row in bytes 0..7 of each
// 128-bit lane (r1b0/r1b1 unused) or two (bytes 0..15: row 0 in bytes 0..7), the same in both
// lanes (a broadcast load, so no cross-lane shuffle is needed).
inline void E2m1Rows(__m256i x, __m256* r0b0, __m256* r0b1, __m256* r1b0, __m256* r1b1) {
  const __m256i hi =
      _mm256_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, char(0x80), char(0xBF),
                       char(0xBF), char(0xBF), char(0xC0), char(0xC0), char(0xC0), char(0xC0), 0x00,
                       0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, char(0x80), char(0xBF), char(0xBF),
                       char(0xBF), char(0xC0), char(0xC0), char(0xC0), char(0xC0));
  const __m256i lo =
      _mm256_setr_epi8(0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0), 0x00,
                       0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0), 0x00, 0x00,
                       char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0), 0x00, 0x00,
                       char(0x80), char(0xC0), 0x00, 0x40, char(0x80), char(0xC0));
  // Lane 0: every byte's low nibble; lane 1: its high nibble.
  const __m256i nib = _mm256_and_si256(
      _mm256_srlv_epi32(x, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
  const __m256i h = _mm256_shuffle_epi8(hi, nib);
  const __m256i l = _mm256_shuffle_epi8(lo, nib);
  const __m256i top = _mm256_set1_epi32(int(0xffff0000u));
  // Row 0's words: lane 0 the low nibbles of bytes 0..7, lane 1 their high nibbles.
  const __m256i w0 = _mm256_unpacklo_epi8(l, h);
  *r0b0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));  // even bytes: columns 0..7
  *r0b1 = _mm256_castsi256_ps(_mm256_and_si256(w0, top));  // odd bytes: columns 8..15
  if (r1b0 != nullptr) {
    const __m256i w1 = _mm256_unpackhi_epi8(l, h);
    *r1b0 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    *r1b1 = _mm256_castsi256_ps(_mm256_and_si256(w1, top));
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
    int64_t bytes;
    std::memcpy(&bytes, row, sizeof(bytes));
    E2m1Rows(_mm256_set1_epi64x(bytes), b0, b1, nullptr, nullptr);
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
// W panels side by side as in TileT (kDecoded: W = 1).
template <int R, DType BT, bool kDecoded = false, int W = 1>
void QuantTileT(int64_t k, const float* a, const uint8_t* b, float* c, int64_t ldc, bool accumulate,
                const float* dq = nullptr, int64_t pstride = 0) {
  static_assert(!kDecoded || W == 1);
  constexpr bool kFp8 = BT == DType::kF8E4M3;
  constexpr int kBk = BlockK(BT);
  constexpr int kHeader = QuantHeaderBytes(BT, kNr);
  constexpr int kRowBytes = QuantRowBytes(BT, kNr);
  for (int64_t k0 = 0; k0 < k; k0 += kBk, b += kHeader + kBk * kRowBytes) {
    const int64_t len = std::min<int64_t>(kBk, k - k0);
    __m256 s0[W][R], s1[W][R];
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) s0[w][i] = s1[w][i] = _mm256_setzero_ps();
    }
    const uint8_t* codes = b + kHeader;
    const float* ak = a + k0 * kMr;
    int64_t kk = 0;
    if constexpr (BT == DType::kF4 && !kDecoded) {
      // Two k rows per decode (one 16-byte load per panel), summed in k order.
      for (; kk + 2 <= len; kk += 2, codes += 2 * kRowBytes, ak += 2 * kMr) {
#pragma GCC unroll 8
        for (int w = 0; w < W; ++w) {
          __m256 r0b0, r0b1, r1b0, r1b1;
          E2m1Rows(_mm256_broadcastsi128_si256(
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + w * pstride))),
                   &r0b0, &r0b1, &r1b0, &r1b1);
#pragma GCC unroll 8
          for (int i = 0; i < R; ++i) {
            const __m256 av = _mm256_broadcast_ss(ak + i);
            s0[w][i] = _mm256_fmadd_ps(av, r0b0, s0[w][i]);
            s1[w][i] = _mm256_fmadd_ps(av, r0b1, s1[w][i]);
          }
#pragma GCC unroll 8
          for (int i = 0; i < R; ++i) {
            const __m256 av = _mm256_broadcast_ss(ak + kMr + i);
            s0[w][i] = _mm256_fmadd_ps(av, r1b0, s0[w][i]);
            s1[w][i] = _mm256_fmadd_ps(av, r1b1, s1[w][i]);
          }
        }
      }
    }
    for (; kk < len; ++kk, codes += kRowBytes, ak += kMr) {
#pragma GCC unroll 8
      for (int w = 0; w < W; ++w) {
        __m256 b0, b1;
        if constexpr (kDecoded) {
          b0 = _mm256_loadu_ps(dq + (k0 + kk) * kNr);
          b1 = _mm256_loadu_ps(dq + (k0 + kk) * kNr + 8);
        } else {
          LoadCodes<BT>(codes + w * pstride, &b0, &b1);
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
          const __m256 av = _mm256_broadcast_ss(ak + i);
          s0[w][i] = _mm256_fmadd_ps(av, b0, s0[w][i]);
          s1[w][i] = _mm256_fmadd_ps(av, b1, s1[w][i]);
        }
      }
    }
    const bool acc = accumulate || k0 > 0;
#pragma GCC unroll 8
    for (int w = 0; w < W; ++w) {
      const uint8_t* head = b + w * pstride;
      __m256 q0, q1;
      if constexpr (kFp8) {
        q0 = q1 = _mm256_broadcast_ss(reinterpret_cast<const float*>(head));
      } else {
        q0 = E8m0x8(head);
        q1 = E8m0x8(head + 8);
      }
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        float* cw = c + i * ldc + w * kNr;
        const __m256 c0 = acc ? _mm256_loadu_ps(cw) : _mm256_setzero_ps();
        const __m256 c1 = acc ? _mm256_loadu_ps(cw + 8) : _mm256_setzero_ps();
        _mm256_storeu_ps(cw, _mm256_fmadd_ps(s0[w][i], q0, c0));
        _mm256_storeu_ps(cw + 8, _mm256_fmadd_ps(s1[w][i], q1, c1));
      }
    }
  }
}

// W panels of one type for R rows.
template <int R, int W>
void WideTile(int64_t k, const float* a, const uint8_t* b, int64_t pstride, DType bt, float* c,
              int64_t ldc, bool accumulate) {
  ForWeightType(bt, [&]<DType BT>() {
    if constexpr (IsBlockScaled(BT)) {
      QuantTileT<R, BT, false, W>(k, a, b, c, ldc, accumulate, nullptr, pstride);
    } else {
      TileT<R, BT, W>(k, a, b, c, ldc, accumulate, pstride);
    }
  });
}

void Tile(int rows, int64_t k, const float* a, const void* b, DType bt, float* c, int64_t ldc,
          bool accumulate) {
  const auto* bb = static_cast<const uint8_t*>(b);
  ForRows<kMr>(rows, [&]<int R>() { WideTile<R, 1>(k, a, bb, 0, bt, c, ldc, accumulate); });
}

// One row: four panels at a time (8 sums in flight instead of 2); two rows: two panels.
void TilePanels(int rows, int npanels, int64_t k, const float* a, const void* b,
                int64_t panel_bytes, DType bt, float* c, int64_t ldc, bool accumulate) {
  const auto* bb = static_cast<const uint8_t*>(b);
  int p = 0;
  if (rows == 1) {
    for (; p + 4 <= npanels; p += 4)
      WideTile<1, 4>(k, a, bb + p * panel_bytes, panel_bytes, bt, c + p * kNr, ldc, accumulate);
  }
  if (rows <= 2) {
    for (; p + 2 <= npanels; p += 2) {
      if (rows == 1) {
        WideTile<1, 2>(k, a, bb + p * panel_bytes, panel_bytes, bt, c + p * kNr, ldc, accumulate);
      } else {
        WideTile<2, 2>(k, a, bb + p * panel_bytes, panel_bytes, bt, c + p * kNr, ldc, accumulate);
      }
    }
  }
  for (; p < npanels; ++p) Tile(rows, k, a, bb + p * panel_bytes, bt, c + p * kNr, ldc, accumulate);
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
    ForRows<kMr>(rows, [&]<int R>() {
      QuantTileT<R, DType::kF8E4M3, true>(k, a, bb, c, ldc, accumulate, dq);
    });
  } else {
    ForRows<kMr>(
        rows, [&]<int R>() { QuantTileT<R, DType::kF4, true>(k, a, bb, c, ldc, accumulate, dq); });
  }
}

}  // namespace

const CpuKernels& Avx2Kernels() {
  static const CpuKernels k{Isa::kAvx2,
                            kMr,
                            kNr,
                            256,
                            &Tile,
                            &elementwise::Activate,
                            &elementwise::AddBias,
                            &Decode,
                            &TileDecoded,
                            &TilePanels};
  return k;
}

}  // namespace moerun::kernels_internal
