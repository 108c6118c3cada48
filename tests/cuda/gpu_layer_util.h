// Helpers of the CUDA layer's GPU tests (tests/gpu): skipping without a GPU, the test layers'
// shapes (GpuSpec) and a cache of their weights, the CPU layer as the reference, making and
// running a CUDA layer, bitwise comparison, and the CPU grouped FFN over rows already grouped by
// expert (RunExperts' reference).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "base/thread_pool.h"
#include "experts/cpu/grouped_ffn.h"
#include "runtime/layer/cuda/cuda_device.h"
#include "runtime/layer/cuda/cuda_layer.h"
#include "runtime/layer/moe_layer.h"
#include "tests/cuda/quant_layers.h"
#include "tests/unit/layer_fixtures.h"

#define SKIP_WITHOUT_GPU()                                                         \
  do {                                                                             \
    const ::moerun::CudaProbe probe_ = ::moerun::ProbeCuda();                      \
    if (probe_.devices.empty()) GTEST_SKIP() << "no usable GPU: " << probe_.error; \
  } while (0)

namespace moerun::testing {

// The CUDA layers' arena (Make) and the token count of the tests' large batches: with top-k over
// the experts of GpuSpec, each expert gets about 250 rows, several m-tiles of the tensor-core
// kernels (64 rows) and of the exact ones (32 rows), the last one partial.
constexpr int64_t kMaxTokens = 1024;
constexpr int64_t kTokens = 1000;

// The layers of the CUDA-vs-CPU tests: SmallSpec's families (gates, activations, expert counts)
// at sizes that take the FFN kernels (experts/cuda/ffn_kernels.cu) through several tiles in every
// direction and through partial ones:
//   hidden 1048 or 1096: a multiple of 8 (the tensor-core loads take 8 values) but not of the
//     exact kernels' 32-wide k stage nor of a scale block (FP8 128 inputs, MXFP4 32), so GEMM1's
//     last k stage and last scale block are partial (1048: 24 of 32 and 24 of 128; 1096: 8 of 32,
//     72 of 128); GEMM2's last column tile (32 or 64 wide) and last FP8 64-row scale block too;
//   expert intermediate 520 or 600, shared 552-616: not a multiple of the 64-column tile (GEMM1's
//     last column tile is partial; GEMM2's k runs into the zero padding to 64) nor of 32 (a
//     partial MXFP4 block in GEMM2's k).
inline ModelSpec GpuSpec(Family family) {
  ModelSpec s = SmallSpec(family);
  const bool odd =
      family == Family::kQwen2Moe || family == Family::kDeepseekV3 || family == Family::kStep3p5;
  s.hidden = odd ? 1096 : 1048;
  s.expert_inter = odd ? 600 : 520;
  if (s.shared_inter > 0) {
    s.shared_inter = family == Family::kQwen2Moe ? 584 : family == Family::kDeepseekV3 ? 552 : 616;
  }
  return s;
}

// The GPU tests' layer of `family`: a preset of GpuSpec (seed 7) of `dtype`; for FP8 and MXFP4
// the f32 preset with every expert replaced by random block-scaled ones (quant_layers.h). Built
// once per (family, dtype) and kept for the process: several tests use each, and building one
// costs more host time than the tests' forwards on the GPU (about 30 layers, a few GB at most).
inline std::shared_ptr<const MoeLayerWeights> GpuLayer(Family family, DType dtype) {
  static std::map<std::pair<Family, DType>, std::shared_ptr<const MoeLayerWeights>> cache;
  auto& w = cache[{family, dtype}];
  if (w) return w;
  const bool quant = dtype == DType::kF8E4M3 || dtype == DType::kF4;
  PresetOptions o;
  o.seed = 7;
  o.dtype = quant ? DType::kF32 : dtype;
  auto built = BuildPresetLayer(GpuSpec(family), KernelsFor(BestIsa()), o);
  if (!built.ok()) throw std::runtime_error(built.status().ToString());
  w = quant ? Quantized(std::move(built).value(), KernelsFor(BestIsa()), dtype, 7)
            : std::make_shared<const MoeLayerWeights>(std::move(built).value());
  return w;
}

inline const CpuKernels& Cpu() { return KernelsFor(BestIsa()); }

// The CPU reference's threads: one per core (its output does not depend on the count).
inline ThreadPool& RefPool() {
  static ThreadPool pool(0);
  return pool;
}

// The CPU layer's output for x [tokens][hidden] and, when asked, its routing.
inline std::vector<float> CpuForward(const std::shared_ptr<const MoeLayerWeights>& w,
                                     const std::vector<float>& x, int64_t tokens,
                                     std::vector<int32_t>* ids = nullptr,
                                     std::vector<float>* weights = nullptr) {
  MoeLayer layer(w, Cpu(), &RefPool());
  std::vector<float> out(x.size());
  const Status s = layer.Forward(x.data(), tokens, out.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  if (ids != nullptr) *ids = layer.last_routing().ids;
  if (weights != nullptr) *weights = layer.last_routing().weights;
  return out;
}

inline std::unique_ptr<CudaMoeLayer> Make(const MoeLayerWeights& w, CudaMath math,
                                          DType mma = DType::kBF16, int64_t graph_max = 256) {
  CudaLayerOptions o;
  o.math = math;
  o.mma_type = mma;
  o.max_tokens = kMaxTokens;
  o.graph_max_tokens = graph_max;
  auto layer = CudaMoeLayer::Upload(w, o);
  EXPECT_TRUE(layer.ok()) << layer.status().ToString();
  return layer.ok() ? std::move(layer).value() : nullptr;
}

inline std::vector<float> GpuForward(CudaMoeLayer& layer, const std::vector<float>& x,
                                     int64_t tokens) {
  std::vector<float> out(x.size());
  const Status s = layer.Forward(x.data(), tokens, out.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

inline bool Bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// The CPU grouped FFN over rows grouped as RunExperts takes them (group_expert[g] < 0: the shared
// expert): y [rows][hidden].
inline std::vector<float> CpuGroupedRows(const MoeLayerWeights& w,
                                         const std::vector<int32_t>& group_expert,
                                         const std::vector<int64_t>& group_rows,
                                         const std::vector<float>& x) {
  const int64_t h = w.spec.hidden;
  GroupedFfn ffn(Cpu(), &RefPool());
  std::vector<ExpertGroup> groups;
  int64_t total = 0;
  for (size_t g = 0; g < group_expert.size(); ++g) {
    const int32_t e = group_expert[g];
    const ExpertWeights* ew = e < 0 ? &*w.shared : &w.experts[static_cast<size_t>(e)];
    const ActParams act = e < 0 ? w.spec.SharedAct(w.layer) : w.spec.RoutedAct(w.layer);
    groups.push_back(ExpertGroup{ew, act, total, group_rows[g]});
    total += group_rows[g];
  }
  std::vector<int32_t> row_token(static_cast<size_t>(total));
  for (int64_t r = 0; r < total; ++r) row_token[static_cast<size_t>(r)] = static_cast<int32_t>(r);
  const int64_t ldy = ffn.PaddedHidden(h);
  std::vector<float> padded(static_cast<size_t>(total * ldy)), y(static_cast<size_t>(total * h));
  ffn.Run(groups, x.data(), h, row_token.data(), padded.data(), ldy);
  for (int64_t r = 0; r < total; ++r) {
    std::memcpy(y.data() + r * h, padded.data() + r * ldy, static_cast<size_t>(h) * 4);
  }
  return y;
}

}  // namespace moerun::testing
