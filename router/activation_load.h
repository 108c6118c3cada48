// Planning for the experts a rank reads, not only the tokens it computes: at small batches (decode)
// an expert rank's time follows the number of distinct experts whose weights it reads per batch
// more than its token count (METRO's observation). This turns a window's counts into the expected
// number of batches of `batch_tokens` tokens in which each expert is used, per batch: with f_e the
// share of tokens that choose expert e (counts[e] ÷ tokens), 1 − (1 − f_e)^batch_tokens. Planned
// on these weights (any policy of router/planner.h), each rank's sum is the expected number of
// distinct experts it reads per batch (a replica counted as its share of the expert's weight).
#pragma once

#include <cstdint>
#include <vector>

#include "base/status.h"

namespace moerun {

// counts[l][e]: assignments in the window; tokens: tokens in the window (each chooses top_k
// experts, so counts[l] sums to top_k × tokens); batch_tokens ≥ 1. InvalidArgument on
// tokens ≤ 0, batch_tokens < 1, a negative count or one above tokens.
Result<std::vector<std::vector<double>>> ActivationLoad(
    const std::vector<std::vector<double>>& counts, double tokens, int64_t batch_tokens);

}  // namespace moerun
