#include "layer/cuda/device_plan.h"

#include <fmt/format.h>

namespace moerun::cuda_plan {

int64_t GraphBucket(int64_t tokens, int64_t graph_max) {
  if (graph_max <= 0 || tokens <= 0 || tokens > graph_max) return 0;
  int64_t b = 1;
  while (b < tokens) b *= 2;
  return b < graph_max ? b : graph_max;
}

size_t ArenaPlan::Add(const std::string& name, size_t bytes) {
  const size_t offset = (total + 255) / 256 * 256;
  regions.push_back(Region{name, offset, bytes});
  total = offset + bytes;
  return offset;
}

std::string ArenaPlan::Describe() const {
  std::string s = fmt::format("arena {:.1f} MiB:", static_cast<double>(total) / (1 << 20));
  for (const auto& r : regions) {
    s += fmt::format(" {} {:.1f} MiB,", r.name, static_cast<double>(r.bytes) / (1 << 20));
  }
  if (!regions.empty()) s.pop_back();
  return s;
}

ArenaPlan PlanLayerArena(const LayerShape& s) {
  ArenaPlan p;
  const auto t = static_cast<size_t>(s.max_tokens);
  const auto h = static_cast<size_t>(s.hidden);
  const auto tk = t * static_cast<size_t>(s.top_k);
  const auto rows = static_cast<size_t>(FfnRows(s, s.max_tokens));
  const auto groups = static_cast<size_t>(s.experts + (s.shared ? 1 : 0));
  const auto gate_ld = static_cast<size_t>(s.gate_rows);
  p.Add("x", t * h * 4);
  p.Add("out", t * h * 4);
  p.Add("logits", t * gate_ld * 4);
  p.Add("ids", tk * 4);
  p.Add("weights", tk * 4);
  p.Add("shared_scale", t * 4);
  p.Add("counts", groups * 4);
  p.Add("row_off", (groups + 1) * 4);
  p.Add("tile_off", (groups + 1) * 4);
  p.Add("row_token", rows * 4);
  p.Add("slot_row", tk * 4);
  p.Add("rows", rows * h * static_cast<size_t>(s.act_bytes));
  p.Add("hidden_act",
        rows * static_cast<size_t>(s.max_inter_padded) * static_cast<size_t>(s.act_bytes));
  p.Add("y", rows * h * 4);
  p.Add("flags", 64);
  return p;
}

}  // namespace moerun::cuda_plan
