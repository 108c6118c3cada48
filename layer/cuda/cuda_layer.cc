// CudaMoeLayer: weights on the device, one arena for every per-batch buffer, one stream, and the
// kernels of layer_kernels.cuh enqueued in order (or replayed from a CUDA graph per bucket).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "base/log.h"
#include "experts/cuda/ffn_kernels.h"
#include "layer/cuda/cuda_layer.h"
#include "layer/cuda/device_plan.h"
#include "layer/cuda/device_weights.h"
#include "layer/cuda/preset_gen.h"
#include "model/preset_hash.h"
#include "router/cuda/gate_kernels.h"
#include "router/cuda/group_kernels.h"

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
// f32 (plain weights: their type), tensor cores their bf16/f16.
WType ElemType(WeightFormat f, const CudaLayerOptions& o) {
  switch (f) {
    case WeightFormat::kF32:
      return WType::kF32;
    case WeightFormat::kBF16:
      return WType::kBF16;
    case WeightFormat::kF16:
      return WType::kF16;
    default:
      if (o.math == CudaMath::kExact) return WType::kF32;
      return o.mma_type == DType::kF16 ? WType::kF16 : WType::kBF16;
  }
}

size_t WBytes(WType t) { return t == WType::kF32 ? 4 : 2; }

class CudaLayerImpl final : public CudaMoeLayer {
 public:
  CudaLayerImpl(ModelSpec spec, int layer, CudaLayerOptions opts, WeightFormat format)
      : spec_(std::move(spec)),
        layer_(layer),
        opts_(opts),
        format_(format),
        quant_(cuda_plan::QuantOf(format)),
        wtype_(ElemType(format, opts)) {}

  ~CudaLayerImpl() override {
    if (!initialised_) return;
    cudaSetDevice(opts_.device);
    for (auto& [bucket, exec] : graphs_) cudaGraphExecDestroy(exec);
    for (void* p : allocations_) cudaFree(p);
    if (pinned_ntok_ != nullptr) cudaFreeHost(pinned_ntok_);
    if (ev0_ != nullptr) cudaEventDestroy(ev0_);
    if (ev1_ != nullptr) cudaEventDestroy(ev1_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  Status Init(bool has_shared, int64_t max_shared_inter) {
    const ModelSpec& s = spec_;
    if (s.num_experts > 512) {
      return Status::Unsupported(fmt::format(
          "CUDA layer: {} experts; the gate kernel handles at most 512", s.num_experts));
    }
    if (s.gate.n_group > 256) return Status::Unsupported("CUDA layer: more than 256 expert groups");
    if (opts_.max_tokens < 1 || opts_.max_tokens > (int64_t{1} << 20)) {
      return Status::InvalidArgument("CUDA layer: max_tokens must be in 1..1048576");
    }
    if (opts_.math == CudaMath::kTensorCore && s.hidden % 8 != 0) {
      return Status::Unsupported(fmt::format(
          "CUDA layer: tensor-core math needs hidden % 8 == 0 (hidden {}); use exact math",
          s.hidden));
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
    initialised_ = true;
    MOERUN_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MOERUN_CUDA_TRY(cudaEventCreate(&ev0_));
    MOERUN_CUDA_TRY(cudaEventCreate(&ev1_));
    MOERUN_CUDA_TRY(cudaMallocHost(&pinned_ntok_, sizeof(int32_t)));

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
    plan_ = cuda_plan::PlanLayerArena(shape_);
    MOERUN_ASSIGN_OR_RETURN(arena_, Alloc(plan_.total, "arena"));
    for (const auto& r : plan_.regions) region_[r.name] = arena_ + r.offset;
    rows_.counts = I32("counts");
    rows_.row_off = I32("row_off");
    rows_.tile_off = I32("tile_off");
    rows_.row_token = I32("row_token");
    rows_.slot_row = I32("slot_row");
    ntok_ = I32("flags");
    error_flag_ = ntok_ + 1;
    const size_t gate_floats = static_cast<size_t>(shape_.gate_rows * s.hidden);
    MOERUN_ASSIGN_OR_RETURN(uint8_t * g, Alloc(gate_floats * 4, "gate"));
    gate_ = reinterpret_cast<float*>(g);
    MOERUN_ASSIGN_OR_RETURN(present_, Alloc(static_cast<size_t>(s.num_experts), "expert mask"));
    MOERUN_CUDA_TRY(cudaMemset(present_, 0, static_cast<size_t>(s.num_experts)));
    // Group descriptors: the layer's (experts, then shared) and a second table for RunExperts.
    MOERUN_ASSIGN_OR_RETURN(uint8_t * gd, Alloc(sizeof(DevGroup) * 2 * (groups_ + 1), "groups"));
    groups_dev_ = reinterpret_cast<DevGroup*>(gd);
    run_groups_dev_ = groups_dev_ + groups_ + 1;
    host_groups_.assign(static_cast<size_t>(groups_), DevGroup{});
    present_host_.assign(static_cast<size_t>(s.num_experts), 0);
    return Status::Ok();
  }

  // Gate rows (f32 [gate_rows][hidden]) and the gate's bias vectors.
  Status UploadGate(const MoeLayerWeights& w) {
    const int64_t h = spec_.hidden;
    if (w.gate.n() < shape_.gate_rows || w.gate.k() != h) return Status::Ok();  // experts only
    has_gate_ = true;
    std::vector<float> gate(static_cast<size_t>(shape_.gate_rows * h));
    for (int64_t r = 0; r < shape_.gate_rows; ++r) {
      for (int64_t k = 0; k < h; ++k) gate[static_cast<size_t>(r * h + k)] = w.gate.At(r, k);
    }
    MOERUN_CUDA_TRY(cudaMemcpy(gate_, gate.data(), gate.size() * 4, cudaMemcpyHostToDevice));
    const auto e = static_cast<size_t>(spec_.num_experts);
    if (!w.gate_bias.empty()) {
      MOERUN_ASSIGN_OR_RETURN(gate_bias_, UploadFloats(w.gate_bias.data(), e, "router bias"));
    }
    if (!w.selection_bias.empty()) {
      MOERUN_ASSIGN_OR_RETURN(selection_bias_,
                              UploadFloats(w.selection_bias.data(), e, "selection bias"));
    }
    return Status::Ok();
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
    if (!ew.bias_gate.empty()) {
      std::vector<float> bg(static_cast<size_t>(ip), 0.0f), bu(bg);
      std::copy_n(ew.bias_gate.begin(), inter, bg.begin());
      std::copy_n(ew.bias_up.begin(), inter, bu.begin());
      MOERUN_ASSIGN_OR_RETURN(d.bias_g, UploadFloats(bg.data(), bg.size(), "expert bias"));
      MOERUN_ASSIGN_OR_RETURN(d.bias_u, UploadFloats(bu.data(), bu.size(), "expert bias"));
    }
    if (!ew.bias_down.empty()) {
      MOERUN_ASSIGN_OR_RETURN(
          d.bias_d, UploadFloats(ew.bias_down.data(), static_cast<size_t>(h), "expert bias"));
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
    }
    return SetGroup(e, d, inter, spec_.RoutedAct(layer_));
  }

  Status Finish() {
    MOERUN_CUDA_TRY(cudaMemcpy(groups_dev_, host_groups_.data(),
                               sizeof(DevGroup) * host_groups_.size(), cudaMemcpyHostToDevice));
    MOERUN_CUDA_TRY(
        cudaMemcpy(present_, present_host_.data(), present_host_.size(), cudaMemcpyHostToDevice));
    // The uploads ran on the legacy stream, the generators on ours: wait for both.
    MOERUN_CUDA_TRY(cudaDeviceSynchronize());
    spdlog::info("cuda: {} ({})", Describe(), plan_.Describe());
    return Status::Ok();
  }

  Status Forward(const float* x, int64_t tokens, float* out) override {
    MOERUN_RETURN_IF_ERROR(CheckTokens(tokens));
    if (tokens == 0) return Status::Ok();
    if (!has_gate_) return Status::InvalidArgument("CUDA layer: no router weights were loaded");
    MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
    const size_t bytes = static_cast<size_t>(tokens * spec_.hidden) * 4;
    MOERUN_CUDA_TRY(cudaMemcpyAsync(F32("x"), x, bytes, cudaMemcpyHostToDevice, stream_));
    MOERUN_RETURN_IF_ERROR(SetTokens(tokens));
    MOERUN_RETURN_IF_ERROR(Launch(tokens));
    MOERUN_CUDA_TRY(cudaMemcpyAsync(out, F32("out"), bytes, cudaMemcpyDeviceToHost, stream_));
    int32_t flag = 0;
    MOERUN_CUDA_TRY(
        cudaMemcpyAsync(&flag, error_flag_, sizeof(flag), cudaMemcpyDeviceToHost, stream_));
    MOERUN_CUDA_TRY(cudaStreamSynchronize(stream_));
    last_tokens_ = tokens;
    if (flag > 0) {
      return Status::Internal(
          fmt::format("token routed to expert {}, which this process has not loaded", flag - 1));
    }
    return Status::Ok();
  }

  Status LastRouting(std::vector<int32_t>* ids, std::vector<float>* weights) override {
    const auto n = static_cast<size_t>(last_tokens_ * spec_.top_k);
    ids->resize(n);
    weights->resize(n);
    if (n == 0) return Status::Ok();
    MOERUN_CUDA_TRY(cudaMemcpy(ids->data(), I32("ids"), n * 4, cudaMemcpyDeviceToHost));
    MOERUN_CUDA_TRY(cudaMemcpy(weights->data(), F32("weights"), n * 4, cudaMemcpyDeviceToHost));
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
      MOERUN_CUDA_TRY(cudaEventRecord(ev0_, stream_));
      MOERUN_RETURN_IF_ERROR(Launch(tokens));
      MOERUN_CUDA_TRY(cudaEventRecord(ev1_, stream_));
      MOERUN_CUDA_TRY(cudaEventSynchronize(ev1_));
      float ms = 0;
      MOERUN_CUDA_TRY(cudaEventElapsedTime(&ms, ev0_, ev1_));
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
    if (n > groups_) return Status::InvalidArgument("RunExperts: more groups than the layer's");
    std::vector<DevGroup> groups(static_cast<size_t>(n));
    std::vector<int32_t> counts(static_cast<size_t>(n));
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
      groups[static_cast<size_t>(g)] = host_groups_[static_cast<size_t>(idx)];
      counts[static_cast<size_t>(g)] = static_cast<int32_t>(r);
      total += r;
    }
    const int64_t capacity = cuda_plan::FfnRows(shape_, shape_.max_tokens);
    if (total > capacity) {
      return Status::InvalidArgument(
          fmt::format("RunExperts: {} rows exceed the arena's {}", total, capacity));
    }
    if (total == 0) return Status::Ok();
    MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
    const int bm = Bm();
    std::vector<int32_t> row_off(static_cast<size_t>(n + 1)), tile_off(row_off);
    cuda_plan::ScanGroups(counts.data(), n, bm, row_off.data(), tile_off.data());
    MOERUN_CUDA_TRY(cudaMemcpyAsync(run_groups_dev_, groups.data(),
                                    sizeof(DevGroup) * groups.size(), cudaMemcpyHostToDevice,
                                    stream_));
    MOERUN_CUDA_TRY(cudaMemcpyAsync(rows_.row_off, row_off.data(), row_off.size() * 4,
                                    cudaMemcpyHostToDevice, stream_));
    MOERUN_CUDA_TRY(cudaMemcpyAsync(rows_.tile_off, tile_off.data(), tile_off.size() * 4,
                                    cudaMemcpyHostToDevice, stream_));
    const size_t bytes = static_cast<size_t>(total * spec_.hidden) * 4;
    float* yd = F32("y");
    void* in = region_["rows"];
    if (opts_.math == CudaMath::kExact) {
      MOERUN_CUDA_TRY(cudaMemcpyAsync(in, rows, bytes, cudaMemcpyHostToDevice, stream_));
    } else {  // stage the f32 rows in y, convert them into the row buffer
      MOERUN_CUDA_TRY(cudaMemcpyAsync(yd, rows, bytes, cudaMemcpyHostToDevice, stream_));
      cuda_kernels::LaunchConvertRows(yd, total * spec_.hidden, wtype_, in, stream_);
    }
    cuda_kernels::FfnArgs a = FfnArgsFor(run_groups_dev_, n, total);
    RunFfn(a);
    MOERUN_CUDA_TRY(cudaGetLastError());
    MOERUN_CUDA_TRY(cudaMemcpyAsync(y, yd, bytes, cudaMemcpyDeviceToHost, stream_));
    MOERUN_CUDA_TRY(cudaStreamSynchronize(stream_));
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
        "{} (sm_{}, device {}), {} {} math, {:.2f} GB weights, graphs {}", device_name_, sm_,
        opts_.device, CudaMathName(opts_.math), type, static_cast<double>(weight_bytes_) / 1e9,
        opts_.graph_max_tokens > 0 ? fmt::format("up to {} tokens", opts_.graph_max_tokens)
                                   : std::string("off"));
  }
  size_t weight_bytes() const override { return weight_bytes_; }
  int64_t graphs_captured() const override { return static_cast<int64_t>(graphs_.size()); }

 private:
  int Bm() const {
    return opts_.math == CudaMath::kExact ? cuda_kernels::kExactBm : cuda_kernels::kMmaBm;
  }
  int32_t* I32(const std::string& name) { return reinterpret_cast<int32_t*>(region_.at(name)); }
  float* F32(const std::string& name) { return reinterpret_cast<float*>(region_.at(name)); }

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
    *pinned_ntok_ = static_cast<int32_t>(tokens);
    MOERUN_CUDA_TRY(
        cudaMemcpyAsync(ntok_, pinned_ntok_, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
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
    a.in = region_.at("rows");
    a.act = region_.at("hidden_act");
    a.y = F32("y");
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
    cudaMemsetAsync(error_flag_, 0, sizeof(int32_t), stream_);
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
                               region_.at("rows"), stream_);
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
    auto it = graphs_.find(bucket);
    if (it == graphs_.end()) {
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
      it = graphs_.emplace(bucket, exec).first;
      spdlog::debug("cuda: captured the forward graph of the {}-token bucket", bucket);
    }
    MOERUN_CUDA_TRY(cudaGraphLaunch(it->second, stream_));
    return Status::Ok();
  }

  ModelSpec spec_;
  int layer_;
  CudaLayerOptions opts_;
  WeightFormat format_;  // how the experts are held
  WQuant quant_;         // block-scaled formats: which
  WType wtype_;          // the FFN's rows and activations (plain formats: the weights too)
  bool initialised_ = false;
  bool has_gate_ = false;
  std::string device_name_;
  int sm_ = 0;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ev0_ = nullptr, ev1_ = nullptr;
  int32_t* pinned_ntok_ = nullptr;
  std::vector<void*> allocations_;
  cuda_plan::LayerShape shape_;
  cuda_plan::ArenaPlan plan_;
  uint8_t* arena_ = nullptr;
  std::map<std::string, uint8_t*> region_;
  DevRows rows_;
  int32_t* ntok_ = nullptr;
  int32_t* error_flag_ = nullptr;
  float* gate_ = nullptr;
  const float* gate_bias_ = nullptr;
  const float* selection_bias_ = nullptr;
  uint8_t* present_ = nullptr;
  int groups_ = 0;
  DevGroup* groups_dev_ = nullptr;
  DevGroup* run_groups_dev_ = nullptr;
  std::vector<DevGroup> host_groups_;
  std::vector<uint8_t> present_host_;
  std::map<int64_t, cudaGraphExec_t> graphs_;
  size_t weight_bytes_ = 0;
  int64_t last_tokens_ = 0;
};

Result<WeightFormat> ChooseFormat(DType source, const CudaLayerOptions& opts) {
  return cuda_plan::ChooseWeightFormat(source, opts.math == CudaMath::kTensorCore, opts.mma_type);
}

}  // namespace

const char* CudaMathName(CudaMath m) { return m == CudaMath::kExact ? "exact" : "tensor-core"; }

Result<std::unique_ptr<CudaMoeLayer>> CudaMoeLayer::Upload(const MoeLayerWeights& w,
                                                           const CudaLayerOptions& opts) {
  MOERUN_ASSIGN_OR_RETURN(const WeightFormat format, ChooseFormat(w.dtype, opts));
  auto layer = std::make_unique<CudaLayerImpl>(w.spec, w.layer, opts, format);
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

Result<std::unique_ptr<CudaMoeLayer>> CudaMoeLayer::FromPreset(const ModelSpec& spec,
                                                               const PresetOptions& preset,
                                                               const CudaLayerOptions& opts) {
  MOERUN_ASSIGN_OR_RETURN(const WeightFormat format, ChooseFormat(preset.dtype, opts));
  if (!preset.load_expert.empty() &&
      preset.load_expert.size() != static_cast<size_t>(spec.num_experts)) {
    return Status::InvalidArgument("expert mask size does not match the expert count");
  }
  if (cuda_plan::IsQuantized(format)) {
    // Block-scaled presets come from the host's deterministic quantization (model/preset.cc),
    // then go up quantized: the device does not re-derive the rounding.
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
  auto layer = std::make_unique<CudaLayerImpl>(spec, w.layer, opts, format);
  MOERUN_RETURN_IF_ERROR(layer->Init(w.shared.has_value(), w.shared ? w.shared->inter : 0));
  MOERUN_RETURN_IF_ERROR(layer->UploadGate(w));
  int todo = 0, done = 0;
  for (int e = 0; e < spec.num_experts; ++e) {
    todo += preset.load_expert.empty() || preset.load_expert[static_cast<size_t>(e)];
  }
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
