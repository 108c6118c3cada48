#include "router/activation_load.h"

#include <fmt/format.h>

#include <cmath>

namespace moerun {

Result<std::vector<std::vector<double>>> ActivationLoad(
    const std::vector<std::vector<double>>& counts, double tokens, int64_t batch_tokens) {
  if (!(tokens > 0) || !std::isfinite(tokens) || batch_tokens < 1) {
    return Status::InvalidArgument(fmt::format(
        "activation load: {} tokens in the window and {} per batch; both must be positive", tokens,
        batch_tokens));
  }
  std::vector<std::vector<double>> out(counts.size());
  for (size_t l = 0; l < counts.size(); ++l) {
    out[l].reserve(counts[l].size());
    for (size_t e = 0; e < counts[l].size(); ++e) {
      const double c = counts[l][e];
      if (!(c >= 0) || c > tokens * (1 + 1e-9)) {
        return Status::InvalidArgument(
            fmt::format("activation load: layer {} expert {} has {} assignments of {} tokens", l, e,
                        c, tokens));
      }
      const double f = std::min(1.0, c / tokens);
      // 1 - (1 - f)^B, computed without cancellation for small f.
      out[l].push_back(-std::expm1(static_cast<double>(batch_tokens) * std::log1p(-f)));
    }
  }
  return out;
}

}  // namespace moerun
