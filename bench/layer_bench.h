// `moebench layer`: times one MoE layer at several token counts and, in the same run, the plain
// per-token reference loop and the OpenBLAS sgemm of the same total shape. Prints JSON to stdout
// (fields say their direction: speedup_vs_X = X's time / ours; fraction_of_X = our rate / X's)
// and a one-line summary per token count to stderr. The layer's output is checked against the
// reference on the tokens the reference ran.
#pragma once

#include <string>
#include <vector>

#include "launch/layer_source.h"

namespace moerun::bench {

struct LayerBenchFlags {
  LayerFlags layer;
  std::vector<int64_t> tokens = {1, 16, 128, 1024};
  std::string device = "cpu";
  double min_seconds = 1.0;  // per measurement
  int reference_tokens = 2;  // tokens the reference loop runs (its time is scaled to T)
  bool sgemm = true;
  bool json = false;
};

int RunLayerBench(const LayerBenchFlags& f);

}  // namespace moerun::bench
