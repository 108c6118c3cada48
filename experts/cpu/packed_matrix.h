// A weight matrix W [N out][K in] packed into column panels for the CPU GEMM kernels.
//
// Panel p holds outputs [p*nr, (p+1)*nr) for every k: nr values per k, k-major, so a kernel
// streams one panel front to back. N is padded with zero columns to a whole number of panels.
// Values keep the checkpoint's type (F32, BF16 or F16: half the bytes to stream for 16-bit types);
// kernels widen them to fp32 exactly. Within one k-row, BF16 panels interleave the two halves of
// the panel (slot 2j = column j, slot 2j+1 = column j + nr/2) so that widening is one shift and one
// mask per vector; F32 and F16 panels are in column order. Immutable after packing; thread-safe to
// read.
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

// Reads row n (output n) of a logical W [N][K] into out[0..K).
using RowReader = std::function<void(int64_t n, float* out)>;

class PackedMatrix {
 public:
  PackedMatrix() = default;
  PackedMatrix(DType dtype, int64_t n, int64_t k, int nr);

  DType dtype() const { return dtype_; }
  int64_t n() const { return n_; }
  int64_t k() const { return k_; }
  int nr() const { return nr_; }
  int64_t panels() const { return panels_; }
  int64_t n_padded() const { return panels_ * nr_; }
  bool empty() const { return n_ == 0; }
  size_t bytes() const { return buf_.size(); }
  int elem_bytes() const { return dtype_ == DType::kF32 ? 4 : 2; }

  const uint8_t* panel(int64_t p) const {
    return buf_.as<uint8_t>() + static_cast<size_t>(p) * k_ * nr_ * elem_bytes();
  }
  // Stores row n; values are rounded to the matrix type (exact when they came from that type).
  void SetRow(int64_t n, const float* row);
  float At(int64_t n, int64_t k) const;
  // Fills every row from `read` (rows in parallel when `threads` > 1).
  void Fill(const RowReader& read, int threads = 1);

 private:
  DType dtype_ = DType::kF32;
  int64_t n_ = 0, k_ = 0;
  int nr_ = 16;
  int64_t panels_ = 0;
  AlignedBuffer buf_;
};

}  // namespace moerun
