// CudaLayerImpl's forward pass (cuda_layer_impl.h): the kernels enqueued in order on the rank
// context's stream (or replayed from a CUDA graph per token-count bucket), the device-side timing,
// and the grouped FFN alone for expert ranks.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "router/cuda/gate_kernels.h"
#include "router/cuda/group_kernels.h"
#include "runtime/layer/cuda/cuda_layer_impl.h"

namespace moerun::cuda_impl {

Status OverflowError() {
  return Status::InvalidArgument(
      "an activation exceeds f16's range (65504): use bf16 tensor cores or --math exact");
}

Status CudaLayerImpl::Forward(const float* x, int64_t tokens, float* out) {
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

Status CudaLayerImpl::LastRouting(std::vector<int32_t>* ids, std::vector<float>* weights) {
  const auto n = static_cast<size_t>(last_tokens_ * spec_.top_k);
  ids->resize(n);
  weights->resize(n);
  if (n == 0) return Status::Ok();
  // On the layer's stream: the forward that wrote them is ordered before these copies.
  MOERUN_CUDA_TRY(cudaSetDevice(opts_.device));
  MOERUN_CUDA_TRY(cudaMemcpyAsync(ids->data(), I32("ids"), n * 4, cudaMemcpyDeviceToHost, stream_));
  MOERUN_CUDA_TRY(
      cudaMemcpyAsync(weights->data(), F32("weights"), n * 4, cudaMemcpyDeviceToHost, stream_));
  MOERUN_CUDA_TRY(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

Result<CudaTimes> CudaLayerImpl::Time(const float* x, int64_t tokens, int warmup, int reps) {
  MOERUN_RETURN_IF_ERROR(CheckTokens(tokens));
  if (tokens == 0 || reps < 1) return Status::InvalidArgument("Time: tokens and reps must be > 0");
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

Status CudaLayerImpl::RunExperts(const float* rows, const std::vector<int32_t>& group_expert,
                                 const std::vector<int64_t>& group_rows, float* y) {
  if (group_expert.size() != group_rows.size()) {
    return Status::InvalidArgument("RunExperts: group lists differ in length");
  }
  const int n = static_cast<int>(group_expert.size());
  const cuda_plan::RankMemoryPlan& plan = ctx_->plan();
  const int capacity_groups = whole_ ? groups_ : plan.max_groups;
  if (n > capacity_groups) {
    return Status::InvalidArgument(
        fmt::format("RunExperts: {} groups; the layer has {}, the rank's plan holds {}", n, groups_,
                    capacity_groups));
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
        fmt::format("RunExperts: {} rows exceed the device buffers' {} (raise --max-tokens)", total,
                    plan.max_rows));
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
                                  sizeof(DevGroup) * static_cast<size_t>(n), cudaMemcpyHostToDevice,
                                  stream_));
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
    float* f32 =
        ctx_->Region("receive") != nullptr ? reinterpret_cast<float*>(ctx_->Region("receive")) : yd;
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

std::string CudaLayerImpl::Describe() const {
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

Status CudaLayerImpl::CheckTokens(int64_t tokens) const {
  if (tokens < 0) return Status::InvalidArgument("negative token count");
  if (tokens > opts_.max_tokens) {
    return Status::InvalidArgument(fmt::format(
        "batch of {} tokens exceeds the CUDA layer's max_tokens {}", tokens, opts_.max_tokens));
  }
  return Status::Ok();
}

Status CudaLayerImpl::SetTokens(int64_t tokens) {
  int32_t* host_ntok = ctx_->tables().flags + kFlagTokens;
  *host_ntok = static_cast<int32_t>(tokens);
  MOERUN_CUDA_TRY(
      cudaMemcpyAsync(ntok_, host_ntok, sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  return Status::Ok();
}

cuda_kernels::FfnArgs CudaLayerImpl::FfnArgsFor(const DevGroup* groups, int n, int64_t rows_bound) {
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

void CudaLayerImpl::RunFfn(const cuda_kernels::FfnArgs& a) {
  if (opts_.math == CudaMath::kExact) {
    cuda_kernels::LaunchFfnExact(a, stream_);
  } else {
    cuda_kernels::LaunchFfnMma(a, stream_);
  }
}

// The whole forward for up to `bound` tokens (the real count is read from ntok_).
void CudaLayerImpl::Enqueue(int64_t bound) {
  const ModelSpec& s = spec_;
  const bool shared = shape_.shared;
  cudaMemsetAsync(error_flag_, 0, 2 * sizeof(int32_t), stream_);  // error and overflow flags
  cuda_kernels::LaunchGateLogits(F32("x"), gate_, bound, s.hidden, shape_.gate_rows, F32("logits"),
                                 ntok_, stream_);
  cuda_kernels::LaunchRoute(s.gate, F32("logits"), shape_.gate_rows, gate_bias_, selection_bias_,
                            s.shared_gated, present_, bound, I32("ids"), F32("weights"),
                            F32("shared_scale"), error_flag_, ntok_, stream_);
  cuda_kernels::LaunchGroupRows(I32("ids"), bound, s.top_k, s.num_experts, shared, Bm(), rows_,
                                ntok_, stream_);
  const int64_t rows_bound = cuda_plan::FfnRows(shape_, bound);
  cuda_kernels::LaunchGather(F32("x"), s.hidden, rows_, groups_, rows_bound,
                             opts_.math == CudaMath::kExact ? WType::kF32 : wtype_, Region("rows"),
                             stream_, F16Rows() ? overflow_flag_ : nullptr);
  RunFfn(FfnArgsFor(groups_dev_, groups_, rows_bound));
  cuda_kernels::LaunchCombine(F32("y"), s.hidden, rows_, s.num_experts, shared, F32("weights"),
                              F32("shared_scale"), s.top_k, bound, F32("out"), ntok_, stream_);
}

// Runs the forward of the tokens set by SetTokens: from the bucket's graph when there is one.
Status CudaLayerImpl::Launch(int64_t tokens) {
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

}  // namespace moerun::cuda_impl
