// A weight matrix W [N out][K in] packed into column panels for the CPU GEMM kernels.
//
// Panel p holds outputs [p*nr, (p+1)*nr) for every k: nr values per k, k-major, so a kernel
// streams one panel front to back. N is padded with zero columns to a whole number of panels.
//
// Plain types (F32, BF16, F16) keep the checkpoint's values (half the bytes to stream for 16-bit
// types); kernels widen them to fp32 exactly. Within one k-row, BF16 panels interleave the two
// halves of the panel (slot 2j = column j, slot 2j+1 = column j + nr/2) so that widening is one
// shift and one mask per vector; F32 and F16 panels are in column order.
//
// Block-scaled types stay quantized: kF8E4M3 is FP8 with one scale per 128 x 128 block (DeepSeek
// -V3's format), kF4 is MXFP4 (e2m1 codes, one e8m0 scale per column and 32 inputs: gpt-oss's).
// A panel is then a run of k blocks of block_k() rows (128 FP8, 32 MXFP4; the last one may be
// shorter), each a header and `len` rows of codes:
//   FP8 block:   64-byte header holding, at offset 0, the f32 scale_inv of the block x 2^8 (the
//                kernels widen a code to e4m3 x 2^-8 through the F16 converter), then len rows of
//                nr codes, one byte per column, in column order. A panel lies inside one 128-row
//                block of W (nr divides 128), so it has one scale per k block.
//   MXFP4 block: nr bytes of e8m0 scales (column order), then the codes of len rows, half a byte
//                each, where F4SlotOf puts them (nr 16: row by row; wider panels: 8 rows at a
//                time, each column's 8 codes in one 32-bit word).
// Resident bytes are the checkpoint's (1 byte or half a byte a weight) plus the scales and the
// headers (FP8: 64 bytes per 128 x nr codes). Immutable after packing; thread-safe to read.
#pragma once

#include <cstdint>
#include <functional>

#include "base/aligned_buffer.h"
#include "base/dtype.h"

namespace moerun {

inline int PanelSlot(DType t, int nr, int j) {
  if (t == DType::kBF16) {
    const int half = nr / 2;
    return j < half ? 2 * j : 2 * (j - half) + 1;
  }
  return j;
}

// The types a packed matrix can hold: F32, BF16, F16, and the block-scaled FP8 and MXFP4.
constexpr bool IsBlockScaled(DType t) { return t == DType::kF8E4M3 || t == DType::kF4; }
inline bool IsPackableType(DType t) { return IsKernelWeightType(t) || IsBlockScaled(t); }
// What users call the held types: "f32", "bf16", "f16", "fp8", "mxfp4".
inline const char* HeldTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
    case DType::kF8E4M3:
      return "fp8";
    case DType::kF4:
      return "mxfp4";
    default:
      return DTypeName(t);
  }
}
// Bytes a weight costs as held (codes and scales; not the panels' padding or FP8's headers):
// 4, 2, 2, 1 + 4 / 128^2 (FP8), 0.5 + 1 / 32 (MXFP4).
inline double HeldBytesPerWeight(DType t) {
  if (t == DType::kF8E4M3) return 1.0 + 4.0 / (128.0 * 128.0);
  if (t == DType::kF4) return 0.5 + 1.0 / 32.0;
  return DTypeBits(t) / 8.0;
}
// Rows of k per scale block (1 for the plain types).
constexpr int BlockK(DType t) { return t == DType::kF8E4M3 ? 128 : t == DType::kF4 ? 32 : 1; }
inline constexpr int kFp8HeaderBytes = 64;
// Block-scaled panels of width nr: bytes of a k block's header and of one k row of codes.
constexpr int QuantHeaderBytes(DType t, int nr) {
  return t == DType::kF8E4M3 ? kFp8HeaderBytes : nr;
}
constexpr int QuantRowBytes(DType t, int nr) { return t == DType::kF8E4M3 ? nr : nr / 2; }

// MXFP4 codes of one k block. nr 16 (the scalar and AVX2 kernels): row by row, nr/2 bytes a row,
// the code of column j in nibble F4Nibble(16, j) (nibble 2b is byte b's low half, 2b + 1 its high
// half): byte 2i (i < 4) holds column i low and column i + 4 high, byte 2i + 1 column i + 8 low
// and column i + 12 high, so one byte shuffle per half-byte and a shift or a mask give a vector's
// 8 columns in order. Wider panels (32: AVX-512): groups of 8 rows, 4 * nr bytes each, made of
// little-endian 32-bit words, one per column in column order; bits 4i..4i+3 of column j's word
// hold row 8g + i. One vector load then holds 16 columns x 8 rows, and row i's codes are the low
// nibbles of the words after a shift by 4i (what a 16-entry permute reads). A short last block is
// stored as whole groups (its padding rows' codes stay 0).
constexpr int kF4GroupRows = 8;
constexpr int F4Nibble(int nr, int j) {
  if (nr == 16) return 2 * (2 * (j % 4) + j / 8) + (j / 4) % 2;
  return j < nr / 2 ? 2 * j : 2 * (j - nr / 2) + 1;
}
// Rows of codes a block of `len` rows stores.
constexpr int64_t F4StoredRows(int nr, int64_t len) {
  return nr == 16 ? len : (len + kF4GroupRows - 1) / kF4GroupRows * kF4GroupRows;
}
struct F4Slot {
  int64_t byte;  // from the block's first code byte
  int shift;     // 0: the low nibble, 4: the high one
};
// Where the code of row r (of the block) and column j lives.
constexpr F4Slot F4SlotOf(int nr, int64_t r, int j) {
  if (nr == 16) {
    const int nibble = F4Nibble(nr, j);
    return {r * (nr / 2) + nibble / 2, (nibble % 2) * 4};
  }
  const int64_t g = r / kF4GroupRows;
  const int i = static_cast<int>(r % kF4GroupRows);
  return {g * kF4GroupRows * (nr / 2) + 4 * j + i / 2, (i % 2) * 4};
}
// The e2m1 code (0..15) of row r and column j in a block's codes of a panel of width nr.
inline uint8_t F4CodeAt(const uint8_t* codes, int nr, int64_t r, int j) {
  const F4Slot s = F4SlotOf(nr, r, j);
  return static_cast<uint8_t>((codes[s.byte] >> s.shift) & 0xF);
}

// Reads row n (output n) of a logical W [N][K] into out[0..K).
using RowReader = std::function<void(int64_t n, float* out)>;
// Reads row n of a block-scaled W: codes[0..K) one code a byte (MXFP4: 0..15), and scales[0..
// ceil(K / BlockK)) as floats (FP8: the block's scale_inv; MXFP4: the power of two 2^(s-127)).
// Returns false for a row that stays zero (padding).
using QuantRowReader = std::function<bool(int64_t n, uint8_t* codes, float* scales)>;

class PackedMatrix {
 public:
  PackedMatrix() = default;
  PackedMatrix(DType dtype, int64_t n, int64_t k, int nr);

  DType dtype() const { return dtype_; }
  bool block_scaled() const { return IsBlockScaled(dtype_); }
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  int nr() const { return nr_; }
  int64_t panels() const { return panels_; }
  int64_t n_padded() const { return panels_ * nr_; }
  bool empty() const { return n_ == 0; }
  size_t bytes() const { return buf_.size(); }
  int block_k() const { return BlockK(dtype_); }

  // The packed bytes whole (a copy made elsewhere, e.g. an expert cache's spill file, is
  // restored into a matrix made with the same type, shape and nr).
  const uint8_t* data() const { return buf_.as<uint8_t>(); }
  uint8_t* mutable_data() { return buf_.as<uint8_t>(); }
  const uint8_t* panel(int64_t p) const { return buf_.as<uint8_t>() + p * panel_bytes_; }
  int64_t panel_bytes() const { return panel_bytes_; }
  // Where panel p's data for k rows from k0 on begin; k0 is a multiple of block_k().
  const uint8_t* PanelAt(int64_t p, int64_t k0) const {
    return panel(p) + (block_scaled() ? (k0 / block_k()) * block_bytes_ : k0 * nr_ * elem_bytes_);
  }

  // Plain types: stores row n, rounded to the matrix type (exact when it came from that type).
  void SetRow(int64_t n, const float* row);
  // Block-scaled types: stores row n's codes and (FP8: its panel's) scales, as QuantRowReader.
  void SetQuantRow(int64_t n, const uint8_t* codes, const float* scales);
  // The weight as the kernels use it: plain types widened; FP8 e4m3(code) x scale_inv rounded to
  // f32; MXFP4 e2m1(code) x 2^(s-127) (exact).
  float At(int64_t n, int64_t k) const;
  // Block-scaled types: the code (FP8: byte; MXFP4: 0..15) and the scale of element (n, k).
  uint8_t CodeAt(int64_t n, int64_t k) const;
  float ScaleAt(int64_t n, int64_t k) const;
  // Fills every row from `read` (rows in parallel when `threads` > 1).
  void Fill(const RowReader& read, int threads = 1);
  void FillQuant(const QuantRowReader& read, int threads = 1);

 private:
  uint8_t* MutablePanel(int64_t p) { return buf_.as<uint8_t>() + p * panel_bytes_; }
  template <typename RowFn>
  void ForEachPanel(int threads, RowFn&& fn);

  DType dtype_ = DType::kF32;
  int64_t n_ = 0, k_ = 0;
  int nr_ = 16;
  int64_t panels_ = 0;
  int elem_bytes_ = 4;
  int64_t block_bytes_ = 0;  // block-scaled: bytes of one full k block
  int64_t panel_bytes_ = 0;
  AlignedBuffer buf_;
};

}  // namespace moerun
