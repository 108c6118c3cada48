#include "runtime/layer/cuda/device_plan.h"

#include <fmt/format.h>

#include <algorithm>

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

int64_t ArenaPlan::AddAlias(const std::string& name, const std::string& of, size_t bytes) {
  const Region* r = Find(of);
  if (r == nullptr || !r->alias_of.empty() || bytes > r->bytes) return -1;
  const size_t offset = r->offset;
  regions.push_back(Region{name, offset, bytes, of});
  return static_cast<int64_t>(offset);
}

const ArenaPlan::Region* ArenaPlan::Find(const std::string& name) const {
  for (const auto& r : regions) {
    if (r.name == name) return &r;
  }
  return nullptr;
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

const char* DeviceRoleName(DeviceRole r) {
  switch (r) {
    case DeviceRole::kCpuRouter:
      return "cpu router";
    case DeviceRole::kExpertRank:
      return "expert";
    case DeviceRole::kWholeLayer:
      return "whole layer";
  }
  return "?";
}

size_t RankMemoryPlan::weight_bytes() const {
  size_t n = 0;
  for (const auto& w : weights) n += w.bytes;
  return n;
}

size_t RankMemoryPlan::Weight(const std::string& name) const {
  for (const auto& w : weights) {
    if (w.name == name) return w.bytes;
  }
  return 0;
}

namespace {

Status CheckInput(const RankMemoryInput& in) {
  if (in.role == DeviceRole::kCpuRouter) return Status::Ok();
  if (in.hidden < 1 || in.expert_inter < 1 || in.shared_inter < 0) {
    return Status::InvalidArgument("device plan: hidden and expert sizes must be > 0");
  }
  if (in.experts < 1 || in.top_k < 1 || in.top_k > in.experts) {
    return Status::InvalidArgument(
        fmt::format("device plan: top_k {} of {} experts", in.top_k, in.experts));
  }
  if (in.gate_rows < in.experts) {
    return Status::InvalidArgument("device plan: fewer gate rows than experts");
  }
  if (in.max_tokens < 1 || in.max_tokens > (int64_t{1} << 20)) {
    return Status::InvalidArgument("--max-tokens must be in 1..1048576");
  }
  if (in.layers.empty()) return Status::InvalidArgument("device plan: the rank hosts no layer");
  if (in.role == DeviceRole::kWholeLayer && in.layers.size() != 1) {
    return Status::InvalidArgument("device plan: a whole-layer rank holds one layer");
  }
  if (in.routers < 1) return Status::InvalidArgument("device plan: routers must be >= 1");
  for (const auto& l : in.layers) {
    if (l.slots < 0 || l.experts < 0 || l.experts > in.experts || l.experts > l.slots ||
        l.slots > 4096) {
      return Status::InvalidArgument(fmt::format(
          "device plan: layer {} has {} slots holding {} experts", l.layer, l.slots, l.experts));
    }
  }
  return Status::Ok();
}

// The experts' weights over every hosted layer: values/codes, scales, biases.
void AddExpertWeights(const RankMemoryInput& in, RankMemoryPlan* p) {
  const ExpertBytes e = DeviceExpertBytes(in.format, in.hidden, in.expert_inter);
  const auto ip = static_cast<size_t>(PaddedInter(in.expert_inter));
  const size_t bias = in.expert_bias ? (2 * ip + static_cast<size_t>(in.hidden)) * 4 : 0;
  size_t n = 0;
  for (const auto& l : in.layers) n += static_cast<size_t>(l.experts);
  size_t values = n * (e.w13 + e.w2), scales = n * (e.s13 + e.s2), biases = n * bias;
  if (in.expert_cache_bytes > 0 && values + scales + biases > in.expert_cache_bytes) {
    p->weights.push_back({"expert cache", in.expert_cache_bytes});
    return;
  }
  p->weights.push_back({"expert weights", values});
  if (scales > 0) p->weights.push_back({"expert scales", scales});
  if (biases > 0) p->weights.push_back({"expert biases", biases});
}

// Device and pinned host tables of `groups` group descriptors and their row/tile offsets.
size_t TableBytes(int groups) {
  const auto g = static_cast<size_t>(groups);
  return (g + 1) * 4 * 2 + (g + 1) * kGroupDescriptorBytes + 64;
}

void PlanExpertRank(const RankMemoryInput& in, RankMemoryPlan* p) {
  AddExpertWeights(in, p);
  int per_token = 0, groups = 0;
  for (const auto& l : in.layers) {
    per_token = std::max(per_token, std::min(in.top_k, l.slots));
    groups = std::max(groups, l.slots);
  }
  p->max_rows = in.max_tokens * per_token;
  p->max_groups = groups;
  p->act_stride = PaddedInter(in.expert_inter);
  p->act_bytes = in.tensor_cores ? 2 : 4;
  const auto rows = static_cast<size_t>(p->max_rows), h = static_cast<size_t>(in.hidden);
  const size_t f32_rows = rows * h * 4;
  ArenaPlan& a = p->arena;
  if (in.tensor_cores) {
    a.Add("receive", f32_rows);   // the f32 rows as sent
    a.Add("rows", rows * h * 2);  // converted to the tensor cores' type
    a.AddAlias("y", "receive", f32_rows);
  } else {
    a.Add("rows", f32_rows);  // received and read by GEMM1 as they are
    a.AddAlias("y", "rows", f32_rows);
  }
  a.Add("hidden_act",
        rows * static_cast<size_t>(p->act_stride) * static_cast<size_t>(p->act_bytes));
  const auto g = static_cast<size_t>(groups);
  a.Add("row_off", (g + 1) * 4);
  a.Add("tile_off", (g + 1) * 4);
  a.Add("groups", (g + 1) * kGroupDescriptorBytes);
  a.Add("flags", 64);
  p->io_buffer_bytes = f32_rows;
  p->pinned_tables = TableBytes(groups);
  p->pinned_host = p->pinned_tables +
                   static_cast<size_t>(in.routers) * (4 * f32_rows + 2 * in.result_trailer_bytes);
}

int GraphBuckets(int64_t graph_max, int64_t max_tokens) {
  const int64_t cap = std::min(graph_max, max_tokens);
  if (cap <= 0) return 0;
  int n = 1;  // the cap itself
  for (int64_t b = 1; b < cap; b *= 2) ++n;
  return n;
}

void PlanWholeLayer(const RankMemoryInput& in, RankMemoryPlan* p) {
  AddExpertWeights(in, p);
  const auto h = static_cast<size_t>(in.hidden);
  if (in.shared_inter > 0) {
    const ExpertBytes e = DeviceExpertBytes(in.format, in.hidden, in.shared_inter);
    p->weights.push_back({"shared expert", e.total()});
  }
  p->weights.push_back({"gate", static_cast<size_t>(in.gate_rows) * h * 4});
  const size_t bias_vectors = (in.gate_bias ? 1 : 0) + (in.selection_bias ? 1 : 0);
  if (bias_vectors > 0) {
    p->weights.push_back({"router biases", bias_vectors * static_cast<size_t>(in.experts) * 4});
  }
  LayerShape s;
  s.max_tokens = in.max_tokens;
  s.hidden = in.hidden;
  s.experts = in.experts;
  s.top_k = in.top_k;
  s.gate_rows = in.gate_rows;
  s.shared = in.shared_inter > 0;
  s.max_inter_padded = std::max(PaddedInter(in.expert_inter), PaddedInter(in.shared_inter));
  s.act_bytes = in.tensor_cores ? 2 : 4;
  p->arena = PlanLayerArena(s);
  const int groups = in.experts + (s.shared ? 1 : 0);
  const auto g = static_cast<size_t>(groups);
  p->arena.Add("groups", (g + 1) * kGroupDescriptorBytes);      // the layer's, for the forward
  p->arena.Add("run_groups", (g + 1) * kGroupDescriptorBytes);  // RunExperts's
  p->arena.Add("present", static_cast<size_t>(in.experts));
  p->max_rows = FfnRows(s, in.max_tokens);
  p->max_groups = groups;
  p->act_stride = s.max_inter_padded;
  p->act_bytes = s.act_bytes;
  p->graph_buckets = GraphBuckets(in.graph_max_tokens, in.max_tokens);
  p->pinned_tables = TableBytes(groups);
  p->pinned_host = p->pinned_tables;
}

}  // namespace

Result<RankMemoryPlan> PlanRankMemory(const RankMemoryInput& in) {
  MOERUN_RETURN_IF_ERROR(CheckInput(in));
  RankMemoryPlan p;
  p.role = in.role;
  p.hidden = in.hidden;
  p.format = in.format;
  p.tensor_cores = in.tensor_cores;
  if (in.role == DeviceRole::kExpertRank) PlanExpertRank(in, &p);
  if (in.role == DeviceRole::kWholeLayer) PlanWholeLayer(in, &p);
  return p;
}

std::string DescribeRankMemory(const RankMemoryPlan& p) {
  auto line = [](const std::string& name, size_t bytes, const std::string& note) {
    return fmt::format("  {:<17} {:>15} B {:>10.1f} MiB{}\n", name, bytes,
                       static_cast<double>(bytes) / (1 << 20), note.empty() ? "" : "  " + note);
  };
  std::string s;
  if (p.role == DeviceRole::kCpuRouter) {
    return "  nothing on the device: this rank gates and routes on its CPU\n" +
           line("device total", 0, "");
  }
  for (const auto& w : p.weights) s += line(w.name, w.bytes, "weights");
  for (const auto& r : p.arena.regions) {
    s += line(r.name, r.bytes, r.alias_of.empty() ? "" : "reuses " + r.alias_of + " (not counted)");
  }
  s += line("weights total", p.weight_bytes(), "");
  s += line("non-weight total", p.non_weight_bytes(),
            fmt::format("one arena: {} rows of the largest batch", p.max_rows));
  s += line("device total", p.device_total(), "");
  s += line("pinned host", p.pinned_host, "");
  return s;
}

}  // namespace moerun::cuda_plan
