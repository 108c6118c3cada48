// Block-scaled expert weights on the device (FP8 e4m3 with 128 x 128 block scales, MXFP4 e2m1 with
// an e8m0 scale per row and 32 inputs: base/quant_formats.h), in plain C++ (MOERUN_HD) so that the
// kernels and the host-side tests decode with the same code. A matrix keeps the row order of
// tile_layout.h (W13: gate/up blocks interleaved, inter padded; W2: [hidden][inter_pad]); `ld` is
// its row length in weights (W13: hidden, W2: inter_pad):
//   FP8    codes  [rows][ld] bytes;
//          scales [ceil(rows / 64)][ceil(ld / 128)] f32: the block's scale_inv x 2^8, one per 64
//          device rows (kColBlock: a tensor-core tile's rows) and 128 inputs.
//   MXFP4  codes  [rows][ceil(ld / 2)] bytes: input k in byte k / 2, low nibble for even k;
//          scales [rows][ceil(ld / 32)] e8m0 bytes.
// The kernels multiply by Fp8Value(code) (e4m3 x 2^-8) or E2m1Value(code) and apply the scale once
// per block to the block's fp32 sum: the CPU kernels' contract (experts/cpu/kernels.h), so the
// exact path stays bitwise the CPU's. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <cstring>

#include "base/host_device.h"
#include "experts/cuda/tile_layout.h"

namespace moerun::cuda_plan {

// How a layer's expert weights are held on the device.
enum class WQuant : uint8_t { kNone, kFp8, kMxfp4 };

constexpr int kFp8BlockK = 128;           // inputs per FP8 scale
constexpr int kFp8ScaleRows = kColBlock;  // device rows per FP8 scale
constexpr int kMxBlockK = 32;             // inputs per MXFP4 scale

MOERUN_HD inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
MOERUN_HD inline int BlockK(WQuant q) { return q == WQuant::kFp8 ? kFp8BlockK : kMxBlockK; }

// Bytes of one row of codes and the scale table's shape.
MOERUN_HD inline int64_t CodeRowBytes(WQuant q, int64_t ld) {
  return q == WQuant::kMxfp4 ? CeilDiv(ld, 2) : ld;
}
MOERUN_HD inline int64_t ScaleCols(WQuant q, int64_t ld) { return CeilDiv(ld, BlockK(q)); }
MOERUN_HD inline int64_t ScaleRows(WQuant q, int64_t rows) {
  return q == WQuant::kFp8 ? CeilDiv(rows, kFp8ScaleRows) : rows;
}
MOERUN_HD inline int64_t ScaleBytes(WQuant q) { return q == WQuant::kFp8 ? 4 : 1; }
// The scale of element (row, k): its index in the scale table.
MOERUN_HD inline int64_t ScaleIndex(WQuant q, int64_t row, int64_t k, int64_t ld) {
  const int64_t r = q == WQuant::kFp8 ? row / kFp8ScaleRows : row;
  return r * ScaleCols(q, ld) + k / BlockK(q);
}

MOERUN_HD inline float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}
MOERUN_HD inline float QuietNaN() { return BitsToFloat(0x7FC00000u); }

// e4m3(c) x 2^-8, exact (what the CPU kernels multiply by); NaN for the NaN codes.
MOERUN_HD inline float Fp8Value(uint8_t c) {
  if ((c & 0x7Fu) == 0x7Fu) return QuietNaN();
  const int e = (c >> 3) & 0xF, m = c & 7;
  // normal: (8 + m) x 2^(e - 10) x 2^-8; subnormal (e = 0): m x 2^-9 x 2^-8. Both < 2^24 x 2^-18.
  const int mag = e != 0 ? (8 + m) << e : m << 1;
  const float v = static_cast<float>(mag) * 0x1p-18f;
  return (c & 0x80u) ? -v : v;
}

// e2m1 through a 16-entry table in one register: nibble i of kE2m1Twice is 2 x |value of code i|.
constexpr uint32_t kE2m1Twice = 0xC8643210u;  // 0, 0.5, 1, 1.5, 2, 3, 4, 6 (doubled)
MOERUN_HD inline float E2m1Value(uint32_t code) {
  const float v = static_cast<float>((kE2m1Twice >> ((code & 7u) * 4)) & 0xFu) * 0.5f;
  return (code & 8u) ? -v : v;
}

// 2^(s - 127), exact (s = 0: the f32 subnormal 2^-127); NaN for 0xFF.
MOERUN_HD inline float E8m0Value(uint8_t s) {
  if (s == 0xFFu) return QuietNaN();
  return BitsToFloat(s == 0 ? 0x00400000u : static_cast<uint32_t>(s) << 23);
}

// MXFP4 code of input k of a row of codes.
MOERUN_HD inline uint32_t MxCode(const uint8_t* row, int64_t k) {
  const uint32_t b = row[k / 2];
  return (k & 1) ? b >> 4 : b & 0xFu;
}

}  // namespace moerun::cuda_plan
