// What an expert rank serves, as its data path reads it per microbatch: for each layer it
// serves, the layer's weights and which of its experts rows may be computed for now; the expert
// cache; whether any expert has an update in canary. ExpertControl
// (runtime/migration/expert_control.h) owns the weights and hands a fresh ServedWeights to the
// rank whenever one of these changes (start, cache enabled, load, release, update in, promote,
// rollback, a failed load), so that the per-microbatch path is an indexed lookup and asks the
// control plane nothing (but for the canary rows while has_updates is true).
//
// A plain value: the pointers stay valid as long as the ExpertControl that made it (the layers'
// weights are never replaced, only their experts). Read and written on one thread, the expert
// rank's serving thread (ExpertControl::OnMessage and Poll run there, between microbatches).
#pragma once

#include <cstddef>
#include <vector>

namespace moerun {

class ExpertCache;       // runtime/cache/expert_cache.h
struct MoeLayerWeights;  // runtime/model/layer_weights.h

struct ServedLayer {
  const MoeLayerWeights* weights = nullptr;  // null: this layer is not served here
  // Per expert: rows may be computed for it here (with a cache: a router may still send it rows,
  // resident or not; without: its weights are held).
  std::vector<bool> hosted;
};

struct ServedWeights {
  std::vector<ServedLayer> layers;  // indexed by layer id
  ExpertCache* cache = nullptr;     // null when every hosted expert is resident
  bool has_updates = false;         // some expert computes a canary share with new weights

  // The weights of `layer`, or null when it is not served here.
  const MoeLayerWeights* layer(int layer) const {
    if (layer < 0 || static_cast<size_t>(layer) >= layers.size()) return nullptr;
    return layers[static_cast<size_t>(layer)].weights;
  }
  // Whether rows for `expert` of `layer` may be computed here.
  bool hosts(int layer, int expert) const {
    if (layer < 0 || static_cast<size_t>(layer) >= layers.size()) return false;
    const std::vector<bool>& h = layers[static_cast<size_t>(layer)].hosted;
    return expert >= 0 && static_cast<size_t>(expert) < h.size() && h[static_cast<size_t>(expert)];
  }
};

}  // namespace moerun
