// CudaMoeLayer: weights on the device; the rank's context (one stream, one arena laid out by the
// rank's memory plan, pinned staging tables, the graphs) shared by all its layers; the kernels
// enqueued in order on that stream (or replayed from a CUDA graph per bucket).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <utility>

#include "base/log.h"
#include "experts/cuda/ffn_kernels.h"
#include "router/cuda/gate_kernels.h"
#include "router/cuda/group_kernels.h"
#include "runtime/layer/cuda/cuda_backend.h"
#include "runtime/layer/cuda/cuda_layer.h"
#include "runtime/layer/cuda/device_plan.h"
#include "runtime/layer/cuda/device_weights.h"
#include "runtime/layer/cuda/kernel_check.h"
#include "runtime/layer/cuda/preset_gen.h"
#include "runtime/model/preset_hash.h"

namespace moerun {
namespace {

using cuda_kernels::DevGroup;
using cuda_kernels::DevRows;
using cuda_kernels::WType;
using cuda_plan::WeightFormat;
using cuda_plan::WQuant;

Status CudaError(const char* what, cudaError_t e) {
  return Status::Internal(
      fmt::format("CUDA: {}: {} ({})", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

#define MOERUN_CUDA_TRY(expr)               \
  do {                                      \
    const cudaError_t moerun_err_ = (expr); \
    if (moerun_err_ != cudaSuccess) {       \
      cudaGetLastError();                   \
      return CudaError(#expr, moerun_err_); \
    }                                       \
  } while (0)

// The element type of the FFN's rows and hidden activations (and of plain weights): exact math
// f32 (plain weights: their type), tensor cores their bf16/f16. Block-scaled weights on tensor
// cores decode to bf16 whatever mma_type says: their rows would overflow f16 silently.
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

size_t WBytes(WType t) { return t == WType::kF32 ? 4 : 2; }

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

Status OverflowError() {
  return Status::InvalidArgument(
      "an activation exceeds f16's range (65504): use bf16 tensor cores or --math exact");
}

class ContextImpl final : public CudaRankContext {
 public:
  ContextImpl(const CudaLayerOptions& opts, cuda_plan::RankMemoryPlan plan)
      : opts_(opts), plan_(std::move(plan)) {}

  ~ContextImpl() override {
    if (!initialised_) return;
    cudaSetDevice(opts_.device);
    cudaStreamSynchronize(stream_);
    for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(exec);
    for (void* p : pinned_) cudaHostUnregister(p);
    if (arena_ != nullptr) cudaFree(arena_);
    if (host_ != nullptr) cudaFreeHost(host_);
    if (ev0_ != nullptr) cudaEventDestroy(ev0_);
    if (ev1_ != nullptr) cudaEventDestroy(ev1_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Status Init() {
    if (plan_.role == cuda_plan::DeviceRole::kCpuRouter) {
      return Status::InvalidArgument("CUDA context: a CPU router's plan holds no device memory");
    }
    if (plan_.tensor_cores != (opts_.math == CudaMath::kTensorCore)) {
      return Status::Internal("CUDA context: the memory plan is for another math");
    }
    if (opts_.max_tokens < 1 || opts_.max_tokens > (int64_t{1} << 20)) {
      return Status::InvalidArgument("CUDA layer: max_tokens must be in 1..1048576");
    }
    int count = 0;
    const cudaError_t probe = cudaGetDeviceCount(&count);
    if (probe != cudaSuccess || count == 0) {
      cudaGetLastError();
      return Status::Unavailable(
          fmt::format("--device cuda: no usable GPU ({})",
                      probe != cudaSuccess ? cudaGetErrorString(probe) : "no CUDA device"));
    }
    if (opts_.device < 0 || opts_.device >= count) {
      return Status::InvalidArgument(
          fmt::format("CUDA device {} does not exist ({} visible)", opts_.device, count));
    }
    MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
    cudaDeviceProp prop{};
    MOERUN_CUDA_TRY(cudaGetDeviceProperties(&prop, opts_.device));
    device_name_ = prop.name;
    sm_ = prop.major * 10 + prop.minor;
    if (opts_.math == CudaMath::kTensorCore && prop.major < 8) {
      return Status::Unsupported(fmt::format(
          "CUDA layer: tensor-core math needs sm_80 or newer ({} is sm_{})", prop.name, sm_));
    }
    MOERUN_RETURN_IF_ERROR(CheckKernelImagesFor(opts_.device));
    initialised_ = true;
    MOERUN_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MOERUN_CUDA_TRY(cudaEventCreate(&ev0_));
    MOERUN_CUDA_TRY(cudaEventCreate(&ev1_));
    // The arena: exactly the plan's (aliases share their region's bytes).
    const size_t arena_bytes = std::max<size_t>(plan_.arena.total, 256);
    void* a = nullptr;
    if (const cudaError_t e = cudaMalloc(&a, arena_bytes); e != cudaSuccess) {
      cudaGetLastError();
      return Status::ResourceExhausted(fmt::format(
          "CUDA: allocating the rank's {:.1f} MiB arena on {}: {}",
          static_cast<double>(arena_bytes) / (1 << 20), device_name_, cudaGetErrorString(e)));
    }
    arena_ = static_cast<uint8_t*>(a);
    void* h = nullptr;
    MOERUN_CUDA_TRY(cudaMallocHost(&h, std::max<size_t>(plan_.pinned_tables, 64)));
    host_ = static_cast<uint8_t*>(h);
    const auto g1 = static_cast<size_t>(plan_.max_groups + 1);
    tables_.flags = reinterpret_cast<int32_t*>(host_);
    tables_.row_off = reinterpret_cast<int32_t*>(host_ + 64);
    tables_.tile_off = tables_.row_off + g1;
    tables_.groups = reinterpret_cast<DevGroup*>(host_ + 64 + 8 * g1);
    if (64 + 8 * g1 + g1 * sizeof(DevGroup) > plan_.pinned_tables) {
      return Status::Internal("CUDA context: the plan's pinned tables are too small");
    }
    return Status::Ok();
  }

  Status PinHost(void* p, size_t bytes) override {
    if (p == nullptr || bytes == 0 || pinned_.count(p) != 0) return Status::Ok();
    MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
    const cudaError_t e = cudaHostRegister(p, bytes, cudaHostRegisterDefault);
    if (e == cudaErrorHostMemoryAlreadyRegistered) {
      // Page-locked already by its other user (the nccl transport's RegisterMemory): pinned all
      // the same, and that user unregisters it, so it is not ours to release.
      cudaGetLastError();
      return Status::Ok();
    }
    MOERUN_CUDA_TRY(e);
    pinned_.insert(p);
    return Status::Ok();
  }
  void UnpinHost(void* p) override {
    if (pinned_.erase(p) == 0) return;
    cudaSetDevice(opts_.device);
    cudaStreamSynchronize(stream_);  // no copy from or to it is left in flight
    cudaHostUnregister(p);
  }
  const cuda_plan::RankMemoryPlan& plan() const override { return plan_; }
  const CudaLayerOptions& options() const override { return opts_; }
  std::string Describe() const override {
    return fmt::format("{} (sm_{}, device {}), {} role, {} math, {}", device_name_, sm_,
                       opts_.device, cuda_plan::DeviceRoleName(plan_.role),
                       CudaMathName(opts_.math), plan_.arena.Describe());
  }

  // A region of the arena (null when the plan has none of that name).
  uint8_t* Region(const std::string& name) const {
    const cuda_plan::ArenaPlan::Region* r = plan_.arena.Find(name);
    return r == nullptr ? nullptr : arena_ + r->offset;
  }
  int32_t* Flags() const { return reinterpret_cast<int32_t*>(Region("flags")); }
  // Weight bytes the layers of this context hold, checked against the plan's.
  Status AddWeights(size_t bytes) {
    weights_ += bytes;
    const size_t planned = plan_.weight_bytes();
    if (weights_ > planned) {
      return Status::Internal(fmt::format(
          "CUDA context: the layers hold {} weight bytes, the memory plan {}", weights_, planned));
    }
    return Status::Ok();
  }
  void ForgetWeights(size_t bytes) { weights_ -= std::min(weights_, bytes); }

  cudaStream_t stream() const { return stream_; }
  cudaEvent_t ev0() const { return ev0_; }
  cudaEvent_t ev1() const { return ev1_; }
  const HostTables& tables() const { return tables_; }
  const std::string& device_name() const { return device_name_; }
  int sm() const { return sm_; }
  std::map<std::pair<const void*, int64_t>, cudaGraphExec_t>& graphs() { return graphs_; }
  void DropGraphs(const void* owner) {
    for (auto it = graphs_.begin(); it != graphs_.end();) {
      if (it->first.first == owner) {
        cudaGraphExecDestroy(it->second);
        it = graphs_.erase(it);
      } else {
        ++it;
      }
    }
  }

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

class CudaLayerImpl final : public CudaMoeLayer {
 public:
  CudaLayerImpl(ModelSpec spec, int layer, std::shared_ptr<ContextImpl> ctx, WeightFormat format)
      : spec_(std::move(spec)),
        layer_(layer),
        ctx_(std::move(ctx)),
        opts_(ctx_->options()),
        format_(format),
        quant_(cuda_plan::QuantOf(format)),
        wtype_(ElemType(format, opts_)),
        whole_(ctx_->plan().role == cuda_plan::DeviceRole::kWholeLayer),
        stream_(ctx_->stream()) {}

  ~CudaLayerImpl() override {
    cudaSetDevice(opts_.device);
    cudaStreamSynchronize(stream_);
    ctx_->DropGraphs(this);
    for (void* p : allocations_) cudaFree(p);
    ctx_->ForgetWeights(weight_bytes_ + other_weight_bytes_);
  }

  Status Init(bool has_shared, int64_t max_shared_inter) {
    const ModelSpec& s = spec_;
    const cuda_plan::RankMemoryPlan& plan = ctx_->plan();
    MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
    if (s.num_experts > 512) {
      return Status::Unsupported(fmt::format(
          "CUDA layer: {} experts; the gate kernel handles at most 512", s.num_experts));
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

  // Gate rows (f32 [gate_rows][hidden]) and the gate's bias vectors (whole layer only).
  Status UploadGate(const MoeLayerWeights& w) {
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

  // Copies one packed CPU expert into the device layout (group g: expert g, or the shared one):
  // values, or codes and scales (device_weights.h), as they are; nothing is upcast.
  Status UploadExpert(int g, const ExpertWeights& ew, const ActParams& act) {
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

  // Generates preset expert e on the device (cuda_layer.h FromPreset).
  Status GenerateExpert(const PresetOptions& p, int e) {
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

  Status Finish() {
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

  Status Forward(const float* x, int64_t tokens, float* out) override {
    MOERUN_RETURN_IF_ERROR(CheckTokens(tokens));
    if (tokens == 0) return Status::Ok();
    if (!has_gate_) {
      return Status::InvalidArgument(
          whole_ ? "CUDA layer: no router weights were loaded"
                 : "CUDA layer: an expert rank's layer has no router (RunExperts only)");
    }
    MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
    const size_t bytes = static_cast<size_t>(tokens * spec_.hidden) * 4;
    MOERUN_CUDA_TRY(cudaMemcpyAsync(F32("x"), x, bytes, cudaMemcpyHostToDevice, stream_));
    MOERUN_RETURN_IF_ERROR(SetTokens(tokens));
    MOERUN_RETURN_IF_ERROR(Launch(tokens));
    MOERUN_CUDA_TRY(cudaMemcpyAsync(out, F32("out"), bytes, cudaMemcpyDeviceToHost, stream_));
    int32_t* host_flags = ctx_->tables().flags;
    MOERUN_CUDA_TRY(cudaMemcpyAsync(host_flags + kFlagError, error_flag_, 2 * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream_));
    MOERUN_CUDA_TRY(cudaStreamSynchronize(stream_));
    last_tokens_ = tokens;
    if (host_flags[kFlagError] > 0) {
      return Status::Internal(
          fmt::format("token routed to expert {}, which this process has not loaded",
                      host_flags[kFlagError] - 1));
    }
    if (host_flags[kFlagOverflow] != 0) return OverflowError();
    return Status::Ok();
  }

  Status LastRouting(std::vector<int32_t>* ids, std::vector<float>* weights) override {
    const auto n = static_cast<size_t>(last_tokens_ * spec_.top_k);
    ids->resize(n);
    weights->resize(n);
    if (n == 0) return Status::Ok();
    // On the layer's stream: the forward that wrote them is ordered before these copies.
    MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
    MOERUN_CUDA_TRY(
        cudaMemcpyAsync(ids->data(), I32("ids"), n * 4, cudaMemcpyDeviceToHost, stream_));
    MOERUN_CUDA_TRY(
        cudaMemcpyAsync(weights->data(), F32("weights"), n * 4, cudaMemcpyDeviceToHost, stream_));
    MOERUN_CUDA_TRY(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

  Result<CudaTimes> Time(const float* x, int64_t tokens, int warmup, int reps) override {
    MOERUN_RETURN_IF_ERROR(CheckTokens(tokens));
    if (tokens == 0 || reps < 1)
      return Status::InvalidArgument("Time: tokens and reps must be > 0");
    std::vector<float> out(static_cast<size_t>(tokens * spec_.hidden));
    MOERUN_RETURN_IF_ERROR(Forward(x, tokens, out.data()));  // also checks the routing
    for (int i = 0; i < warmup; ++i) MOERUN_RETURN_IF_ERROR(Launch(tokens));
    CudaTimes t;
    for (int i = 0; i < reps; ++i) {
      MOERUN_CUDA_TRY(cudaEventRecord(ctx_->ev0(), stream_));
      MOERUN_RETURN_IF_ERROR(Launch(tokens));
      MOERUN_CUDA_TRY(cudaEventRecord(ctx_->ev1(), stream_));
      MOERUN_CUDA_TRY(cudaEventSynchronize(ctx_->ev1()));
      float ms = 0;
      MOERUN_CUDA_TRY(cudaEventElapsedTime(&ms, ctx_->ev0(), ctx_->ev1()));
      t.ms.push_back(ms);
    }
    std::vector<double> sorted = t.ms;
    std::sort(sorted.begin(), sorted.end());
    t.median_ms = sorted[sorted.size() / 2];
    t.min_ms = sorted.front();
    return t;
  }

  Status RunExperts(const float* rows, const std::vector<int32_t>& group_expert,
                    const std::vector<int64_t>& group_rows, float* y) override {
    if (group_expert.size() != group_rows.size()) {
      return Status::InvalidArgument("RunExperts: group lists differ in length");
    }
    const int n = static_cast<int>(group_expert.size());
    const cuda_plan::RankMemoryPlan& plan = ctx_->plan();
    const int capacity_groups = whole_ ? groups_ : plan.max_groups;
    if (n > capacity_groups) {
      return Status::InvalidArgument(
          fmt::format("RunExperts: {} groups; the layer has {}, the rank's plan holds {}", n,
                      groups_, capacity_groups));
    }
    const HostTables& t = ctx_->tables();
    int64_t total = 0;
    for (int g = 0; g < n; ++g) {
      const int e = group_expert[static_cast<size_t>(g)];
      const int idx = e < 0 ? spec_.num_experts : e;
      if (e >= spec_.num_experts || (e < 0 && !shape_.shared) ||
          host_groups_[static_cast<size_t>(idx)].w13 == nullptr) {
        return Status::InvalidArgument(fmt::format("RunExperts: expert {} is not loaded", e));
      }
      const int64_t r = group_rows[static_cast<size_t>(g)];
      if (r < 0) return Status::InvalidArgument("RunExperts: negative row count");
      t.groups[g] = host_groups_[static_cast<size_t>(idx)];
      total += r;
    }
    if (total > plan.max_rows) {
      return Status::InvalidArgument(
          fmt::format("RunExperts: {} rows exceed the device buffers' {} (raise --max-tokens)",
                      total, plan.max_rows));
    }
    if (total == 0) return Status::Ok();
    MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
    // The tables go through the context's pinned staging: every copy below is asynchronous on
    // the stream, and the rows come from (and y goes to) host memory the rank pinned.
    std::vector<int32_t>& counts = counts_;
    counts.resize(static_cast<size_t>(n));
    for (int g = 0; g < n; ++g)
      counts[static_cast<size_t>(g)] = static_cast<int32_t>(group_rows[static_cast<size_t>(g)]);
    cuda_plan::ScanGroups(counts.data(), n, Bm(), t.row_off, t.tile_off);
    MOERUN_CUDA_TRY(cudaMemcpyAsync(run_groups_dev_, t.groups,
                                    sizeof(DevGroup) * static_cast<size_t>(n),
                                    cudaMemcpyHostToDevice, stream_));
    MOERUN_CUDA_TRY(cudaMemcpyAsync(rows_.row_off, t.row_off, static_cast<size_t>(n + 1) * 4,
                                    cudaMemcpyHostToDevice, stream_));
    MOERUN_CUDA_TRY(cudaMemcpyAsync(rows_.tile_off, t.tile_off, static_cast<size_t>(n + 1) * 4,
                                    cudaMemcpyHostToDevice, stream_));
    const size_t bytes = static_cast<size_t>(total * spec_.hidden) * 4;
    float* yd = F32("y");
    void* in = ctx_->Region("rows");
    const bool f16 = F16Rows();
    if (f16) MOERUN_CUDA_TRY(cudaMemsetAsync(overflow_flag_, 0, sizeof(int32_t), stream_));
    if (opts_.math == CudaMath::kExact) {
      // GEMM1 reads the f32 rows where they land; on an expert rank y reuses that region
      // (GEMM2 runs after GEMM1, in stream order).
      MOERUN_CUDA_TRY(cudaMemcpyAsync(in, rows, bytes, cudaMemcpyHostToDevice, stream_));
    } else {
      // The f32 rows land in the receive region (whole layer: in y), then are converted into
      // the row buffer; y then reuses the f32 region.
      float* f32 = ctx_->Region("receive") != nullptr
                       ? reinterpret_cast<float*>(ctx_->Region("receive"))
                       : yd;
      MOERUN_CUDA_TRY(cudaMemcpyAsync(f32, rows, bytes, cudaMemcpyHostToDevice, stream_));
      cuda_kernels::LaunchConvertRows(f32, total * spec_.hidden, wtype_, in, stream_,
                                      f16 ? overflow_flag_ : nullptr);
    }
    cuda_kernels::FfnArgs a = FfnArgsFor(run_groups_dev_, n, total);
    RunFfn(a);
    MOERUN_CUDA_TRY(cudaGetLastError());
    MOERUN_CUDA_TRY(cudaMemcpyAsync(y, yd, bytes, cudaMemcpyDeviceToHost, stream_));
    if (f16) {
      MOERUN_CUDA_TRY(cudaMemcpyAsync(t.flags + kFlagOverflow, overflow_flag_, sizeof(int32_t),
                                      cudaMemcpyDeviceToHost, stream_));
    }
    MOERUN_CUDA_TRY(cudaStreamSynchronize(stream_));
    if (f16 && t.flags[kFlagOverflow] != 0) return OverflowError();
    return Status::Ok();
  }

  const ModelSpec& spec() const override { return spec_; }
  std::string Describe() const override {
    const char* elem = wtype_ == WType::kF32 ? "f32" : wtype_ == WType::kBF16 ? "bf16" : "f16";
    const std::string type =
        quant_ == WQuant::kNone
            ? std::string(elem)
            : fmt::format("{} (decoded to {})", cuda_plan::WeightFormatName(format_), elem);
    return fmt::format(
        "{} (sm_{}, device {}), {} {} math, {:.2f} GB weights, {}", ctx_->device_name(), ctx_->sm(),
        opts_.device, CudaMathName(opts_.math), type, static_cast<double>(weight_bytes_) / 1e9,
        !whole_                      ? std::string("experts only (the rank's shared arena)")
        : opts_.graph_max_tokens > 0 ? fmt::format("graphs up to {} tokens", opts_.graph_max_tokens)
                                     : std::string("graphs off"));
  }
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

  Result<uint8_t*> Alloc(size_t bytes, const char* what) {
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

  Result<const void*> UploadBytes(const std::vector<uint8_t>& v, const char* what) {
    MOERUN_ASSIGN_OR_RETURN(uint8_t * p, Alloc(v.size(), what));
    if (!v.empty()) MOERUN_CUDA_TRY(cudaMemcpy(p, v.data(), v.size(), cudaMemcpyHostToDevice));
    return static_cast<const void*>(p);
  }

  Result<const float*> UploadFloats(const float* v, size_t n, const char* what) {
    MOERUN_ASSIGN_OR_RETURN(uint8_t * p, Alloc(n * 4, what));
    MOERUN_CUDA_TRY(cudaMemcpy(p, v, n * 4, cudaMemcpyHostToDevice));
    return reinterpret_cast<const float*>(p);
  }

  Status SetGroup(int g, DevGroup d, int64_t inter, const ActParams& act) {
    d.inter = static_cast<int32_t>(inter);
    d.inter_pad = static_cast<int32_t>(cuda_plan::PaddedInter(inter));
    d.act = act;
    host_groups_[static_cast<size_t>(g)] = d;
    if (g < spec_.num_experts) present_host_[static_cast<size_t>(g)] = 1;
    return Status::Ok();
  }

  Status CheckTokens(int64_t tokens) const {
    if (tokens < 0) return Status::InvalidArgument("negative token count");
    if (tokens > opts_.max_tokens) {
      return Status::InvalidArgument(fmt::format(
          "batch of {} tokens exceeds the CUDA layer's max_tokens {}", tokens, opts_.max_tokens));
    }
    return Status::Ok();
  }

  Status SetTokens(int64_t tokens) {
    int32_t* host_ntok = ctx_->tables().flags + kFlagTokens;
    *host_ntok = static_cast<int32_t>(tokens);
    MOERUN_CUDA_TRY(
        cudaMemcpyAsync(ntok_, host_ntok, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    return Status::Ok();
  }

  cuda_kernels::FfnArgs FfnArgsFor(const DevGroup* groups, int n, int64_t rows_bound) {
    cuda_kernels::FfnArgs a;
    a.groups = groups;
    a.n_groups = n;
    a.rows = rows_;
    a.rows_bound = rows_bound;
    a.hidden = spec_.hidden;
    a.inter_pad_max = shape_.max_inter_padded;
    a.wtype = wtype_;
    a.quant = quant_;
    a.in = Region("rows");
    a.act = Region("hidden_act");
    a.y = F32("y");
    a.overflow = F16Rows() ? overflow_flag_ : nullptr;
    return a;
  }

  void RunFfn(const cuda_kernels::FfnArgs& a) {
    if (opts_.math == CudaMath::kExact) {
      cuda_kernels::LaunchFfnExact(a, stream_);
    } else {
      cuda_kernels::LaunchFfnMma(a, stream_);
    }
  }

  // The whole forward for up to `bound` tokens (the real count is read from ntok_).
  void Enqueue(int64_t bound) {
    const ModelSpec& s = spec_;
    const bool shared = shape_.shared;
    cudaMemsetAsync(error_flag_, 0, 2 * sizeof(int32_t), stream_);  // error and overflow flags
    cuda_kernels::LaunchGateLogits(F32("x"), gate_, bound, s.hidden, shape_.gate_rows,
                                   F32("logits"), ntok_, stream_);
    cuda_kernels::LaunchRoute(s.gate, F32("logits"), shape_.gate_rows, gate_bias_, selection_bias_,
                              s.shared_gated, present_, bound, I32("ids"), F32("weights"),
                              F32("shared_scale"), error_flag_, ntok_, stream_);
    cuda_kernels::LaunchGroupRows(I32("ids"), bound, s.top_k, s.num_experts, shared, Bm(), rows_,
                                  ntok_, stream_);
    const int64_t rows_bound = cuda_plan::FfnRows(shape_, bound);
    cuda_kernels::LaunchGather(F32("x"), s.hidden, rows_, groups_, rows_bound,
                               opts_.math == CudaMath::kExact ? WType::kF32 : wtype_,
                               Region("rows"), stream_, F16Rows() ? overflow_flag_ : nullptr);
    RunFfn(FfnArgsFor(groups_dev_, groups_, rows_bound));
    cuda_kernels::LaunchCombine(F32("y"), s.hidden, rows_, s.num_experts, shared, F32("weights"),
                                F32("shared_scale"), s.top_k, bound, F32("out"), ntok_, stream_);
  }

  // Runs the forward of the tokens set by SetTokens: from the bucket's graph when there is one.
  Status Launch(int64_t tokens) {
    const int64_t bucket =
        cuda_plan::GraphBucket(tokens, std::min(opts_.graph_max_tokens, opts_.max_tokens));
    if (bucket == 0) {
      Enqueue(tokens);
      MOERUN_CUDA_TRY(cudaGetLastError());
      return Status::Ok();
    }
    auto& graphs = ctx_->graphs();
    const std::pair<const void*, int64_t> key(this, bucket);
    auto it = graphs.find(key);
    if (it == graphs.end()) {
      // Once eagerly first: modules load and local memory grows outside the capture, and a bad
      // launch is a plain error.
      Enqueue(bucket);
      MOERUN_CUDA_TRY(cudaGetLastError());
      MOERUN_CUDA_TRY(cudaStreamSynchronize(stream_));
      cudaGraph_t graph = nullptr;
      MOERUN_CUDA_TRY(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
      Enqueue(bucket);
      const cudaError_t launch = cudaGetLastError();
      MOERUN_CUDA_TRY(cudaStreamEndCapture(stream_, &graph));
      if (launch != cudaSuccess) {
        cudaGraphDestroy(graph);
        return CudaError("capturing the forward", launch);
      }
      cudaGraphExec_t exec = nullptr;
      const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
      cudaGraphDestroy(graph);
      MOERUN_CUDA_TRY(inst);
      it = graphs.emplace(key, exec).first;
      ++graphs_captured_;
      spdlog::debug("cuda: captured the forward graph of the {}-token bucket", bucket);
    }
    MOERUN_CUDA_TRY(cudaGraphLaunch(it->second, stream_));
    return Status::Ok();
  }

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

Result<WeightFormat> ChooseFormat(DType source, const CudaLayerOptions& opts) {
  return cuda_plan::ChooseWeightFormat(source, opts.math == CudaMath::kTensorCore, opts.mma_type);
}

Result<std::shared_ptr<ContextImpl>> MakeContext(const CudaLayerOptions& opts,
                                                 cuda_plan::RankMemoryPlan plan) {
  auto ctx = std::make_shared<ContextImpl>(opts, std::move(plan));
  MOERUN_RETURN_IF_ERROR(ctx->Init());
  return ctx;
}

// The whole layer's memory plan, from what the process loaded (or will generate).
Result<cuda_plan::RankMemoryPlan> WholeLayerPlan(const MoeLayerWeights& w, int loaded,
                                                 bool expert_bias, WeightFormat format,
                                                 const CudaLayerOptions& opts) {
  const ModelSpec& s = w.spec;
  cuda_plan::RankMemoryInput in;
  in.role = cuda_plan::DeviceRole::kWholeLayer;
  in.hidden = s.hidden;
  in.expert_inter = s.expert_inter;
  in.shared_inter = w.shared ? w.shared->inter : 0;
  in.top_k = s.top_k;
  in.experts = s.num_experts;
  in.gate_rows = s.num_experts + (s.shared_gated ? 1 : 0);
  in.expert_bias = expert_bias;
  in.gate_bias = !w.gate_bias.empty();
  in.selection_bias = !w.selection_bias.empty();
  in.layers = {cuda_plan::HostedLayer{w.layer, loaded, loaded}};
  in.format = format;
  in.tensor_cores = opts.math == CudaMath::kTensorCore;
  in.max_tokens = opts.max_tokens;
  in.graph_max_tokens = opts.graph_max_tokens;
  return cuda_plan::PlanRankMemory(in);
}

}  // namespace

// The CUDA backend's entry points (cuda_backend.h); cuda_backend.cc forwards the public ones here.
Result<std::shared_ptr<CudaRankContext>> cuda_backend::CreateContext(
    const CudaLayerOptions& opts, const cuda_plan::RankMemoryPlan& plan) {
  MOERUN_ASSIGN_OR_RETURN(auto ctx, MakeContext(opts, plan));
  spdlog::info("cuda: {}", ctx->Describe());
  return std::shared_ptr<CudaRankContext>(std::move(ctx));
}

Result<std::unique_ptr<CudaMoeLayer>> cuda_backend::Upload(const MoeLayerWeights& w,
                                                           const CudaLayerOptions& opts) {
  MOERUN_ASSIGN_OR_RETURN(const WeightFormat format, ChooseFormat(w.dtype, opts));
  int loaded = 0;
  bool bias = false;
  for (const auto& e : w.experts) {
    loaded += !e.w13.empty();
    bias = bias || !e.bias_gate.empty() || !e.bias_down.empty();
  }
  MOERUN_ASSIGN_OR_RETURN(auto plan, WholeLayerPlan(w, loaded, bias, format, opts));
  MOERUN_ASSIGN_OR_RETURN(auto ctx, MakeContext(opts, std::move(plan)));
  auto layer = std::make_unique<CudaLayerImpl>(w.spec, w.layer, std::move(ctx), format);
  MOERUN_RETURN_IF_ERROR(layer->Init(w.shared.has_value(), w.shared ? w.shared->inter : 0));
  MOERUN_RETURN_IF_ERROR(layer->UploadGate(w));
  const ActParams act = w.spec.RoutedAct(w.layer);
  for (size_t e = 0; e < w.experts.size(); ++e) {
    if (w.experts[e].w13.empty()) continue;  // not hosted here: routing to it is an error
    MOERUN_RETURN_IF_ERROR(layer->UploadExpert(static_cast<int>(e), w.experts[e], act));
  }
  if (w.shared) {
    MOERUN_RETURN_IF_ERROR(
        layer->UploadExpert(w.spec.num_experts, *w.shared, w.spec.SharedAct(w.layer)));
  }
  MOERUN_RETURN_IF_ERROR(layer->Finish());
  return std::unique_ptr<CudaMoeLayer>(std::move(layer));
}

Result<std::unique_ptr<CudaMoeLayer>> cuda_backend::UploadTo(const MoeLayerWeights& w,
                                                             std::shared_ptr<CudaRankContext> ctx) {
  auto impl = std::dynamic_pointer_cast<ContextImpl>(ctx);
  if (impl == nullptr || impl->plan().role != cuda_plan::DeviceRole::kExpertRank) {
    return Status::InvalidArgument("CUDA layer: Upload into a context needs an expert rank's");
  }
  MOERUN_ASSIGN_OR_RETURN(const WeightFormat format, ChooseFormat(w.dtype, impl->options()));
  auto layer = std::make_unique<CudaLayerImpl>(w.spec, w.layer, std::move(impl), format);
  // The shared expert runs on the router in expert parallelism: not here.
  MOERUN_RETURN_IF_ERROR(layer->Init(false, 0));
  const ActParams act = w.spec.RoutedAct(w.layer);
  for (size_t e = 0; e < w.experts.size(); ++e) {
    if (w.experts[e].w13.empty()) continue;
    MOERUN_RETURN_IF_ERROR(layer->UploadExpert(static_cast<int>(e), w.experts[e], act));
  }
  MOERUN_RETURN_IF_ERROR(layer->Finish());
  return std::unique_ptr<CudaMoeLayer>(std::move(layer));
}

Result<std::unique_ptr<CudaMoeLayer>> cuda_backend::FromPreset(const ModelSpec& spec,
                                                               const PresetOptions& preset,
                                                               const CudaLayerOptions& opts) {
  MOERUN_ASSIGN_OR_RETURN(const WeightFormat format, ChooseFormat(preset.dtype, opts));
  if (!preset.load_expert.empty() &&
      preset.load_expert.size() != static_cast<size_t>(spec.num_experts)) {
    return Status::InvalidArgument("expert mask size does not match the expert count");
  }
  if (cuda_plan::IsQuantized(format)) {
    // Block-scaled presets come from the host's deterministic quantization
    // (runtime/model/preset.cc), then go up quantized: the device does not re-derive the rounding.
    MOERUN_ASSIGN_OR_RETURN(const MoeLayerWeights w,
                            BuildPresetLayer(spec, KernelsFor(Isa::kScalar), preset));
    return Upload(w, opts);
  }
  // The host builds the small parts (gate, biases, the shared expert); experts come from the GPU.
  PresetOptions host = preset;
  host.load_expert.assign(static_cast<size_t>(spec.num_experts), false);
  host.progress = nullptr;
  MOERUN_ASSIGN_OR_RETURN(MoeLayerWeights w,
                          BuildPresetLayer(spec, KernelsFor(Isa::kScalar), host));
  int todo = 0, done = 0;
  for (int e = 0; e < spec.num_experts; ++e) {
    todo += preset.load_expert.empty() || preset.load_expert[static_cast<size_t>(e)];
  }
  MOERUN_ASSIGN_OR_RETURN(auto plan, WholeLayerPlan(w, todo, spec.expert_bias, format, opts));
  MOERUN_ASSIGN_OR_RETURN(auto ctx, MakeContext(opts, std::move(plan)));
  auto layer = std::make_unique<CudaLayerImpl>(spec, w.layer, std::move(ctx), format);
  MOERUN_RETURN_IF_ERROR(layer->Init(w.shared.has_value(), w.shared ? w.shared->inter : 0));
  MOERUN_RETURN_IF_ERROR(layer->UploadGate(w));
  for (int e = 0; e < spec.num_experts; ++e) {
    if (!preset.load_expert.empty() && !preset.load_expert[static_cast<size_t>(e)]) continue;
    MOERUN_RETURN_IF_ERROR(layer->GenerateExpert(preset, e));
    ++done;
    if (preset.progress) preset.progress(done, todo, layer->weight_bytes());
  }
  if (w.shared) {
    MOERUN_RETURN_IF_ERROR(
        layer->UploadExpert(spec.num_experts, *w.shared, spec.SharedAct(w.layer)));
  }
  MOERUN_RETURN_IF_ERROR(layer->Finish());
  return std::unique_ptr<CudaMoeLayer>(std::move(layer));
}

}  // namespace moerun
