#include "runtime/model/preset.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <optional>

#include "base/quant_formats.h"
#include "base/thread_pool.h"
#include "experts/cpu/packed_matrix.h"
#include "runtime/model/preset_hash.h"

namespace moerun {
namespace {

constexpr int kGateTensor = 1, kUpTensor = 2, kDownTensor = 3;

float Round(float v, DType dtype) {
  if (dtype == DType::kBF16) return Bf16ToF32(F32ToBf16(v));
  if (dtype == DType::kF16) return F16ToF32(F32ToF16(v));
  return v;
}

// Row `row` of a preset tensor with `cols` columns: uniform(-a, a), a = sqrt(3 / fan_in), so
// every output has unit variance for unit-variance inputs.
float RowRange(int64_t fan_in) { return std::sqrt(3.0f / static_cast<float>(fan_in)); }

void PresetRow(uint64_t seed, int layer, int tensor, int expert, int64_t row, int64_t cols,
               int64_t fan_in, DType dtype, float* out) {
  const uint64_t seed_row = preset_hash::RowSeed(seed, layer, tensor, expert, row);
  const float a = RowRange(fan_in);
  for (int64_t c = 0; c < cols; ++c) out[c] = Round(preset_hash::Element(seed_row, c, a), dtype);
}

// One expert matrix W [rows][cols] of a preset (tensor 1, 2 or 3; fan-in cols).
struct TensorId {
  uint64_t seed;
  int layer;
  int tensor;
  int expert;
};

// An FP8 expert matrix, quantized once: the codes (one a byte, row-major) and the scale_inv of
// every 128 x 128 block. A block's scale needs all of its values, so each band of 128 rows is
// generated once, whole, and quantized from those values; the packer then reads rows of codes.
struct Fp8Matrix {
  int64_t rows = 0, cols = 0, col_blocks = 0;
  std::vector<uint8_t> codes;
  std::vector<float> scales;  // [ceil(rows / 128)][col_blocks]

  void Resize(int64_t r, int64_t c) {
    rows = r, cols = c, col_blocks = (c + kFp8BlockRows - 1) / kFp8BlockRows;
    codes.resize(static_cast<size_t>(r * c));
    scales.resize(static_cast<size_t>((r + kFp8BlockRows - 1) / kFp8BlockRows * col_blocks));
  }
  int64_t bands() const { return (rows + kFp8BlockRows - 1) / kFp8BlockRows; }
  bool Read(int64_t n, uint8_t* c, float* s) const {
    std::memcpy(c, codes.data() + n * cols, static_cast<size_t>(cols));
    std::memcpy(s, scales.data() + n / kFp8BlockRows * col_blocks,
                static_cast<size_t>(col_blocks) * sizeof(float));
    return true;
  }
};

// Band `band` of `m`; `values` holds 128 x cols floats.
void QuantizeFp8Band(const TensorId& t, int64_t band, Fp8Matrix* m, float* values) {
  const int64_t r0 = band * kFp8BlockRows;
  const int64_t len = std::min<int64_t>(kFp8BlockRows, m->rows - r0);
  const int64_t cols = m->cols;
  for (int64_t r = 0; r < len; ++r) {
    PresetRow(t.seed, t.layer, t.tensor, t.expert, r0 + r, cols, cols, DType::kF32,
              values + r * cols);
  }
  for (int64_t b = 0; b < m->col_blocks; ++b) {
    const int64_t c0 = b * kFp8BlockRows;
    const int64_t c1 = std::min<int64_t>(cols, c0 + kFp8BlockRows);
    float amax = 0.0f;
    for (int64_t r = 0; r < len; ++r) {
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(values[r * cols + c]));
    }
    const float scale = PresetFp8Scale(amax);
    m->scales[static_cast<size_t>(band * m->col_blocks + b)] = scale;
    for (int64_t r = 0; r < len; ++r) {
      uint8_t* codes = m->codes.data() + (r0 + r) * cols;
      for (int64_t c = c0; c < c1; ++c) codes[c] = PresetE4m3Code(values[r * cols + c] / scale);
    }
  }
}

// Expert e's W_gate, W_up [inter][h] and W_down [h][inter] in FP8, bands on the pool's threads
// (`values`: one buffer of 128 x max(h, inter) floats per worker).
void QuantizeFp8Expert(uint64_t seed, int layer, int e, int64_t h, int64_t inter, ThreadPool* pool,
                       std::vector<std::vector<float>>* values, std::array<Fp8Matrix, 3>* m) {
  (*m)[0].Resize(inter, h);
  (*m)[1].Resize(inter, h);
  (*m)[2].Resize(h, inter);
  const int64_t gate_bands = (*m)[0].bands();
  const int64_t tasks = 2 * gate_bands + (*m)[2].bands();
  pool->ParallelFor(tasks, [&](int64_t task, int worker) {
    const int which = task < 2 * gate_bands ? static_cast<int>(task / gate_bands) : 2;
    const int64_t band = which < 2 ? task % gate_bands : task - 2 * gate_bands;
    const TensorId id{seed, layer, kGateTensor + which, e};
    QuantizeFp8Band(id, band, &(*m)[static_cast<size_t>(which)],
                    (*values)[static_cast<size_t>(worker)].data());
  });
}

// Row n of an MXFP4 expert matrix with `cols` inputs: each group of 32 generated and quantized.
bool QuantizeMxfp4Row(const TensorId& t, int64_t n, int64_t cols, uint8_t* codes, float* scales) {
  const uint64_t seed_row = preset_hash::RowSeed(t.seed, t.layer, t.tensor, t.expert, n);
  const float a = RowRange(cols);
  float v[kMxGroup];
  for (int64_t c0 = 0, g = 0; c0 < cols; c0 += kMxGroup, ++g) {
    const int len = static_cast<int>(std::min<int64_t>(kMxGroup, cols - c0));
    float amax = 0.0f;
    for (int i = 0; i < len; ++i) {
      v[i] = preset_hash::Element(seed_row, c0 + i, a);
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float scale = PresetMxfp4Scale(amax);
    scales[g] = scale;
    for (int i = 0; i < len; ++i) codes[c0 + i] = PresetE2m1Code(v[i] / scale);
  }
  return true;
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

// Bytes an expert's weights take as held, per weight: block-scaled types count their scales
// (FP8: PackedMatrix's 64-byte header per 128 x 16 codes; MXFP4: one e8m0 byte per 32 weights).
double BytesPerWeight(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4.0;
    case DType::kF8E4M3:
      return 1.0 + static_cast<double>(kFp8HeaderBytes) / (kFp8BlockRows * 16);
    case DType::kF4:
      return 0.5 + 1.0 / kMxGroup;
    default:
      return 2.0;
  }
}

size_t ExpertBytes(int64_t hidden, int64_t inter, DType dtype) {
  return static_cast<size_t>(static_cast<double>(3 * hidden * inter) * BytesPerWeight(dtype));
}

}  // namespace

Status ScaleIntermediate(const std::string& name, int64_t inter, ModelSpec* s) {
  if (inter == 0) return Status::Ok();
  const int64_t full = s->expert_inter;
  if (inter < kMxGroup || inter > full || inter % kMxGroup != 0) {
    return Status::InvalidArgument("intermediate " + std::to_string(inter) +
                                   ": must be a multiple of " + std::to_string(kMxGroup) + " in [" +
                                   std::to_string(kMxGroup) + ", " + std::to_string(full) + "] (" +
                                   name + "'s expert intermediate size is " + std::to_string(full) +
                                   "; 0 keeps it)");
  }
  if (s->shared_inter > 0) {  // the same factor, rounded to whole groups of 32
    const int64_t scaled = (s->shared_inter * inter + full * kMxGroup / 2) / (full * kMxGroup);
    s->shared_inter = std::max<int64_t>(1, scaled) * kMxGroup;
  }
  s->expert_inter = inter;
  return Status::Ok();
}

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
  if (!IsPackableType(opts.dtype)) {
    return Status::InvalidArgument("preset weights must be F32, BF16, F16, F8_E4M3 or F4");
  }
  MOERUN_RETURN_IF_ERROR(ScaleIntermediate(name, opts.intermediate, &s));
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
    const size_t per = ExpertBytes(s.hidden, s.expert_inter, opts.dtype);
    const size_t fixed = ExpertBytes(s.hidden, s.shared_inter, opts.dtype);
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

float PresetFp8Scale(float amax) { return amax > 0.0f ? amax / kE4m3Max : 1.0f; }

float PresetMxfp4Scale(float amax) {
  if (!(amax > 0.0f)) return 1.0f;
  const int e = std::clamp(std::ilogb(amax) - 2, -127, 127);  // e2m1: 6 = 1.5 x 2^2
  return E8m0ToF32(static_cast<uint8_t>(e + 127));
}

// Rounds the float's mantissa to the format's bits (ties to even, the carry into the exponent
// included) and rebiases the exponent; values below the format's smallest normal are a multiple
// of its subnormal step, rounded by nearbyint (ties to even). The even code is the even mantissa,
// which is how F32ToE4m3 and F32ToE2m1 break ties.
uint8_t PresetE4m3Code(float v) {
  uint32_t u = std::bit_cast<uint32_t>(v);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7FFFFFFFu;
  if (u > 0x7F800000u) return 0x7F;          // NaN
  if (u >= 0x43E00000u) return sign | 0x7E;  // >= 448: saturate
  if (u < 0x3C800000u) {                     // < 2^-6: m x 2^-9, m in 0..8
    const float m = std::nearbyint(std::bit_cast<float>(u) * 512.0f);
    return sign | static_cast<uint8_t>(m);  // 8 is code 0x08 = 2^-6
  }
  u += 0x7FFFFu + ((u >> 20) & 1u);  // keep 3 mantissa bits
  const auto e = static_cast<uint32_t>(static_cast<int>(u >> 23) - 127 + 7);  // 1..15
  return sign | static_cast<uint8_t>((e << 3) | ((u >> 20) & 7u));
}

uint8_t PresetE2m1Code(float v) {
  uint32_t u = std::bit_cast<uint32_t>(v);
  const auto sign = static_cast<uint8_t>((u >> 28) & 0x8u);
  u &= 0x7FFFFFFFu;
  if (u > 0x7F800000u) return 0;          // NaN (as F32ToE2m1)
  if (u >= 0x40C00000u) return sign | 7;  // >= 6: saturate
  if (u < 0x3F800000u) {                  // < 1: 0, 0.5 or 1
    return sign | static_cast<uint8_t>(std::nearbyint(std::bit_cast<float>(u) * 2.0f));
  }
  u += 0x1FFFFFu + ((u >> 22) & 1u);                                          // keep 1 mantissa bit
  const auto e = static_cast<uint32_t>(static_cast<int>(u >> 23) - 127 + 1);  // 1..3
  return sign | static_cast<uint8_t>((e << 1) | ((u >> 22) & 1u));
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
  if (!opts.experts_only) w.gate = PackedMatrix(DType::kF32, gate_rows, h, kernels.nr);
  if (!opts.experts_only)
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
  if (opts.gate_skew > 0 && !opts.experts_only) {
    w.gate_bias.resize(static_cast<size_t>(w.gate.n_padded()), 0.0f);
    for (int e = 0; e < experts; ++e) {
      const auto skew = static_cast<float>(-opts.gate_skew * std::log(static_cast<double>(e + 1)));
      w.gate_bias[static_cast<size_t>(e)] = w.gate_bias[static_cast<size_t>(e)] + skew;
    }
  }

  // FP8: each expert's matrices quantized whole before packing (scratch reused across experts).
  const DType dt = opts.dtype;
  std::optional<ThreadPool> fp8_pool;
  std::vector<std::vector<float>> fp8_values;
  std::array<Fp8Matrix, 3> fp8;
  if (dt == DType::kF8E4M3) {
    fp8_pool.emplace(std::max(1, opts.threads));
    const int64_t widest = std::max({h, spec.expert_inter, spec.shared_inter});
    fp8_values.assign(static_cast<size_t>(fp8_pool->size()),
                      std::vector<float>(static_cast<size_t>(kFp8BlockRows * widest)));
  }
  auto expert_source = [&](int e, int64_t inter) {
    ExpertSource es;
    if (dt == DType::kF8E4M3) {
      QuantizeFp8Expert(seed, layer, e, h, inter, &*fp8_pool, &fp8_values, &fp8);
      es.qgate = [m = &fp8[0]](int64_t n, uint8_t* c, float* s) { return m->Read(n, c, s); };
      es.qup = [m = &fp8[1]](int64_t n, uint8_t* c, float* s) { return m->Read(n, c, s); };
      es.qdown = [m = &fp8[2]](int64_t n, uint8_t* c, float* s) { return m->Read(n, c, s); };
    } else if (dt == DType::kF4) {
      const TensorId g{seed, layer, kGateTensor, e}, u{seed, layer, kUpTensor, e};
      const TensorId d{seed, layer, kDownTensor, e};
      es.qgate = [=](int64_t n, uint8_t* c, float* s) { return QuantizeMxfp4Row(g, n, h, c, s); };
      es.qup = [=](int64_t n, uint8_t* c, float* s) { return QuantizeMxfp4Row(u, n, h, c, s); };
      es.qdown = [=](int64_t n, uint8_t* c, float* s) {
        return QuantizeMxfp4Row(d, n, inter, c, s);
      };
    } else {
      es.gate = [=](int64_t n, float* out) { PresetRow(seed, layer, 1, e, n, h, h, dt, out); };
      es.up = [=](int64_t n, float* out) { PresetRow(seed, layer, 2, e, n, h, h, dt, out); };
      es.down = [=](int64_t n, float* out) {
        PresetRow(seed, layer, 3, e, n, inter, inter, dt, out);
      };
    }
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
  if (spec.shared_inter > 0 && !opts.experts_only) {
    w.shared = PackExpert(kernels, opts.dtype, h, spec.shared_inter,
                          expert_source(-1, spec.shared_inter), opts.threads);
  }
  return w;
}

}  // namespace moerun
