#include "experts/cpu/packed_matrix.h"

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#include "base/quant_formats.h"

namespace moerun {
namespace {

int64_t RoundUp(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace

PackedMatrix::PackedMatrix(DType dtype, int64_t n, int64_t k, int nr)
    : dtype_(dtype), n_(n), k_(k), nr_(nr), panels_((n + nr - 1) / nr) {
  if (!IsPackableType(dtype)) throw std::invalid_argument("PackedMatrix: not a packable dtype");
  if (block_scaled()) {
    elem_bytes_ = 0;
    const int64_t bk = block_k();
    block_bytes_ = QuantHeaderBytes(dtype, nr) + bk * QuantRowBytes(dtype, nr);
    const int64_t rem = k % bk;
    const int64_t rem_rows = dtype == DType::kF4 ? F4StoredRows(nr, rem) : rem;
    panel_bytes_ = (k / bk) * block_bytes_ +
                   (rem ? QuantHeaderBytes(dtype, nr) + rem_rows * QuantRowBytes(dtype, nr) : 0);
    panel_bytes_ = RoundUp(panel_bytes_, 64);
  } else {
    elem_bytes_ = dtype == DType::kF32 ? 4 : 2;
    panel_bytes_ = k * nr * elem_bytes_;
  }
  buf_ = AlignedBuffer(static_cast<size_t>(panels_ * panel_bytes_));
}

void PackedMatrix::SetRow(int64_t n, const float* row) {
  const int64_t p = n / nr_;
  const int slot = PanelSlot(dtype_, nr_, static_cast<int>(n % nr_));
  uint8_t* base = MutablePanel(p);
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
      throw std::logic_error("PackedMatrix::SetRow on a block-scaled matrix");
  }
}

void PackedMatrix::SetQuantRow(int64_t n, const uint8_t* codes, const float* scales) {
  if (!block_scaled()) throw std::logic_error("PackedMatrix::SetQuantRow on a plain matrix");
  const int64_t p = n / nr_;
  const int j = static_cast<int>(n % nr_);
  const int bk = block_k();
  const int header = QuantHeaderBytes(dtype_, nr_);
  const int row_bytes = QuantRowBytes(dtype_, nr_);
  uint8_t* base = MutablePanel(p);
  for (int64_t b = 0, k0 = 0; k0 < k_; ++b, k0 += bk) {
    uint8_t* block = base + b * block_bytes_;
    const int64_t len = std::min<int64_t>(bk, k_ - k0);
    if (dtype_ == DType::kF8E4M3) {
      const float s = scales[b] * 256.0f;  // exact: a power-of-two factor
      std::memcpy(block, &s, 4);
      for (int64_t r = 0; r < len; ++r) block[header + r * row_bytes + j] = codes[k0 + r];
    } else {
      block[j] = static_cast<uint8_t>(F32ToE8m0(scales[b]));
      for (int64_t r = 0; r < len; ++r) {
        const F4Slot slot = F4SlotOf(nr_, r, j);
        uint8_t& d = block[header + slot.byte];
        d = static_cast<uint8_t>((d & ~(0xF << slot.shift)) |
                                 ((codes[k0 + r] & 0xF) << slot.shift));
      }
    }
  }
}

uint8_t PackedMatrix::CodeAt(int64_t n, int64_t k) const {
  const int bk = block_k();
  const uint8_t* block = panel(n / nr_) + (k / bk) * block_bytes_;
  const int j = static_cast<int>(n % nr_);
  const int64_t r = k % bk;
  if (dtype_ == DType::kF8E4M3) return block[QuantHeaderBytes(dtype_, nr_) + r * nr_ + j];
  return F4CodeAt(block + QuantHeaderBytes(dtype_, nr_), nr_, r, j);
}

float PackedMatrix::ScaleAt(int64_t n, int64_t k) const {
  const uint8_t* block = panel(n / nr_) + (k / block_k()) * block_bytes_;
  if (dtype_ == DType::kF8E4M3) {
    float s;
    std::memcpy(&s, block, 4);
    return s / 256.0f;
  }
  return E8m0ToF32(block[n % nr_]);
}

float PackedMatrix::At(int64_t n, int64_t k) const {
  if (dtype_ == DType::kF8E4M3) return E4m3ToF32(CodeAt(n, k)) * ScaleAt(n, k);
  if (dtype_ == DType::kF4) return E2m1ToF32(CodeAt(n, k)) * ScaleAt(n, k);
  const int64_t p = n / nr_;
  const int slot = PanelSlot(dtype_, nr_, static_cast<int>(n % nr_));
  return LoadAsF32(panel(p), dtype_, k * nr_ + slot);
}

// Rows of one panel go to one worker so that workers write disjoint cache lines.
template <typename RowFn>
void PackedMatrix::ForEachPanel(int threads, RowFn&& fn) {
  if (threads < 1) threads = 1;
  std::atomic<int64_t> next{0};
  auto work = [&] {
    auto row_fn = fn();  // per-worker state
    for (int64_t p = next++; p < panels_; p = next++) {
      for (int64_t n = p * nr_; n < std::min(n_, (p + 1) * nr_); ++n) row_fn(n);
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads && t < panels_; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

void PackedMatrix::Fill(const RowReader& read, int threads) {
  ForEachPanel(threads, [&] {
    return [this, &read, row = std::vector<float>(static_cast<size_t>(k_))](int64_t n) mutable {
      read(n, row.data());
      SetRow(n, row.data());
    };
  });
}

void PackedMatrix::FillQuant(const QuantRowReader& read, int threads) {
  const int64_t blocks = (k_ + block_k() - 1) / block_k();
  ForEachPanel(threads, [&] {
    return [this, &read, codes = std::vector<uint8_t>(static_cast<size_t>(k_)),
            scales = std::vector<float>(static_cast<size_t>(blocks))](int64_t n) mutable {
      if (read(n, codes.data(), scales.data())) SetQuantRow(n, codes.data(), scales.data());
    };
  });
}

}  // namespace moerun
