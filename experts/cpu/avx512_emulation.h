// Test-only: the handful of AVX-512 intrinsics the AVX-512 kernels use, emulated lane by lane in
// portable C++ with the instructions' documented semantics (vfmadd: one rounding; vcvtph2ps:
// exact). Compiling experts/cpu/kernels_avx512.cc against this header runs that file's own tile
// logic, lane layout (the BF16 pair trick) and blocking on any CPU, so its results can be checked
// bitwise against the portable kernels even where no AVX-512 hardware is at hand.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "base/dtype.h"

struct __m512 {
  float v[16];
};
struct __m512i {
  uint32_t v[16];
};
struct __m256i {
  uint16_t v[16];
};

static inline __m512 _mm512_setzero_ps() { return __m512{}; }
static inline __m512 _mm512_set1_ps(float x) {
  __m512 r;
  for (float& v : r.v) v = x;
  return r;
}
static inline __m512 _mm512_loadu_ps(const float* p) {
  __m512 r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
static inline void _mm512_storeu_ps(float* p, __m512 a) { std::memcpy(p, a.v, sizeof a.v); }
static inline __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
  __m512 r;
  for (int i = 0; i < 16; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
static inline __m512i _mm512_loadu_si512(const void* p) {
  __m512i r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
static inline __m512i _mm512_set1_epi32(int x) {
  __m512i r;
  for (uint32_t& v : r.v) v = static_cast<uint32_t>(x);
  return r;
}
static inline __m512i _mm512_slli_epi32(__m512i a, unsigned n) {
  for (uint32_t& v : a.v) v = n > 31 ? 0 : v << n;
  return a;
}
static inline __m512i _mm512_and_si512(__m512i a, __m512i b) {
  for (int i = 0; i < 16; ++i) a.v[i] &= b.v[i];
  return a;
}
static inline __m512 _mm512_castsi512_ps(__m512i a) {
  __m512 r;
  std::memcpy(r.v, a.v, sizeof r.v);
  return r;
}
static inline __m256i _mm256_loadu_si256(const __m256i* p) {
  __m256i r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
static inline __m512 _mm512_cvtph_ps(__m256i a) {
  __m512 r;
  for (int i = 0; i < 16; ++i) r.v[i] = moerun::F16ToF32(a.v[i]);
  return r;
}

// Integer lanes of other widths, for the block-scaled (FP8, MXFP4) loads.
struct __m128i {
  uint8_t v[16];
};
static inline __m128i _mm_loadu_si128(const __m128i* p) {
  __m128i r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
static inline __m512i _mm512_cvtepi8_epi16(__m256i a) {  // 32 bytes, sign-extended to words
  int8_t b[32];
  std::memcpy(b, a.v, 32);
  uint16_t w[32];
  for (int i = 0; i < 32; ++i) w[i] = static_cast<uint16_t>(static_cast<int16_t>(b[i]));
  __m512i r;
  std::memcpy(r.v, w, 64);
  return r;
}
static inline __m512i _mm512_cvtepi8_epi32(__m128i a) {  // 16 bytes, sign-extended to dwords
  __m512i r;
  for (int i = 0; i < 16; ++i) {
    r.v[i] = static_cast<uint32_t>(static_cast<int32_t>(static_cast<int8_t>(a.v[i])));
  }
  return r;
}
static inline __m512i _mm512_cvtepu8_epi32(__m128i a) {
  __m512i r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i];
  return r;
}
static inline __m512i _mm512_slli_epi16(__m512i a, unsigned n) {
  uint16_t w[32];
  std::memcpy(w, a.v, 64);
  for (uint16_t& x : w) x = n > 15 ? 0 : static_cast<uint16_t>(x << n);
  std::memcpy(a.v, w, 64);
  return a;
}
static inline __m512i _mm512_set1_epi16(int16_t x) {
  uint16_t w[32];
  for (uint16_t& v : w) v = static_cast<uint16_t>(x);
  __m512i r;
  std::memcpy(r.v, w, 64);
  return r;
}
static inline __m256i _mm512_castsi512_si256(__m512i a) {
  __m256i r;
  std::memcpy(r.v, a.v, 32);
  return r;
}
static inline __m256i _mm512_extracti64x4_epi64(__m512i a, int i) {
  __m256i r;
  std::memcpy(r.v, reinterpret_cast<const uint8_t*>(a.v) + (i & 1) * 32, 32);
  return r;
}
static inline __m512 _mm512_permutexvar_ps(__m512i idx, __m512 a) {
  __m512 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[idx.v[i] & 15];
  return r;
}
static inline __m512i _mm512_srli_epi32(__m512i a, unsigned n) {
  for (uint32_t& v : a.v) v = n > 31 ? 0 : v >> n;
  return a;
}
static inline __m512i _mm512_srai_epi32(__m512i a, unsigned n) {
  for (uint32_t& v : a.v) v = static_cast<uint32_t>(static_cast<int32_t>(v) >> (n > 31 ? 31 : n));
  return a;
}
static inline __m512i _mm512_sub_epi32(__m512i a, __m512i b) {
  for (int i = 0; i < 16; ++i) a.v[i] -= b.v[i];
  return a;
}
static inline __m512i _mm512_or_si512(__m512i a, __m512i b) {
  for (int i = 0; i < 16; ++i) a.v[i] |= b.v[i];
  return a;
}

// For the FP8 fast path's scaling of a.
static inline __m512 _mm512_mul_ps(__m512 a, __m512 b) {
  for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i];
  return a;
}
static inline __m512i _mm512_castps_si512(__m512 a) {
  __m512i r;
  std::memcpy(r.v, a.v, sizeof r.v);
  return r;
}
static inline __m512i _mm512_setzero_si512() { return __m512i{}; }
static inline __m512i _mm512_max_epu32(__m512i a, __m512i b) {
  for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return a;
}
static inline uint32_t _mm512_reduce_max_epu32(__m512i a) {
  uint32_t m = 0;
  for (uint32_t v : a.v) m = v > m ? v : m;
  return m;
}
