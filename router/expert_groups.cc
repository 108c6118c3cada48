#include "router/expert_groups.h"

#include <cstddef>

namespace moerun {

void ExpertGroups::Build(const int32_t* ids, int64_t tokens, int k, int experts) {
  num_experts = experts;
  offset.assign(static_cast<size_t>(experts) + 1, 0);
  const int64_t n = tokens * k;
  for (int64_t i = 0; i < n; ++i) ++offset[static_cast<size_t>(ids[i]) + 1];
  for (int e = 0; e < experts; ++e) offset[e + 1] += offset[e];
  row_token.resize(static_cast<size_t>(n));
  slot_row.resize(static_cast<size_t>(n));
  next_.assign(offset.begin(), offset.end() - 1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = next_[static_cast<size_t>(ids[i])]++;
    row_token[static_cast<size_t>(row)] = static_cast<int32_t>(i / k);
    slot_row[static_cast<size_t>(i)] = row;
  }
}

}  // namespace moerun
