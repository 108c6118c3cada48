// INTERNAL to runtime/layer/cuda: the CUDA implementation behind cuda_layer.h, shared by its .cc
// files only (no caller outside this folder includes it; the public interface is cuda_layer.h).
// The duties, one file each:
//   cuda_context.cc       ContextImpl: a rank's device state (device checks, stream, events, the
//                         arena of the rank's memory plan, pinned staging tables, the graphs),
//                         and the cuda_backend::CreateContext entry point.
//   cuda_layer_upload.cc  CudaLayerImpl's setup: fitting the plan, weight upload, preset experts
//                         generated on the device.
//   cuda_layer.cc         CudaLayerImpl's forward pass (launches, CUDA graphs per bucket), timing
//                         and the grouped FFN of expert ranks.
//   cuda_layer_create.cc  the cuda_backend entry points that build a layer (Upload, UploadTo,
//                         FromPreset), with the whole layer's own context.
// Thread-safety: as cuda_layer.h: one call at a time per context.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "base/log.h"  // the context, setup and forward files log
#include "experts/cuda/ffn_kernels.h"
#include "runtime/layer/cuda/cuda_layer.h"
#include "runtime/layer/cuda/device_plan.h"
#include "runtime/layer/cuda/device_weights.h"

namespace moerun::cuda_impl {

using cuda_kernels::DevGroup;
using cuda_kernels::DevRows;
using cuda_kernels::WType;
using cuda_plan::WeightFormat;
using cuda_plan::WQuant;

// A failed CUDA call as an Internal status: "CUDA: <what>: <error name> (<error text>)".
Status CudaError(const char* what, cudaError_t e);

// Returns CudaError from the enclosing function when `expr` fails (clearing CUDA's last error).
#define MOERUN_CUDA_TRY(expr)                                    \
  do {                                                           \
    const cudaError_t moerun_err_ = (expr);                      \
    if (moerun_err_ != cudaSuccess) {                            \
      cudaGetLastError();                                        \
      return ::moerun::cuda_impl::CudaError(#expr, moerun_err_); \
    }                                                            \
  } while (0)

// The element type of the FFN's rows and hidden activations (and of plain weights): exact math
// f32 (plain weights: their type), tensor cores their bf16/f16. Block-scaled weights on tensor
// cores decode to bf16 whatever mma_type says: their rows would overflow f16 silently.
WType ElemType(WeightFormat f, const CudaLayerOptions& o);

inline size_t WBytes(WType t) { return t == WType::kF32 ? 4 : 2; }

static_assert(sizeof(DevGroup) <= cuda_plan::kGroupDescriptorBytes,
              "the memory plan's descriptor size is too small for DevGroup");

// The pinned staging tables of a context (plan.pinned_tables bytes): flags, then the row and
// tile offsets and the group descriptors of one grouped FFN call.
struct HostTables {
  int32_t* flags = nullptr;  // [0] token count, [1] error flag, [2] f16 overflow flag
  int32_t* row_off = nullptr;
  int32_t* tile_off = nullptr;
  DevGroup* groups = nullptr;
};

// Device flags (arena region "flags"): the same three ints.
constexpr int kFlagTokens = 0, kFlagError = 1, kFlagOverflow = 2;

// The error of a batch whose f16 activations overflowed.
Status OverflowError();

// A rank's device context (cuda_context.cc): owns the stream, the events, the arena, the pinned
// tables, the host memory it pinned and the graphs of its whole-layer forwards.
class ContextImpl final : public CudaRankContext {
 public:
  ContextImpl(const CudaLayerOptions& opts, cuda_plan::RankMemoryPlan plan)
      : opts_(opts), plan_(std::move(plan)) {}
  ~ContextImpl() override;

  // Checks the plan, the options and the device, then allocates everything (once).
  Status Init();

  Status PinHost(void* p, size_t bytes) override;
  void UnpinHost(void* p) override;
  const cuda_plan::RankMemoryPlan& plan() const override { return plan_; }
  const CudaLayerOptions& options() const override { return opts_; }
  std::string Describe() const override;

  // A region of the arena (null when the plan has none of that name).
  uint8_t* Region(const std::string& name) const;
  int32_t* Flags() const { return reinterpret_cast<int32_t*>(Region("flags")); }
  // Weight bytes the layers of this context hold, checked against the plan's.
  Status AddWeights(size_t bytes);
  void ForgetWeights(size_t bytes) { weights_ -= std::min(weights_, bytes); }

  cudaStream_t stream() const { return stream_; }
  cudaEvent_t ev0() const { return ev0_; }
  cudaEvent_t ev1() const { return ev1_; }
  const HostTables& tables() const { return tables_; }
  const std::string& device_name() const { return device_name_; }
  int sm() const { return sm_; }
  std::map<std::pair<const void*, int64_t>, cudaGraphExec_t>& graphs() { return graphs_; }
  // Destroys the graphs of one layer (`owner`), which is going away.
  void DropGraphs(const void* owner);

 private:
  CudaLayerOptions opts_;
  cuda_plan::RankMemoryPlan plan_;
  bool initialised_ = false;
  std::string device_name_;
  int sm_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ev0_ = nullptr, ev1_ = nullptr;
  uint8_t* arena_ = nullptr;
  uint8_t* host_ = nullptr;
  HostTables tables_;
  std::set<void*> pinned_;
  size_t weights_ = 0;
  // Whole-layer forwards: one graph per (layer, bucket).
  std::map<std::pair<const void*, int64_t>, cudaGraphExec_t> graphs_;
};

// Makes and initialises a context of `plan`.
Result<std::shared_ptr<ContextImpl>> MakeContext(const CudaLayerOptions& opts,
                                                 cuda_plan::RankMemoryPlan plan);

// One layer on the device: its weights (it owns their allocations) and descriptors; every
// per-batch buffer is a region of its context's arena.
class CudaLayerImpl final : public CudaMoeLayer {
 public:
  CudaLayerImpl(ModelSpec spec, int layer, std::shared_ptr<ContextImpl> ctx, WeightFormat format);
  ~CudaLayerImpl() override;

  // Setup (cuda_layer_upload.cc), in this order: Init, UploadGate (whole layer), one
  // UploadExpert or GenerateExpert per hosted expert (and the shared one), Finish.
  // Checks the layer against the kernels' limits and the context's plan; takes its regions.
  Status Init(bool has_shared, int64_t max_shared_inter);
  // Gate rows (f32 [gate_rows][hidden]) and the gate's bias vectors (whole layer only).
  Status UploadGate(const MoeLayerWeights& w);
  // Copies one packed CPU expert into the device layout (group g: expert g, or the shared one):
  // values, or codes and scales (device_weights.h), as they are; nothing is upcast.
  Status UploadExpert(int g, const ExpertWeights& ew, const ActParams& act);
  // Generates preset expert e on the device (cuda_layer.h FromPreset).
  Status GenerateExpert(const PresetOptions& p, int e);
  // Copies the descriptor tables up and waits for every upload.
  Status Finish();

  // Running (cuda_layer.cc): the contracts of cuda_layer.h.
  Status Forward(const float* x, int64_t tokens, float* out) override;
  Status LastRouting(std::vector<int32_t>* ids, std::vector<float>* weights) override;
  Result<CudaTimes> Time(const float* x, int64_t tokens, int warmup, int reps) override;
  Status RunExperts(const float* rows, const std::vector<int32_t>& group_expert,
                    const std::vector<int64_t>& group_rows, float* y) override;

  const ModelSpec& spec() const override { return spec_; }
  std::string Describe() const override;
  size_t weight_bytes() const override { return weight_bytes_; }
  int64_t graphs_captured() const override { return graphs_captured_; }

 private:
  // f16 tensor cores: rows and activations in f16, whose overflow is checked.
  bool F16Rows() const { return opts_.math == CudaMath::kTensorCore && wtype_ == WType::kF16; }
  int Bm() const {
    return opts_.math == CudaMath::kExact ? cuda_kernels::kExactBm : cuda_kernels::kMmaBm;
  }
  int32_t* I32(const std::string& name) { return reinterpret_cast<int32_t*>(Region(name)); }
  float* F32(const std::string& name) { return reinterpret_cast<float*>(Region(name)); }
  // A region of the rank's arena; the layer only asks for regions its role's plan has.
  uint8_t* Region(const std::string& name) const { return ctx_->Region(name); }

  // Device memory this layer owns (cuda_layer_upload.cc).
  Result<uint8_t*> Alloc(size_t bytes, const char* what);
  Result<const void*> UploadBytes(const std::vector<uint8_t>& v, const char* what);
  Result<const float*> UploadFloats(const float* v, size_t n, const char* what);
  Status SetGroup(int g, DevGroup d, int64_t inter, const ActParams& act);

  // The forward pass (cuda_layer.cc).
  Status CheckTokens(int64_t tokens) const;
  Status SetTokens(int64_t tokens);
  cuda_kernels::FfnArgs FfnArgsFor(const DevGroup* groups, int n, int64_t rows_bound);
  void RunFfn(const cuda_kernels::FfnArgs& a);
  // The whole forward for up to `bound` tokens (the real count is read from ntok_).
  void Enqueue(int64_t bound);
  // Runs the forward of the tokens set by SetTokens: from the bucket's graph when there is one.
  Status Launch(int64_t tokens);

  ModelSpec spec_;
  int layer_;
  std::shared_ptr<ContextImpl> ctx_;  // the rank's: stream, arena, pinned tables, graphs
  CudaLayerOptions opts_;
  WeightFormat format_;  // how the experts are held
  WQuant quant_;         // block-scaled formats: which
  WType wtype_;          // the FFN's rows and activations (plain formats: the weights too)
  bool whole_;           // the whole layer (gate and routing here); else an expert rank's
  cudaStream_t stream_;  // the context's
  bool has_gate_ = false;
  std::vector<void*> allocations_;  // this layer's weights
  cuda_plan::LayerShape shape_;
  DevRows rows_;
  int32_t* ntok_ = nullptr;
  int32_t* error_flag_ = nullptr;
  int32_t* overflow_flag_ = nullptr;
  float* gate_ = nullptr;
  const float* gate_bias_ = nullptr;
  const float* selection_bias_ = nullptr;
  uint8_t* present_ = nullptr;
  int groups_ = 0;
  DevGroup* groups_dev_ = nullptr;      // whole layer: every group, for the forward
  DevGroup* run_groups_dev_ = nullptr;  // RunExperts's groups of one call
  std::vector<DevGroup> host_groups_;
  std::vector<uint8_t> present_host_;
  std::vector<int32_t> counts_;
  int64_t graphs_captured_ = 0;
  size_t weight_bytes_ = 0;        // expert values/codes and scales
  size_t other_weight_bytes_ = 0;  // biases and the gate
  int64_t last_tokens_ = 0;
};

}  // namespace moerun::cuda_impl
