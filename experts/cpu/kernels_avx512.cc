// AVX-512 kernels (Skylake-SP and later, AMD Zen 4): 12 rows x 32 columns per tile.
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c; only called when the CPU
// and OS support them.
#ifdef MOERUN_AVX512_EMULATION
// Test builds only: the same code over emulated intrinsics (experts/cpu/avx512_emulation.h).
#include "experts/cpu/avx512_emulation.h"
#define MOERUN_AVX512_KERNELS Avx512KernelsEmulated
#else
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized (and, at -Og in the sanitizer build,
// -Wuninitialized) on their own _mm512_undefined_* helpers (`__m512i __Y = __Y;`).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#define MOERUN_AVX512_KERNELS Avx512Kernels
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "experts/cpu/elementwise.h"
#include "experts/cpu/kernels.h"
#include "experts/cpu/packed_matrix.h"
#include "experts/cpu/tile_dispatch.h"

namespace moerun::kernels_internal {
namespace {

constexpr int kMr = 12;
constexpr int kNr = 32;
constexpr float kE2m1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                   -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

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

// Software prefetch distance in a panel. Quantized panels' codes are prefetched this far ahead:
// a few panels streamed side by side for one or two rows read DRAM faster than the hardware
// prefetcher alone fetches it (MXFP4, R = 1 on Zen 4: 20 -> 27 G weights/s a core). Tall plain
// tiles (5 rows or more: one panel, 8 or more FMAs per weight vector) prefetch too: the hardware
// prefetcher alone leaves such a slow single stream stalled at every page (DeepSeek-V3's shape
// from DRAM on Zen 4, one core: BF16 at 8 rows 62 -> 88 GFLOP/s, 12 rows 76 -> 99; F32 at 12
// rows 66 -> 82). Shorter plain tiles read several panels side by side fast enough;
// prefetching there made them slower.
constexpr int kPrefetchBytes = 2048;

// W panels side by side (panel w at b + w * pstride, its columns at c + w * kNr): each panel's
// columns get exactly what a one-panel tile computes; W > 1 only keeps more FMA chains in flight.
template <int R, DType BT, int W = 1>
void TileT(int64_t k, const float* a, const uint8_t* b, float* c, int64_t ldc, bool accumulate,
           int64_t pstride = 0) {
  constexpr bool kPrefetch = R > 4 && W == 1;
  constexpr int64_t kRowBytes = BT == DType::kF32 ? kNr * 4 : kNr * 2;
  __m512 c0[W][R], c1[W][R];
#pragma GCC unroll 16
  for (int w = 0; w < W; ++w) {
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const float* cw = c + i * ldc + w * kNr;
      c0[w][i] = accumulate ? _mm512_loadu_ps(cw) : _mm512_setzero_ps();
      c1[w][i] = accumulate ? _mm512_loadu_ps(cw + 16) : _mm512_setzero_ps();
    }
  }
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* ak = a + kk * kMr;
    if constexpr (kPrefetch) {
      const uint8_t* ahead = b + kk * kRowBytes + kPrefetchBytes;
#pragma GCC unroll 2
      for (int64_t o = 0; o < kRowBytes; o += 64) __builtin_prefetch(ahead + o);
    }
#pragma GCC unroll 16
    for (int w = 0; w < W; ++w) {
      __m512 b0, b1;
      LoadB<BT>(b + w * pstride, kk, &b0, &b1);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        const __m512 av = _mm512_set1_ps(ak[i]);
        c0[w][i] = _mm512_fmadd_ps(av, b0, c0[w][i]);
        c1[w][i] = _mm512_fmadd_ps(av, b1, c1[w][i]);
      }
    }
  }
#pragma GCC unroll 16
  for (int w = 0; w < W; ++w) {
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      _mm512_storeu_ps(c + i * ldc + w * kNr, c0[w][i]);
      _mm512_storeu_ps(c + i * ldc + w * kNr + 16, c1[w][i]);
    }
  }
}

// Block-scaled weights (kernels.h): per k block, sums in registers from zero, then
// c = fma(sum, scale, c) through memory.
// FP8: one k row of 32 codes -> F16 bits (sign to bit 15, exponent and mantissa to bits 13..7):
// e4m3 x 2^-8.
inline void LoadFp8Row(const uint8_t* row, __m512* b0, __m512* b1) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(w, 7), _mm512_set1_epi16(int16_t(0xBFFF)));
  *b0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  *b1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// FP8 for few rows, without the F16 converter (the slowest step above): a code sign-extended to
// 32 bits, shifted left by 20 and masked, is the f32 bit pattern of e4m3 x 2^-120 (subnormal
// codes become f32 subnormals, exactly). Multiplied by a x 2^112 it is the same exact product as
// e4m3 x 2^-8 by a, so the FMAs round to the same bits, provided a x 2^112 is finite: the caller
// checks |a| < 2^16 (block by block) and otherwise takes LoadFp8Row's path.
constexpr float kFp8FastAScale = 0x1p112f;
constexpr float kFp8FastMaxA = 0x1p16f;
inline void LoadFp8RowFast(const uint8_t* row, __m512* b0, __m512* b1) {
  const __m512i mask = _mm512_set1_epi32(int(0x87F00000u));
  const __m512i x0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  const __m512i x1 =
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16)));
  *b0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(x0, 20), mask));
  *b1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(x1, 20), mask));
}

// as = a x 2^112 for len k rows of a block packed [k][kMr] (the same layout); true when every
// one of the R rows has |a| < 2^16 (NaN fails). Whole vectors of 4 k rows (48 floats), the lanes
// of rows >= R (unwritten padding) masked out of the check; the rest row by row. Cheaper than
// row-by-row scalar work, which cost as much as the FMAs at 8 rows.
template <int R>
inline bool ScaleForFp8Fast(const float* a, int64_t len, float* as) {
  static_assert(4 * kMr == 48);
  struct LaneMask {
    alignas(64) uint32_t m[48];
  };
  static constexpr LaneMask kMask = [] {
    LaneMask l{};
    for (int j = 0; j < 48; ++j) l.m[j] = j % kMr < R ? 0x7FFFFFFFu : 0u;
    return l;
  }();
  constexpr uint32_t kMaxABits = std::bit_cast<uint32_t>(kFp8FastMaxA);
  const __m512 scale = _mm512_set1_ps(kFp8FastAScale);
  __m512i big = _mm512_setzero_si512();
  int64_t kk = 0;
  for (; kk + 4 <= len; kk += 4) {
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) {
      const int64_t j = kk * kMr + v * 16;
      const __m512 x = _mm512_loadu_ps(a + j);
      const __m512i bits =
          _mm512_and_si512(_mm512_castps_si512(x), _mm512_loadu_si512(kMask.m + v * 16));
      big = _mm512_max_epu32(big, bits);
      _mm512_storeu_ps(as + j, _mm512_mul_ps(x, scale));
    }
  }
  bool fast = _mm512_reduce_max_epu32(big) < kMaxABits;
  for (; kk < len; ++kk) {
    for (int i = 0; i < R; ++i) {
      const float x = a[kk * kMr + i];
      fast = fast && std::fabs(x) < kFp8FastMaxA;
      as[kk * kMr + i] = x * kFp8FastAScale;
    }
  }
  return fast;
}

// MXFP4: one group of 8 k rows of a panel (packed_matrix.h) is two vectors of 16 words, one per
// column; row i's codes are the words' low nibbles after a shift by 4i, and the 16-entry permute
// reads only those 4 bits (the whole code with its sign). One shift and one permute per 16
// weights, no widening.
struct F4Group {
  __m512i x0, x1;  // columns 0..15, 16..31
};
inline F4Group LoadF4Group(const uint8_t* g) {
  return {_mm512_loadu_si512(g), _mm512_loadu_si512(g + 64)};
}
// Row i's values, then the group moved on to row i + 1.
inline void NextF4Row(F4Group* g, __m512 values, __m512* b0, __m512* b1) {
  *b0 = _mm512_permutexvar_ps(g->x0, values);
  *b1 = _mm512_permutexvar_ps(g->x1, values);
  g->x0 = _mm512_srli_epi32(g->x0, 4);
  g->x1 = _mm512_srli_epi32(g->x1, 4);
}

// 2^(s - 127) for 16 e8m0 bytes (s = 0: the subnormal 2^-127).
inline __m512 E8m0x16(const uint8_t* s) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  const __m512i zero =
      _mm512_and_si512(_mm512_srai_epi32(_mm512_sub_epi32(x, _mm512_set1_epi32(1)), 31),
                       _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_slli_epi32(x, 23), zero));
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
    __m512 s0[W][R], s1[W][R];
#pragma GCC unroll 16
    for (int w = 0; w < W; ++w) {
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) s0[w][i] = s1[w][i] = _mm512_setzero_ps();
    }
    const uint8_t* codes = b + kHeader;
    const float* ak = a + k0 * kMr;
    // One k row of every panel: its values b0, b1 for panel w from next(w, &b0, &b1).
    auto fma_row = [&](const float* akr, auto&& next) {
#pragma GCC unroll 16
      for (int w = 0; w < W; ++w) {
        __m512 b0, b1;
        next(w, &b0, &b1);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
          const __m512 av = _mm512_set1_ps(akr[i]);
          s0[w][i] = _mm512_fmadd_ps(av, b0, s0[w][i]);
          s1[w][i] = _mm512_fmadd_ps(av, b1, s1[w][i]);
        }
      }
    };
    if constexpr (kDecoded) {
      for (int64_t kk = 0; kk < len; ++kk, ak += kMr) {
        const float* d = dq + (k0 + kk) * kNr;
        fma_row(ak, [&](int, __m512* b0, __m512* b1) {
          *b0 = _mm512_loadu_ps(d);
          *b1 = _mm512_loadu_ps(d + 16);
        });
      }
    } else if constexpr (kFp8) {
      alignas(64) float as[kBk * kMr];  // the block's a x 2^112, packed as a
      if (ScaleForFp8Fast<R>(ak, len, as)) {
        for (int64_t kk = 0; kk < len; ++kk, codes += kRowBytes) {
          fma_row(as + kk * kMr, [&](int w, __m512* b0, __m512* b1) {
            if ((kk & 1) == 0) __builtin_prefetch(codes + w * pstride + kPrefetchBytes);
            LoadFp8RowFast(codes + w * pstride, b0, b1);
          });
        }
      } else {
        for (int64_t kk = 0; kk < len; ++kk, codes += kRowBytes, ak += kMr) {
          fma_row(ak,
                  [&](int w, __m512* b0, __m512* b1) { LoadFp8Row(codes + w * pstride, b0, b1); });
        }
      }
    } else {
      const __m512 values = _mm512_loadu_ps(kE2m1Values);
      for (int64_t kk = 0; kk < len; kk += kF4GroupRows, codes += kF4GroupRows * kRowBytes) {
        F4Group g[W];
#pragma GCC unroll 16
        for (int w = 0; w < W; ++w) {
          g[w] = LoadF4Group(codes + w * pstride);
          __builtin_prefetch(codes + w * pstride + kPrefetchBytes);
          __builtin_prefetch(codes + w * pstride + kPrefetchBytes + 64);
        }
        auto next = [&](int w, __m512* b0, __m512* b1) { NextF4Row(&g[w], values, b0, b1); };
        if (len - kk >= kF4GroupRows) {
#pragma GCC unroll 8
          for (int r = 0; r < kF4GroupRows; ++r, ak += kMr) fma_row(ak, next);
        } else {
          for (int64_t r = kk; r < len; ++r, ak += kMr) fma_row(ak, next);
        }
      }
    }
    const bool acc = accumulate || k0 > 0;
#pragma GCC unroll 16
    for (int w = 0; w < W; ++w) {
      const uint8_t* head = b + w * pstride;
      __m512 q0, q1;
      if constexpr (kFp8) {
        float v;
        std::memcpy(&v, head, 4);
        q0 = q1 = _mm512_set1_ps(v);
      } else {
        q0 = E8m0x16(head);
        q1 = E8m0x16(head + 16);
      }
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) {
        float* cw = c + i * ldc + w * kNr;
        const __m512 c0 = acc ? _mm512_loadu_ps(cw) : _mm512_setzero_ps();
        const __m512 c1 = acc ? _mm512_loadu_ps(cw + 16) : _mm512_setzero_ps();
        _mm512_storeu_ps(cw, _mm512_fmadd_ps(s0[w][i], q0, c0));
        _mm512_storeu_ps(cw + 16, _mm512_fmadd_ps(s1[w][i], q1, c1));
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

// One or two rows: four panels at a time (8 or 16 sums in flight instead of 2 or 4); three or
// four rows: two panels.
void TilePanels(int rows, int npanels, int64_t k, const float* a, const void* b,
                int64_t panel_bytes, DType bt, float* c, int64_t ldc, bool accumulate) {
  const auto* bb = static_cast<const uint8_t*>(b);
  auto wide = [&]<int W>(int p) {
    const uint8_t* bp = bb + p * panel_bytes;
    float* cp = c + p * kNr;
    switch (rows) {
      case 1:
        return WideTile<1, W>(k, a, bp, panel_bytes, bt, cp, ldc, accumulate);
      case 2:
        return WideTile<2, W>(k, a, bp, panel_bytes, bt, cp, ldc, accumulate);
      case 3:
        return WideTile<3, 2>(k, a, bp, panel_bytes, bt, cp, ldc, accumulate);
      default:
        return WideTile<4, 2>(k, a, bp, panel_bytes, bt, cp, ldc, accumulate);
    }
  };
  int p = 0;
  if (rows <= 2) {
    for (; p + 4 <= npanels; p += 4) wide.template operator()<4>(p);
  }
  if (rows <= 4) {
    for (; p + 2 <= npanels; p += 2) wide.template operator()<2>(p);
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
    if constexpr (BT == DType::kF8E4M3) {
      for (int64_t kk = 0; kk < len; ++kk, codes += kRowBytes) {
        __m512 b0, b1;
        LoadFp8Row(codes, &b0, &b1);
        _mm512_storeu_ps(dq + (k0 + kk) * kNr, b0);
        _mm512_storeu_ps(dq + (k0 + kk) * kNr + 16, b1);
      }
    } else {
      const __m512 values = _mm512_loadu_ps(kE2m1Values);
      for (int64_t kk = 0; kk < len; kk += kF4GroupRows, codes += kF4GroupRows * kRowBytes) {
        F4Group g = LoadF4Group(codes);
        for (int64_t r = kk; r < std::min<int64_t>(len, kk + kF4GroupRows); ++r) {
          __m512 b0, b1;
          NextF4Row(&g, values, &b0, &b1);
          _mm512_storeu_ps(dq + (k0 + r) * kNr, b0);
          _mm512_storeu_ps(dq + (k0 + r) * kNr + 16, b1);
        }
      }
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

const CpuKernels& MOERUN_AVX512_KERNELS() {
  static const CpuKernels k{
      Isa::kAvx512,          kMr,     kNr,          192,        &Tile, &elementwise::Activate,
      &elementwise::AddBias, &Decode, &TileDecoded, &TilePanels};
  return k;
}

}  // namespace moerun::kernels_internal
