#include "model/preset.h"

#include <cmath>

#include "model/preset_hash.h"

namespace moerun {
namespace {

float Round(float v, DType dtype) {
  if (dtype == DType::kBF16) return Bf16ToF32(F32ToBf16(v));
  if (dtype == DType::kF16) return F16ToF32(F32ToF16(v));
  return v;
}

// Row `row` of a preset tensor with `cols` columns: uniform(-a, a), a = sqrt(3 / fan_in), so
// every output has unit variance for unit-variance inputs.
void PresetRow(uint64_t seed, int layer, int tensor, int expert, int64_t row, int64_t cols,
               int64_t fan_in, DType dtype, float* out) {
  const uint64_t seed_row = preset_hash::RowSeed(seed, layer, tensor, expert, row);
  const float a = std::sqrt(3.0f / static_cast<float>(fan_in));
  for (int64_t c = 0; c < cols; ++c) out[c] = Round(preset_hash::Element(seed_row, c, a), dtype);
}

struct PresetDef {
  const char* name;
  const char* published;  // the model whose config.json it follows
  ModelSpec (*make)();
};

ModelSpec Mixtral() {
  ModelSpec s;
  s.family = Family::kMixtral;
  s.hidden = 4096, s.num_layers = 32, s.num_experts = 8, s.top_k = 2, s.expert_inter = 14336;
  s.gate.kind = GateKind::kSoftmaxTopK;
  for (int i = 0; i < 32; ++i) s.moe_layers.push_back(i);
  return s;
}

ModelSpec Qwen3() {
  ModelSpec s;
  s.family = Family::kQwen3Moe;
  s.hidden = 2048, s.num_layers = 48, s.num_experts = 128, s.top_k = 8, s.expert_inter = 768;
  s.gate.kind = GateKind::kSoftmaxTopK;
  for (int i = 0; i < 48; ++i) s.moe_layers.push_back(i);
  return s;
}

ModelSpec DeepseekV3() {
  ModelSpec s;
  s.family = Family::kDeepseekV3;
  s.hidden = 7168, s.num_layers = 61, s.num_experts = 256, s.top_k = 8, s.expert_inter = 2048;
  s.shared_inter = 2048;
  s.gate.kind = GateKind::kSigmoidTopK;
  s.gate.selection_bias = true;
  s.gate.renorm_eps = 1e-20f;
  s.gate.scale = 2.5f;
  s.gate.n_group = 8, s.gate.topk_group = 4;
  for (int i = 3; i < 61; ++i) s.moe_layers.push_back(i);
  return s;
}

ModelSpec GptOss20b() {
  ModelSpec s;
  s.family = Family::kGptOss;
  s.hidden = 2880, s.num_layers = 24, s.num_experts = 32, s.top_k = 4, s.expert_inter = 2880;
  s.gate.kind = GateKind::kTopKSoftmax;
  s.router_bias = s.expert_bias = true;
  s.act = ActKind::kGptOss;
  s.swiglu_limit = 7.0f;
  for (int i = 0; i < 24; ++i) s.moe_layers.push_back(i);
  return s;
}

ModelSpec Step35Flash() {
  ModelSpec s;
  s.family = Family::kStep3p5;
  s.hidden = 4096, s.num_layers = 45, s.num_experts = 288, s.top_k = 8, s.expert_inter = 1280;
  s.shared_inter = 1280;
  s.gate.kind = GateKind::kSigmoidTopK;
  s.gate.selection_bias = true;
  s.gate.renorm_eps = 1e-20f;
  s.gate.scale = 3.0f;
  s.act = ActKind::kSwiGluClamped;
  s.swiglu_limits.assign(48, 0.0f);
  s.swiglu_limits[43] = s.swiglu_limits[44] = 7.0f;
  s.swiglu_limits_shared.assign(48, 0.0f);
  s.swiglu_limits_shared[44] = 16.0f;
  for (int i = 3; i < 45; ++i) s.moe_layers.push_back(i);
  return s;
}

const PresetDef kPresets[] = {
    {"mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", &Mixtral},
    {"qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", &Qwen3},
    {"deepseek-v3", "deepseek-ai/DeepSeek-V3", &DeepseekV3},
    {"gpt-oss-20b", "openai/gpt-oss-20b", &GptOss20b},
    {"step-3.5-flash", "stepfun-ai/Step-3.5-Flash", &Step35Flash},
};

size_t ExpertBytes(const ModelSpec& s, DType dtype) {
  return static_cast<size_t>(3 * s.hidden * s.expert_inter) * (dtype == DType::kF32 ? 4 : 2);
}

}  // namespace

std::vector<std::string> PresetNames() {
  std::vector<std::string> out;
  for (const auto& p : kPresets) out.push_back(p.name);
  return out;
}

Result<ModelSpec> PresetFullSpec(const std::string& name) {
  for (const auto& p : kPresets) {
    if (name == p.name) {
      ModelSpec s = p.make();
      s.gate.num_experts = s.num_experts;
      s.gate.top_k = s.top_k;
      return s;
    }
  }
  std::string names;
  for (const auto& p : kPresets) names += std::string(names.empty() ? "" : ", ") + p.name;
  return Status::NotFound("no preset named '" + name + "' (presets: " + names + ")");
}

Result<ModelSpec> PresetSpec(const std::string& name, const PresetOptions& opts,
                             std::string* note) {
  MOERUN_ASSIGN_OR_RETURN(ModelSpec s, PresetFullSpec(name));
  if (!IsKernelWeightType(opts.dtype)) {
    return Status::InvalidArgument("preset weights must be F32, BF16 or F16");
  }
  const int full = s.num_experts;
  const int groups = s.gate.n_group;
  int n = full;
  if (opts.experts > 0) {
    n = opts.experts;
    if (n > full) {
      return Status::InvalidArgument(name + " has " + std::to_string(full) +
                                     " experts; --experts " + std::to_string(n) + " is more");
    }
  } else {
    const size_t per = ExpertBytes(s, opts.dtype);
    const size_t fixed =
        static_cast<size_t>(3 * s.hidden * s.shared_inter) * (opts.dtype == DType::kF32 ? 4 : 2);
    const size_t fit = opts.budget_bytes > fixed ? (opts.budget_bytes - fixed) / per : 0;
    if (fit < static_cast<size_t>(full)) {
      n = static_cast<int>(fit) / groups * groups;
      if (n < s.top_k) n = (s.top_k + groups - 1) / groups * groups;
      if (note) {
        *note = name + ": " + std::to_string(n) + " of " + std::to_string(full) +
                " experts, to fit " + std::to_string(opts.budget_bytes >> 20) + " MiB of " +
                DTypeName(opts.dtype) + " expert weights (" + std::to_string(per >> 20) +
                " MiB each); --experts N to choose";
      }
    }
  }
  if (groups > 1 && n % groups != 0) {
    return Status::InvalidArgument(name + " groups its experts in " + std::to_string(groups) +
                                   "; --experts must be a multiple of that");
  }
  s.num_experts = n;
  s.gate.num_experts = n;
  MOERUN_RETURN_IF_ERROR(s.Validate());
  return s;
}

float PresetValue(uint64_t seed, int layer, int tensor, int expert, int64_t row, int64_t col,
                  int64_t fan_in, DType dtype) {
  std::vector<float> r(static_cast<size_t>(col + 1));
  PresetRow(seed, layer, tensor, expert, row, col + 1, fan_in, dtype, r.data());
  return r[static_cast<size_t>(col)];
}

Result<MoeLayerWeights> BuildPresetLayer(const ModelSpec& spec, const CpuKernels& kernels,
                                         const PresetOptions& opts) {
  MOERUN_RETURN_IF_ERROR(spec.Validate());
  int layer = opts.layer < 0 ? spec.FirstMoeLayer() : opts.layer;
  if (!spec.IsMoeLayer(layer)) {
    return Status::InvalidArgument("layer " + std::to_string(layer) + " is not an MoE layer of " +
                                   FamilyName(spec.family));
  }
  const int experts = spec.num_experts;
  if (!opts.load_expert.empty() && opts.load_expert.size() != static_cast<size_t>(experts)) {
    return Status::InvalidArgument("expert mask size does not match the expert count");
  }
  const int64_t h = spec.hidden;
  const uint64_t seed = opts.seed;
  MoeLayerWeights w;
  w.spec = spec;
  w.layer = layer;
  w.dtype = opts.dtype;
  w.experts.resize(static_cast<size_t>(experts));
  const int64_t gate_rows = experts + (spec.shared_gated ? 1 : 0);
  w.gate = PackedMatrix(DType::kF32, gate_rows, h, kernels.nr);
  w.gate.Fill(
      [&](int64_t n, float* row) {
        if (n < experts) {
          PresetRow(seed, layer, 0, static_cast<int>(n), 0, h, h, DType::kF32, row);
        } else {
          PresetRow(seed, layer, 9, -1, 0, h, h, DType::kF32, row);
        }
      },
      opts.threads);
  auto vec = [&](int tensor, int64_t n, float scale) {
    std::vector<float> v(static_cast<size_t>(n));
    PresetRow(seed, layer, tensor, 0, 0, n, 3, DType::kF32, v.data());
    for (auto& x : v) x = x * scale;
    return v;
  };
  if (spec.router_bias) {
    w.gate_bias = vec(5, experts, 0.1f);
    w.gate_bias.resize(static_cast<size_t>(w.gate.n_padded()), 0.0f);
  }
  if (spec.gate.selection_bias) w.selection_bias = vec(4, experts, 0.1f);
  if (!std::isfinite(opts.gate_skew) || opts.gate_skew < 0 || opts.gate_skew > 8) {
    return Status::InvalidArgument("gate skew must be in 0..8 (a Zipf exponent over experts)");
  }
  if (opts.gate_skew > 0) {
    w.gate_bias.resize(static_cast<size_t>(w.gate.n_padded()), 0.0f);
    for (int e = 0; e < experts; ++e) {
      const auto skew = static_cast<float>(-opts.gate_skew * std::log(static_cast<double>(e + 1)));
      w.gate_bias[static_cast<size_t>(e)] = w.gate_bias[static_cast<size_t>(e)] + skew;
    }
  }

  auto expert_source = [&](int e, int64_t inter) {
    ExpertSource es;
    const DType dt = opts.dtype;
    es.gate = [=](int64_t n, float* out) { PresetRow(seed, layer, 1, e, n, h, h, dt, out); };
    es.up = [=](int64_t n, float* out) { PresetRow(seed, layer, 2, e, n, h, h, dt, out); };
    es.down = [=](int64_t n, float* out) {
      PresetRow(seed, layer, 3, e, n, inter, inter, dt, out);
    };
    if (spec.expert_bias) {
      es.bias_gate.resize(static_cast<size_t>(inter));
      es.bias_up.resize(static_cast<size_t>(inter));
      es.bias_down.resize(static_cast<size_t>(h));
      PresetRow(seed, layer, 6, e, 0, inter, 3, DType::kF32, es.bias_gate.data());
      PresetRow(seed, layer, 7, e, 0, inter, 3, DType::kF32, es.bias_up.data());
      PresetRow(seed, layer, 8, e, 0, h, 3, DType::kF32, es.bias_down.data());
      for (auto* v : {&es.bias_gate, &es.bias_up, &es.bias_down}) {
        for (auto& x : *v) x = x * 0.1f;
      }
    }
    return es;
  };
  int todo = 0;
  for (int e = 0; e < experts; ++e) todo += opts.load_expert.empty() || opts.load_expert[e];
  int done = 0;
  size_t bytes = 0;
  for (int e = 0; e < experts; ++e) {
    if (!opts.load_expert.empty() && !opts.load_expert[e]) continue;
    w.experts[static_cast<size_t>(e)] =
        PackExpert(kernels, opts.dtype, h, spec.expert_inter, expert_source(e, spec.expert_inter),
                   opts.threads);
    bytes += w.experts[static_cast<size_t>(e)].bytes();
    ++done;
    if (opts.progress) opts.progress(done, todo, bytes);
  }
  if (spec.shared_inter > 0) {
    w.shared = PackExpert(kernels, opts.dtype, h, spec.shared_inter,
                          expert_source(-1, spec.shared_inter), opts.threads);
  }
  return w;
}

}  // namespace moerun
