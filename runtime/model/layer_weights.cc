#include "runtime/model/layer_weights.h"

namespace moerun {

size_t MoeLayerWeights::ExpertBytes() const {
  size_t n = shared ? shared->bytes() : 0;
  for (const auto& e : experts) n += e.bytes();
  return n;
}

GateWeights MoeLayerWeights::Gate() const {
  GateWeights g;
  g.spec = spec.gate;
  g.num_experts = spec.num_experts;
  g.top_k = spec.top_k;
  g.hidden = spec.hidden;
  g.shared_gated = spec.shared_gated;
  g.matrix = &gate;
  g.bias = gate_bias;
  g.selection_bias = selection_bias;
  return g;
}

}  // namespace moerun
