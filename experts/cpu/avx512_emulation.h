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
