#include "experts/cpu/packed_matrix.h"

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

namespace moerun {

PackedMatrix::PackedMatrix(DType dtype, int64_t n, int64_t k, int nr)
    : dtype_(dtype), n_(n), k_(k), nr_(nr), panels_((n + nr - 1) / nr) {
  if (!IsKernelWeightType(dtype)) throw std::invalid_argument("PackedMatrix: not a kernel dtype");
  buf_ = AlignedBuffer(static_cast<size_t>(panels_) * k_ * nr_ * elem_bytes());
}

void PackedMatrix::SetRow(int64_t n, const float* row) {
  const int64_t p = n / nr_;
  const int slot = PanelSlot(dtype_, nr_, static_cast<int>(n % nr_));
  uint8_t* base = buf_.as<uint8_t>() + static_cast<size_t>(p) * k_ * nr_ * elem_bytes();
  switch (dtype_) {
    case DType::kF32: {
      float* d = reinterpret_cast<float*>(base) + slot;
      for (int64_t k = 0; k < k_; ++k) d[k * nr_] = row[k];
      break;
    }
    case DType::kBF16: {
      uint16_t* d = reinterpret_cast<uint16_t*>(base) + slot;
      for (int64_t k = 0; k < k_; ++k) d[k * nr_] = F32ToBf16(row[k]);
      break;
    }
    case DType::kF16: {
      uint16_t* d = reinterpret_cast<uint16_t*>(base) + slot;
      for (int64_t k = 0; k < k_; ++k) d[k * nr_] = F32ToF16(row[k]);
      break;
    }
    default:
      break;
  }
}

float PackedMatrix::At(int64_t n, int64_t k) const {
  const int64_t p = n / nr_;
  const int slot = PanelSlot(dtype_, nr_, static_cast<int>(n % nr_));
  return LoadAsF32(panel(p), dtype_, k * nr_ + slot);
}

void PackedMatrix::Fill(const RowReader& read, int threads) {
  if (threads < 1) threads = 1;
  // Rows of one panel go to one worker so that workers write disjoint cache lines.
  std::atomic<int64_t> next{0};
  auto work = [&] {
    std::vector<float> row(static_cast<size_t>(k_));
    for (int64_t p = next++; p < panels_; p = next++) {
      for (int64_t n = p * nr_; n < std::min(n_, (p + 1) * nr_); ++n) {
        read(n, row.data());
        SetRow(n, row.data());
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads && t < panels_; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

}  // namespace moerun
