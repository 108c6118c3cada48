// CudaLayerImpl's setup (cuda_layer_impl.h): fitting the layer to its context's memory plan, the
// upload of the gate and the experts' weights (values, or codes and scales, as they are), and the
// preset experts generated on the device.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "runtime/layer/cuda/cuda_layer_impl.h"
#include "runtime/layer/cuda/preset_gen.h"
#include "runtime/model/preset_hash.h"

namespace moerun::cuda_impl {

WType ElemType(WeightFormat f, const CudaLayerOptions& o) {
  switch (f) {
    case WeightFormat::kF32:
      return WType::kF32;
    case WeightFormat::kBF16:
      return WType::kBF16;
    case WeightFormat::kF16:
      return WType::kF16;
    default:
      return o.math == CudaMath::kExact ? WType::kF32 : WType::kBF16;
  }
}

CudaLayerImpl::CudaLayerImpl(ModelSpec spec, int layer, std::shared_ptr<ContextImpl> ctx,
                             WeightFormat format)
    : spec_(std::move(spec)),
      layer_(layer),
      ctx_(std::move(ctx)),
      opts_(ctx_->options()),
      format_(format),
      quant_(cuda_plan::QuantOf(format)),
      wtype_(ElemType(format, opts_)),
      whole_(ctx_->plan().role == cuda_plan::DeviceRole::kWholeLayer),
      stream_(ctx_->stream()) {}

CudaLayerImpl::~CudaLayerImpl() {
  cudaSetDevice(opts_.device);
  cudaStreamSynchronize(stream_);
  ctx_->DropGraphs(this);
  for (void* p : allocations_) cudaFree(p);
  ctx_->ForgetWeights(weight_bytes_ + other_weight_bytes_);
}

Status CudaLayerImpl::Init(bool has_shared, int64_t max_shared_inter) {
  const ModelSpec& s = spec_;
  const cuda_plan::RankMemoryPlan& plan = ctx_->plan();
  MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
  if (s.num_experts > 512) {
    return Status::Unsupported(
        fmt::format("CUDA layer: {} experts; the gate kernel handles at most 512", s.num_experts));
  }
  if (s.top_k < 1 || s.top_k > 64 || s.top_k > s.num_experts) {
    return Status::Unsupported(fmt::format(
        "CUDA layer: top-k {} of {} experts; the route kernel handles 1..64, at most the expert "
        "count",
        s.top_k, s.num_experts));
  }
  if (s.gate.n_group > 256) return Status::Unsupported("CUDA layer: more than 256 expert groups");
  if (opts_.math == CudaMath::kTensorCore && s.hidden % 8 != 0) {
    return Status::Unsupported(fmt::format(
        "CUDA layer: tensor-core math needs hidden % 8 == 0 (hidden {}); use exact math",
        s.hidden));
  }
  groups_ = s.num_experts + (has_shared ? 1 : 0);
  shape_.max_tokens = opts_.max_tokens;
  shape_.hidden = s.hidden;
  shape_.experts = s.num_experts;
  shape_.top_k = s.top_k;
  shape_.gate_rows = s.num_experts + (s.shared_gated ? 1 : 0);
  shape_.shared = has_shared;  // as the CPU layer: the weights decide, not the spec
  shape_.max_inter_padded =
      std::max(cuda_plan::PaddedInter(s.expert_inter), cuda_plan::PaddedInter(max_shared_inter));
  shape_.act_bytes = opts_.math == CudaMath::kExact ? 4 : 2;
  // The layer must fit the context's plan (the arena is shared by every layer of the rank).
  if (plan.hidden != s.hidden || plan.act_stride < shape_.max_inter_padded ||
      plan.act_bytes != shape_.act_bytes || plan.format != format_) {
    return Status::Internal(fmt::format(
        "CUDA layer {}: hidden {}, intermediate {} ({}) do not fit the rank's memory plan "
        "(hidden {}, intermediate {}, {})",
        layer_, s.hidden, shape_.max_inter_padded, cuda_plan::WeightFormatName(format_),
        plan.hidden, plan.act_stride, cuda_plan::WeightFormatName(plan.format)));
  }
  if (whole_ && (plan.max_groups != groups_ ||
                 plan.max_rows < cuda_plan::FfnRows(shape_, opts_.max_tokens))) {
    return Status::Internal("CUDA layer: the whole-layer memory plan is for another layer");
  }
  uint8_t* f = ctx_->Region("flags");
  rows_.row_off = reinterpret_cast<int32_t*>(ctx_->Region("row_off"));
  rows_.tile_off = reinterpret_cast<int32_t*>(ctx_->Region("tile_off"));
  run_groups_dev_ = reinterpret_cast<DevGroup*>(ctx_->Region(whole_ ? "run_groups" : "groups"));
  if (f == nullptr || rows_.row_off == nullptr || rows_.tile_off == nullptr ||
      run_groups_dev_ == nullptr) {
    return Status::Internal("CUDA layer: the memory plan lacks the group tables");
  }
  ntok_ = reinterpret_cast<int32_t*>(f) + kFlagTokens;
  error_flag_ = reinterpret_cast<int32_t*>(f) + kFlagError;
  overflow_flag_ = reinterpret_cast<int32_t*>(f) + kFlagOverflow;
  host_groups_.assign(static_cast<size_t>(groups_), DevGroup{});
  present_host_.assign(static_cast<size_t>(s.num_experts), 0);
  if (!whole_) return Status::Ok();
  // The whole layer: the router's buffers and the layer's own descriptor table.
  rows_.counts = I32("counts");
  rows_.row_token = I32("row_token");
  rows_.slot_row = I32("slot_row");
  groups_dev_ = reinterpret_cast<DevGroup*>(ctx_->Region("groups"));
  present_ = ctx_->Region("present");
  MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
  MOERUN_CUDA_TRY(cudaMemsetAsync(present_, 0, static_cast<size_t>(s.num_experts), stream_));
  const size_t gate_floats = static_cast<size_t>(shape_.gate_rows * s.hidden);
  MOERUN_ASSIGN_OR_RETURN(uint8_t * g, Alloc(gate_floats * 4, "gate"));
  gate_ = reinterpret_cast<float*>(g);
  return Status::Ok();
}

Status CudaLayerImpl::UploadGate(const MoeLayerWeights& w) {
  const int64_t h = spec_.hidden;
  if (!whole_ || w.gate.n() < shape_.gate_rows || w.gate.k() != h) return Status::Ok();
  has_gate_ = true;
  std::vector<float> gate(static_cast<size_t>(shape_.gate_rows * h));
  for (int64_t r = 0; r < shape_.gate_rows; ++r) {
    for (int64_t k = 0; k < h; ++k) gate[static_cast<size_t>(r * h + k)] = w.gate.At(r, k);
  }
  MOERUN_CUDA_TRY(cudaMemcpy(gate_, gate.data(), gate.size() * 4, cudaMemcpyHostToDevice));
  other_weight_bytes_ += gate.size() * 4;
  const auto e = static_cast<size_t>(spec_.num_experts);
  if (!w.gate_bias.empty()) {
    MOERUN_ASSIGN_OR_RETURN(gate_bias_, UploadFloats(w.gate_bias.data(), e, "router bias"));
    other_weight_bytes_ += e * 4;
  }
  if (!w.selection_bias.empty()) {
    MOERUN_ASSIGN_OR_RETURN(selection_bias_,
                            UploadFloats(w.selection_bias.data(), e, "selection bias"));
    other_weight_bytes_ += e * 4;
  }
  return ctx_->AddWeights(other_weight_bytes_);
}

Status CudaLayerImpl::UploadExpert(int g, const ExpertWeights& ew, const ActParams& act) {
  const int64_t h = ew.hidden, inter = ew.inter, ip = cuda_plan::PaddedInter(inter);
  const std::string what =
      g < spec_.num_experts ? fmt::format("expert {}", g) : std::string("the shared expert");
  MOERUN_ASSIGN_OR_RETURN(
      const cuda_plan::ExpertImage img,
      cuda_plan::BuildExpertImage(ew, format_, opts_.math == CudaMath::kTensorCore, what));
  DevGroup d;
  MOERUN_ASSIGN_OR_RETURN(d.w13, UploadBytes(img.w13, "expert weights"));
  MOERUN_ASSIGN_OR_RETURN(d.w2, UploadBytes(img.w2, "expert weights"));
  if (quant_ != WQuant::kNone) {
    MOERUN_ASSIGN_OR_RETURN(d.s13, UploadBytes(img.s13, "expert weight scales"));
    MOERUN_ASSIGN_OR_RETURN(d.s2, UploadBytes(img.s2, "expert weight scales"));
  }
  weight_bytes_ += img.bytes();
  MOERUN_RETURN_IF_ERROR(ctx_->AddWeights(img.bytes()));
  if (!ew.bias_gate.empty()) {
    std::vector<float> bg(static_cast<size_t>(ip), 0.0f), bu(bg);
    std::copy_n(ew.bias_gate.begin(), inter, bg.begin());
    std::copy_n(ew.bias_up.begin(), inter, bu.begin());
    MOERUN_ASSIGN_OR_RETURN(d.bias_g, UploadFloats(bg.data(), bg.size(), "expert bias"));
    MOERUN_ASSIGN_OR_RETURN(d.bias_u, UploadFloats(bu.data(), bu.size(), "expert bias"));
    other_weight_bytes_ += 2 * bg.size() * 4;
    MOERUN_RETURN_IF_ERROR(ctx_->AddWeights(2 * bg.size() * 4));
  }
  if (!ew.bias_down.empty()) {
    MOERUN_ASSIGN_OR_RETURN(
        d.bias_d, UploadFloats(ew.bias_down.data(), static_cast<size_t>(h), "expert bias"));
    other_weight_bytes_ += static_cast<size_t>(h) * 4;
    MOERUN_RETURN_IF_ERROR(ctx_->AddWeights(static_cast<size_t>(h) * 4));
  }
  return SetGroup(g, d, inter, act);
}

Status CudaLayerImpl::GenerateExpert(const PresetOptions& p, int e) {
  if (quant_ != WQuant::kNone) {
    return Status::Internal("CUDA layer: block-scaled presets are built on the host");
  }
  const int64_t h = spec_.hidden, inter = spec_.expert_inter, ip = cuda_plan::PaddedInter(inter);
  const size_t b13 = static_cast<size_t>(2 * ip * h) * WBytes(wtype_);
  const size_t b2 = static_cast<size_t>(h * ip) * WBytes(wtype_);
  DevGroup d;
  MOERUN_ASSIGN_OR_RETURN(uint8_t * p13, Alloc(b13, "expert weights"));
  MOERUN_ASSIGN_OR_RETURN(uint8_t * p2, Alloc(b2, "expert weights"));
  cuda_kernels::LaunchPresetExpert(p.seed, layer_, e, h, inter, ip, wtype_,
                                   std::sqrt(3.0f / static_cast<float>(h)),
                                   std::sqrt(3.0f / static_cast<float>(inter)), p13, p2, stream_);
  MOERUN_CUDA_TRY(cudaGetLastError());
  weight_bytes_ += b13 + b2;
  MOERUN_RETURN_IF_ERROR(ctx_->AddWeights(b13 + b2));
  d.w13 = p13;
  d.w2 = p2;
  if (spec_.expert_bias) {  // as BuildPresetLayer: tensors 6/7/8, fan-in 3, x 0.1
    auto bias = [&](int tensor, int64_t n, int64_t pad) {
      std::vector<float> v(static_cast<size_t>(pad), 0.0f);
      const uint64_t rs = preset_hash::RowSeed(p.seed, layer_, tensor, e, 0);
      const float a = std::sqrt(3.0f / 3.0f);
      for (int64_t c = 0; c < n; ++c)
        v[static_cast<size_t>(c)] = preset_hash::Element(rs, c, a) * 0.1f;
      return v;
    };
    const auto bg = bias(6, inter, ip), bu = bias(7, inter, ip), bd = bias(8, h, h);
    MOERUN_ASSIGN_OR_RETURN(d.bias_g, UploadFloats(bg.data(), bg.size(), "expert bias"));
    MOERUN_ASSIGN_OR_RETURN(d.bias_u, UploadFloats(bu.data(), bu.size(), "expert bias"));
    MOERUN_ASSIGN_OR_RETURN(d.bias_d, UploadFloats(bd.data(), bd.size(), "expert bias"));
    const size_t bias_bytes = (bg.size() + bu.size() + bd.size()) * 4;
    other_weight_bytes_ += bias_bytes;
    MOERUN_RETURN_IF_ERROR(ctx_->AddWeights(bias_bytes));
  }
  return SetGroup(e, d, inter, spec_.RoutedAct(layer_));
}

Status CudaLayerImpl::Finish() {
  if (whole_) {
    MOERUN_CUDA_TRY(cudaMemcpy(groups_dev_, host_groups_.data(),
                               sizeof(DevGroup) * host_groups_.size(), cudaMemcpyHostToDevice));
    MOERUN_CUDA_TRY(
        cudaMemcpy(present_, present_host_.data(), present_host_.size(), cudaMemcpyHostToDevice));
  }
  // The uploads ran on the legacy stream, the generators on ours: wait for both.
  MOERUN_CUDA_TRY(cudaDeviceSynchronize());
  spdlog::info("cuda: layer {}: {}", layer_, Describe());
  return Status::Ok();
}

Result<uint8_t*> CudaLayerImpl::Alloc(size_t bytes, const char* what) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, bytes < 1 ? 1 : bytes);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Status::ResourceExhausted(fmt::format("CUDA: allocating {:.1f} MiB for the {}: {}",
                                                 static_cast<double>(bytes) / (1 << 20), what,
                                                 cudaGetErrorString(e)));
  }
  allocations_.push_back(p);
  return static_cast<uint8_t*>(p);
}

Result<const void*> CudaLayerImpl::UploadBytes(const std::vector<uint8_t>& v, const char* what) {
  MOERUN_ASSIGN_OR_RETURN(uint8_t * p, Alloc(v.size(), what));
  if (!v.empty()) MOERUN_CUDA_TRY(cudaMemcpy(p, v.data(), v.size(), cudaMemcpyHostToDevice));
  return static_cast<const void*>(p);
}

Result<const float*> CudaLayerImpl::UploadFloats(const float* v, size_t n, const char* what) {
  MOERUN_ASSIGN_OR_RETURN(uint8_t * p, Alloc(n * 4, what));
  MOERUN_CUDA_TRY(cudaMemcpy(p, v, n * 4, cudaMemcpyHostToDevice));
  return reinterpret_cast<const float*>(p);
}

Status CudaLayerImpl::SetGroup(int g, DevGroup d, int64_t inter, const ActParams& act) {
  d.inter = static_cast<int32_t>(inter);
  d.inter_pad = static_cast<int32_t>(cuda_plan::PaddedInter(inter));
  d.act = act;
  host_groups_[static_cast<size_t>(g)] = d;
  if (g < spec_.num_experts) present_host_[static_cast<size_t>(g)] = 1;
  return Status::Ok();
}

}  // namespace moerun::cuda_impl
