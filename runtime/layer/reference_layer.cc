#include "runtime/layer/reference_layer.h"

#include <cmath>
#include <vector>

#include "router/gate.h"

namespace moerun {
namespace {

double Act(const ActParams& p, double g, double u) {
  auto silu = [](double v) { return v / (1.0 + std::exp(-v)); };
  switch (p.kind) {
    case ActKind::kSwiGlu:
      return silu(g) * u;
    case ActKind::kSwiGluClamped: {
      double s = silu(g);
      if (p.limit > 0) {
        s = std::min<double>(s, p.limit);
        u = std::clamp<double>(u, -p.limit, p.limit);
      }
      return s * u;
    }
    case ActKind::kGptOss: {
      g = std::min<double>(g, p.limit);
      u = std::clamp<double>(u, -p.limit, p.limit);
      return (u + 1.0) * g / (1.0 + std::exp(-static_cast<double>(p.alpha) * g));
    }
  }
  return 0.0;
}

// y = FFN(x) in double.
void Expert(const ExpertWeights& e, const ActParams& act, const float* x, std::vector<double>* y) {
  const int64_t nr = e.w13.nr();
  std::vector<double> h(static_cast<size_t>(e.inter));
  for (int64_t j = 0; j < e.inter; ++j) {
    const int64_t gate_row = (j / nr) * 2 * nr + j % nr;  // see ExpertWeights: gate/up panels
    const int64_t up_row = gate_row + nr;
    double g = 0, u = 0;
    for (int64_t k = 0; k < e.hidden; ++k) {
      g += static_cast<double>(x[k]) * e.w13.At(gate_row, k);
      u += static_cast<double>(x[k]) * e.w13.At(up_row, k);
    }
    if (!e.bias_gate.empty()) {
      g += e.bias_gate[static_cast<size_t>(j)];
      u += e.bias_up[static_cast<size_t>(j)];
    }
    h[static_cast<size_t>(j)] = Act(act, g, u);
  }
  y->assign(static_cast<size_t>(e.hidden), 0.0);
  for (int64_t n = 0; n < e.hidden; ++n) {
    double acc = 0;
    for (int64_t j = 0; j < e.inter; ++j) acc += h[static_cast<size_t>(j)] * e.w2.At(n, j);
    if (!e.bias_down.empty()) acc += e.bias_down[static_cast<size_t>(n)];
    (*y)[static_cast<size_t>(n)] = acc;
  }
}

}  // namespace

void ReferenceForward(const MoeLayerWeights& w, const float* x, int64_t tokens, float* out) {
  const ModelSpec& s = w.spec;
  const int64_t hidden = s.hidden;
  const int experts = s.num_experts;
  std::vector<float> logits(static_cast<size_t>(experts) + 1);
  std::vector<float> probs(static_cast<size_t>(experts)), choice(static_cast<size_t>(experts));
  std::vector<int32_t> order(static_cast<size_t>(experts));
  std::vector<int32_t> ids(static_cast<size_t>(s.top_k));
  std::vector<float> wts(static_cast<size_t>(s.top_k));
  std::vector<double> y, acc(static_cast<size_t>(hidden));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* xt = x + t * hidden;
    for (int64_t e = 0; e < w.gate.n(); ++e) {
      double l = 0;
      for (int64_t k = 0; k < hidden; ++k) l += static_cast<double>(xt[k]) * w.gate.At(e, k);
      if (!w.gate_bias.empty() && e < experts) l += w.gate_bias[static_cast<size_t>(e)];
      logits[static_cast<size_t>(e)] = static_cast<float>(l);
    }
    Route(s.gate, logits.data(), w.selection_bias.empty() ? nullptr : w.selection_bias.data(),
          GateScratch{probs.data(), choice.data(), order.data()}, ids.data(), wts.data());
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int j = 0; j < s.top_k; ++j) {
      Expert(w.experts[static_cast<size_t>(ids[static_cast<size_t>(j)])], s.RoutedAct(w.layer), xt,
             &y);
      for (int64_t n = 0; n < hidden; ++n) {
        acc[static_cast<size_t>(n)] +=
            static_cast<double>(wts[static_cast<size_t>(j)]) * y[static_cast<size_t>(n)];
      }
    }
    if (w.shared) {
      Expert(*w.shared, s.SharedAct(w.layer), xt, &y);
      const double scale =
          s.shared_gated
              ? 1.0 / (1.0 + std::exp(-static_cast<double>(logits[static_cast<size_t>(experts)])))
              : 1.0;
      for (int64_t n = 0; n < hidden; ++n)
        acc[static_cast<size_t>(n)] += scale * y[static_cast<size_t>(n)];
    }
    for (int64_t n = 0; n < hidden; ++n)
      out[t * hidden + n] = static_cast<float>(acc[static_cast<size_t>(n)]);
  }
}

}  // namespace moerun
