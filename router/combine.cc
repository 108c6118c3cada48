#include "router/combine.h"

namespace moerun {

void CombineToken(int k, int64_t hidden, const float* const* rows, const float* w,
                  const float* shared, float shared_scale, float* out) {
  constexpr int64_t kChunk = 512;
  float acc[kChunk];
  for (int64_t h0 = 0; h0 < hidden; h0 += kChunk) {
    const int64_t len = hidden - h0 < kChunk ? hidden - h0 : kChunk;
    for (int64_t j = 0; j < len; ++j) acc[j] = 0.0f;
    for (int s = 0; s < k; ++s) {
      const float* r = rows[s] + h0;
      const float ws = w[s];
      for (int64_t j = 0; j < len; ++j) acc[j] = acc[j] + ws * r[j];
    }
    if (shared != nullptr) {
      const float* e = shared + h0;
      for (int64_t j = 0; j < len; ++j) acc[j] = acc[j] + shared_scale * e[j];
    }
    for (int64_t j = 0; j < len; ++j) out[h0 + j] = acc[j];
  }
}

}  // namespace moerun
