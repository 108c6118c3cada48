// Helpers of the CUDA layer's GPU tests (tests/gpu): skipping without a GPU, the CPU layer as the
// reference, making and running a CUDA layer, bitwise comparison, and the CPU grouped FFN over
// rows already grouped by expert (RunExperts' reference).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "base/thread_pool.h"
#include "experts/cpu/grouped_ffn.h"
#include "layer/cuda/cuda_device.h"
#include "layer/cuda/cuda_layer.h"
#include "layer/moe_layer.h"

#define SKIP_WITHOUT_GPU()                                                         \
  do {                                                                             \
    const ::moerun::CudaProbe probe_ = ::moerun::ProbeCuda();                      \
    if (probe_.devices.empty()) GTEST_SKIP() << "no usable GPU: " << probe_.error; \
  } while (0)

namespace moerun::testing {

inline const CpuKernels& Cpu() { return KernelsFor(BestIsa()); }

inline std::vector<float> CpuForward(const std::shared_ptr<const MoeLayerWeights>& w,
                                     const std::vector<float>& x, int64_t tokens) {
  ThreadPool pool(2);
  MoeLayer layer(w, Cpu(), &pool);
  std::vector<float> out(x.size());
  const Status s = layer.Forward(x.data(), tokens, out.data());
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

inline std::unique_ptr<CudaMoeLayer> Make(const MoeLayerWeights& w, CudaMath math,
                                          DType mma = DType::kBF16, int64_t graph_max = 256) {
  CudaLayerOptions o;
  o.math = math;
  o.mma_type = mma;
  o.max_tokens = 512;
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
  ThreadPool pool(1);
  GroupedFfn ffn(Cpu(), &pool);
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
