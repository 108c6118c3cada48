// Test helpers: block-scaled expert weights as checkpoints hold them (FP8 e4m3 with one scale per
// 128 x 128 block, MXFP4 e2m1 with one e8m0 scale per row and 32 inputs), quantized from random
// values, packed for a CPU kernel variant; and layers whose experts are such weights. Independent
// of the presets (runtime/model/preset.cc), so the CUDA tests need nothing but PackExpert.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "base/quant_formats.h"
#include "base/thread_pool.h"
#include "experts/cpu/expert_weights.h"
#include "runtime/model/layer_weights.h"

namespace moerun::testing {

// A random W [n][k] (uniform in +-sqrt(3 / k)) quantized blockwise: FP8 scale_inv = amax / 448 per
// 128 x 128 block (`fp8_block_rows` rows: 128 as DeepSeek-V3; smaller to make scales differ
// within a device block), MXFP4 scale = the power of two that brings the 32-block's amax to <= 6.
struct QuantTensor {
  DType type = DType::kF8E4M3;
  int64_t n = 0, k = 0;
  int64_t block_rows = 128;
  std::vector<uint8_t> codes;  // [n][k]
  std::vector<float> scales;   // FP8 [ceil(n / block_rows)][ceil(k / 128)]; MXFP4 [n][ceil(k / 32)]

  int64_t bk() const { return type == DType::kF8E4M3 ? kFp8BlockRows : kMxGroup; }
  int64_t kblocks() const { return (k + bk() - 1) / bk(); }
  float Scale(int64_t row, int64_t b) const {
    const int64_t r = type == DType::kF8E4M3 ? row / block_rows : row;
    return scales[static_cast<size_t>(r * kblocks() + b)];
  }
  QuantRowReader Reader() const {
    return [this](int64_t row, uint8_t* out, float* s) {
      std::copy_n(codes.begin() + row * k, k, out);
      for (int64_t b = 0; b < kblocks(); ++b) s[b] = Scale(row, b);
      return true;
    };
  }
};

inline QuantTensor RandomQuantTensor(DType type, int64_t n, int64_t k, uint32_t seed,
                                     int64_t fp8_block_rows = 128) {
  QuantTensor q;
  q.type = type;
  q.n = n;
  q.k = k;
  q.block_rows = fp8_block_rows;
  std::vector<float> w(static_cast<size_t>(n * k));
  uint32_t s = seed * 2654435761u + 12345u;
  const float a = std::sqrt(3.0f / static_cast<float>(k));
  for (float& v : w) {
    s = s * 1664525u + 1013904223u;
    v = (static_cast<float>(s >> 8) / static_cast<float>(1 << 24) * 2.0f - 1.0f) * a;
  }
  q.codes.assign(w.size(), 0);
  const int64_t bk = q.bk();
  const int64_t rb = type == DType::kF8E4M3 ? fp8_block_rows : 1;
  const int64_t srows = (n + rb - 1) / rb;
  q.scales.assign(static_cast<size_t>(srows * q.kblocks()), 1.0f);
  for (int64_t br = 0; br < srows; ++br) {
    for (int64_t b = 0; b < q.kblocks(); ++b) {
      float amax = 0.0f;
      for (int64_t r = br * rb; r < std::min(n, (br + 1) * rb); ++r) {
        for (int64_t c = b * bk; c < std::min(k, (b + 1) * bk); ++c) {
          amax = std::max(amax, std::fabs(w[static_cast<size_t>(r * k + c)]));
        }
      }
      float scale;
      if (type == DType::kF8E4M3) {
        scale = amax > 0.0f ? amax / kE4m3Max : 1.0f;
      } else {
        scale = amax > 0.0f ? std::ldexp(1.0f, static_cast<int>(std::ceil(std::log2(amax / 6.0f))))
                            : 1.0f;
      }
      q.scales[static_cast<size_t>(br * q.kblocks() + b)] = scale;
      for (int64_t r = br * rb; r < std::min(n, (br + 1) * rb); ++r) {
        for (int64_t c = b * bk; c < std::min(k, (b + 1) * bk); ++c) {
          const float v = w[static_cast<size_t>(r * k + c)] / scale;
          q.codes[static_cast<size_t>(r * k + c)] =
              type == DType::kF8E4M3 ? F32ToE4m3(v) : F32ToE2m1(v);
        }
      }
    }
  }
  return q;
}

// One block-scaled expert: W_gate, W_up [inter][hidden], W_down [hidden][inter], packed for
// `kernels`; biases copied from `biases` (a packed expert of the same shape) when given.
inline ExpertWeights RandomQuantExpert(const CpuKernels& kernels, DType type, int64_t hidden,
                                       int64_t inter, uint32_t seed,
                                       const ExpertWeights* biases = nullptr,
                                       int64_t fp8_block_rows = 128) {
  const QuantTensor g = RandomQuantTensor(type, inter, hidden, seed * 3 + 1, fp8_block_rows);
  const QuantTensor u = RandomQuantTensor(type, inter, hidden, seed * 3 + 2, fp8_block_rows);
  const QuantTensor d = RandomQuantTensor(type, hidden, inter, seed * 3 + 3, fp8_block_rows);
  ExpertSource src;
  src.qgate = g.Reader();
  src.qup = u.Reader();
  src.qdown = d.Reader();
  if (biases != nullptr && !biases->bias_gate.empty()) {
    src.bias_gate.assign(biases->bias_gate.begin(), biases->bias_gate.begin() + inter);
    src.bias_up.assign(biases->bias_up.begin(), biases->bias_up.begin() + inter);
  }
  if (biases != nullptr && !biases->bias_down.empty()) {
    src.bias_down.assign(biases->bias_down.begin(), biases->bias_down.begin() + hidden);
  }
  return PackExpert(kernels, type, hidden, inter, src);
}

// Layer `w` with every loaded expert and the shared expert replaced by random block-scaled ones of
// the same shapes (gate, router biases and expert biases kept). The experts are made on every core
// (each from its own seed: the same weights whatever the thread count).
inline std::shared_ptr<const MoeLayerWeights> Quantized(MoeLayerWeights w,
                                                        const CpuKernels& kernels, DType type,
                                                        uint32_t seed = 1) {
  ThreadPool pool(0);
  pool.ParallelFor(static_cast<int64_t>(w.experts.size()), [&](int64_t e, int) {
    ExpertWeights& ew = w.experts[static_cast<size_t>(e)];
    if (ew.w13.empty()) return;
    ew = RandomQuantExpert(kernels, type, ew.hidden, ew.inter,
                           seed * 1000 + static_cast<uint32_t>(e), &ew);
  });
  if (w.shared) {
    w.shared = RandomQuantExpert(kernels, type, w.shared->hidden, w.shared->inter,
                                 seed * 1000 + 999, &*w.shared);
  }
  w.dtype = type;
  return std::make_shared<const MoeLayerWeights>(std::move(w));
}

}  // namespace moerun::testing
