#include "runtime/layer/moe_layer.h"

#include <algorithm>
#include <numeric>

#include "router/combine.h"
#include "router/gating.h"

namespace moerun {

MoeLayer::MoeLayer(std::shared_ptr<const MoeLayerWeights> weights, const CpuKernels& kernels,
                   ThreadPool* pool)
    : w_(std::move(weights)),
      kernels_(kernels),
      pool_(pool),
      gating_(std::make_unique<Gating>(w_->Gate(), kernels, pool)),
      ffn_(kernels, pool) {}

MoeLayer::~MoeLayer() = default;

double MoeLayer::Flops(int64_t tokens) const {
  const ModelSpec& s = w_->spec;
  const double t = static_cast<double>(tokens);
  double f = 2.0 * t * static_cast<double>(s.hidden) * s.num_experts;
  f +=
      2.0 * t * s.top_k * 3.0 * static_cast<double>(s.hidden) * static_cast<double>(s.expert_inter);
  if (w_->shared)
    f += 2.0 * t * 3.0 * static_cast<double>(s.hidden) * static_cast<double>(s.shared_inter);
  return f;
}

Status MoeLayer::Forward(const float* x, int64_t tokens, float* out) {
  const MoeLayerWeights& w = *w_;
  const ModelSpec& s = w.spec;
  const int k = s.top_k;
  const int64_t hidden = s.hidden;
  const int experts = s.num_experts;
  if (tokens < 0) return Status::InvalidArgument("negative token count");
  if (tokens == 0) return Status::Ok();
  if (tokens > (int64_t{1} << 24)) return Status::InvalidArgument("batch too large");

  // 1-2. Router logits, top-k per token (and the Qwen2-MoE shared-expert gate).
  gating_->Run(x, tokens);
  routing_.ids.assign(gating_->ids().begin(), gating_->ids().end());
  routing_.weights.assign(gating_->weights().begin(), gating_->weights().end());
  const std::vector<float>& shared_scale = gating_->shared_scale();
  const int64_t chunk = 64;
  for (int64_t i = 0; i < tokens * k; ++i) {
    const int32_t e = routing_.ids[static_cast<size_t>(i)];
    if (w.experts[static_cast<size_t>(e)].w13.empty()) {
      return Status::Internal("token routed to expert " + std::to_string(e) +
                              ", which this process has not loaded");
    }
  }

  // 3. Group assignments by expert; the shared expert takes every token after them.
  groups_.Build(routing_.ids.data(), tokens, k, experts);
  const int64_t routed_rows = tokens * k;
  rows_.resize(static_cast<size_t>(routed_rows + (w.shared ? tokens : 0)));
  std::copy(groups_.row_token.begin(), groups_.row_token.end(), rows_.begin());
  ffn_groups_.clear();
  const ActParams act = s.RoutedAct(w.layer);
  for (int e = 0; e < experts; ++e) {
    if (groups_.rows(e) == 0) continue;
    ffn_groups_.push_back(
        ExpertGroup{&w.experts[static_cast<size_t>(e)], act, groups_.offset[e], groups_.rows(e)});
  }
  if (w.shared) {
    std::iota(rows_.begin() + routed_rows, rows_.end(), 0);
    ffn_groups_.push_back(ExpertGroup{&*w.shared, s.SharedAct(w.layer), routed_rows, tokens});
  }

  // 4. Expert FFNs.
  const int64_t ldy = ffn_.PaddedHidden(hidden);
  y_.Reserve(static_cast<size_t>(rows_.size() * ldy) * sizeof(float));
  float* y = y_.as<float>();
  ffn_.Run(ffn_groups_, x, hidden, rows_.data(), y, ldy);

  // 5. Combine in slot order, then the shared expert.
  pool_->ParallelFor((tokens + chunk - 1) / chunk, [&](int64_t c, int) {
    const float* rows[64];
    for (int64_t t = c * chunk; t < std::min(tokens, (c + 1) * chunk); ++t) {
      for (int j = 0; j < k; ++j) {
        rows[j] = y + groups_.slot_row[static_cast<size_t>(t * k + j)] * ldy;
      }
      const float* shared = w.shared ? y + (routed_rows + t) * ldy : nullptr;
      CombineToken(k, hidden, rows, routing_.weights.data() + t * k, shared,
                   shared_scale[static_cast<size_t>(t)], out + t * hidden);
    }
  });
  return Status::Ok();
}

}  // namespace moerun
