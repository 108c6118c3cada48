#include "runtime/model/layer_loader.h"

#include <array>
#include <bit>
#include <cstdio>
#include <cstring>

#include "runtime/model/tensor_source.h"

namespace moerun {
namespace {

float RoundTo(float v, DType t) {
  if (t == DType::kBF16) return Bf16ToF32(F32ToBf16(v));
  if (t == DType::kF16) return F16ToF32(F32ToF16(v));
  return v;
}

// OK when every weight of the matrices is exactly representable in `held`; otherwise names the
// first tensor and value that is not.
Status CheckExact(const std::array<const MatrixSource*, 3>& m, DType held, int64_t hidden,
                  int64_t inter) {
  std::vector<float> row;
  for (int i = 0; i < 3; ++i) {
    const int64_t rows = i < 2 ? inter : hidden;
    const int64_t cols = i < 2 ? hidden : inter;
    row.resize(static_cast<size_t>(cols));
    for (int64_t n = 0; n < rows; ++n) {
      m[static_cast<size_t>(i)]->rows(n, row.data());
      for (int64_t k = 0; k < cols; ++k) {
        const float v = row[static_cast<size_t>(k)];
        if (std::bit_cast<uint32_t>(RoundTo(v, held)) == std::bit_cast<uint32_t>(v)) continue;
        char buf[160];
        std::snprintf(buf, sizeof buf, "%.9g (output %lld, input %lld of the matrix)",
                      static_cast<double>(v), static_cast<long long>(n), static_cast<long long>(k));
        return Status::InvalidArgument(
            "tensor '" + m[static_cast<size_t>(i)]->name + "' holds the value " + buf + ", which " +
            DTypeName(held) + " cannot hold exactly; the experts are held as " + DTypeName(held) +
            " and would be rounded: refusing (store the weights as " + DTypeName(held) + ")");
      }
    }
  }
  return Status::Ok();
}

// Packs an expert from its gate, up and down matrices, in `hold_as` or else the type they are
// stored in (F32 if plain types are mixed). Block-scaled weights stay as they are stored (a
// serving layer of FP8 experts takes FP8 experts); widening to F32 dequantizes (FP8: one
// rounding to f32); narrowing to a 16-bit type happens only if CheckExact passes.
Result<ExpertWeights> PackMatrices(const CpuKernels& kernels, const std::optional<DType>& hold_as,
                                   int64_t hidden, int64_t inter, const MatrixSource& g,
                                   const MatrixSource& u, const MatrixSource& d, ExpertSource es,
                                   int threads) {
  const std::array<const MatrixSource*, 3> all{&g, &u, &d};
  DType stored = g.stored;
  for (const MatrixSource* m : all) {
    if (m->stored == stored) continue;
    if (IsBlockScaled(m->stored) || IsBlockScaled(stored)) {
      return Status::InvalidArgument("an expert mixes weight formats: '" + g.name + "' is " +
                                     DTypeName(g.stored) + " but '" + m->name + "' is " +
                                     DTypeName(m->stored));
    }
    stored = DType::kF32;
  }
  const DType held = hold_as.value_or(stored);
  if (IsBlockScaled(held) || IsBlockScaled(stored)) {
    if (held != stored && held != DType::kF32) {
      return Status::InvalidArgument(
          std::string("the experts are held as ") + HeldTypeName(held) + " but '" + g.name +
          "' is " + DTypeName(stored) + ": give the weights in the layer's own format (" +
          (held == DType::kF8E4M3 ? "F8_E4M3 with F32 weight_scale_inv per 128x128 block"
           : held == DType::kF4   ? "MXFP4 U8 _blocks and _scales"
                                  : DTypeName(held)) +
          ")");
    }
  } else if (held != stored && held != DType::kF32) {
    MOERUN_RETURN_IF_ERROR(CheckExact(all, held, hidden, inter));
  }
  es.gate = g.rows, es.up = u.rows, es.down = d.rows;
  es.qgate = g.codes, es.qup = u.codes, es.qdown = d.codes;
  return PackExpert(kernels, held, hidden, inter, es, threads);
}

// Per-expert matrices named <expert>.<gate|up|down> (Mixtral w1/w3/w2, others *_proj.weight).
Result<ExpertWeights> LoadSeparateExpert(const TensorSource& src, const std::string& base,
                                         const char* gate, const char* up, const char* down,
                                         int64_t hidden, int64_t inter, const CpuKernels& kernels,
                                         const std::optional<DType>& hold_as, int threads) {
  MOERUN_ASSIGN_OR_RETURN(MatrixSource g, src.Matrix(base + gate, inter, hidden));
  MOERUN_ASSIGN_OR_RETURN(MatrixSource u, src.Matrix(base + up, inter, hidden));
  MOERUN_ASSIGN_OR_RETURN(MatrixSource d, src.Matrix(base + down, hidden, inter));
  return PackMatrices(kernels, hold_as, hidden, inter, g, u, d, {}, threads);
}

// The router (with the Qwen2-MoE shared-expert gate as its last row), router bias and selection
// bias.
Status LoadRouter(const TensorSource& src, const ModelSpec& spec, const std::string& gate_name,
                  const CpuKernels& kernels, MoeLayerWeights* w) {
  const int64_t h = spec.hidden;
  const int experts = spec.num_experts;
  MOERUN_ASSIGN_OR_RETURN(MatrixSource gate, src.Matrix(gate_name, experts, h));
  if (gate.stored != DType::kF32 && !IsKernelWeightType(gate.stored)) {
    return Status::InvalidArgument("tensor '" + gate.name + "' has dtype " +
                                   DTypeName(gate.stored) +
                                   ": the router must be F32, BF16 or F16");
  }
  MatrixSource shared_gate;
  if (spec.shared_gated) {
    MOERUN_ASSIGN_OR_RETURN(shared_gate, src.Matrix("mlp.shared_expert_gate.weight", 1, h));
  }
  const int64_t gate_rows = experts + (spec.shared_gated ? 1 : 0);
  w->gate = PackedMatrix(DType::kF32, gate_rows, h, kernels.nr);
  const RowReader gate_reader = gate.rows;
  const RowReader shared_gate_reader = spec.shared_gated ? shared_gate.rows : RowReader();
  w->gate.Fill(
      [&](int64_t n, float* row) {
        if (n < experts) {
          gate_reader(n, row);
        } else {
          shared_gate_reader(0, row);
        }
      },
      1);
  if (spec.router_bias) {
    MOERUN_ASSIGN_OR_RETURN(std::vector<float> b, src.Vector("mlp.router.bias", experts));
    w->gate_bias.assign(static_cast<size_t>(w->gate.n_padded()), 0.0f);
    std::copy(b.begin(), b.end(), w->gate_bias.begin());
  }
  if (spec.gate.selection_bias) {
    const char* name =
        spec.family == Family::kStep3p5 ? "moe.router_bias" : "mlp.gate.e_score_correction_bias";
    MOERUN_ASSIGN_OR_RETURN(w->selection_bias, src.Vector(name, experts));
  }
  return Status::Ok();
}

// The options LoadLayer refuses whatever the checkpoint holds.
Status CheckLoadOptions(const ModelSpec& spec, const LoadOptions& opts) {
  if (!opts.load_expert.empty() &&
      opts.load_expert.size() != static_cast<size_t>(spec.num_experts)) {
    return Status::InvalidArgument("expert mask size does not match the expert count");
  }
  if (opts.hold_as && !IsPackableType(*opts.hold_as)) {
    return Status::InvalidArgument(std::string("cannot hold expert weights as ") +
                                   DTypeName(*opts.hold_as) +
                                   " (F32, BF16, F16, FP8, MXFP4 can be)");
  }
  return Status::Ok();
}

// A family's tensor names under "model.layers.<n>.": the router, and the per-expert matrices
// <expert_prefix><e><g|u|d> (empty for the stacked families, gpt-oss and Step-3.5, which hold one
// tensor per projection for all experts).
struct FamilyNames {
  std::string gate;
  std::string expert_prefix;
  std::string g, u, d;
};

FamilyNames NamesOf(Family family) {
  FamilyNames n;
  switch (family) {
    case Family::kMixtral:
      n.gate = "block_sparse_moe.gate.weight";
      n.expert_prefix = "block_sparse_moe.experts.";
      n.g = ".w1.weight", n.u = ".w3.weight", n.d = ".w2.weight";
      break;
    case Family::kQwen2Moe:
    case Family::kQwen3Moe:
    case Family::kDeepseekV3:
      n.gate = "mlp.gate.weight";
      n.expert_prefix = "mlp.experts.";
      n.g = ".gate_proj.weight", n.u = ".up_proj.weight", n.d = ".down_proj.weight";
      break;
    case Family::kGptOss:
      n.gate = "mlp.router.weight";
      break;
    case Family::kStep3p5:
      n.gate = "moe.gate.weight";
      break;
  }
  return n;
}

// gpt-oss's expert biases: one tensor per projection for all experts (empty for other families).
struct StackedBiases {
  TensorRef gate_up;  // [experts][2 * inter], gate and up interleaved by column
  TensorRef down;     // [experts][hidden]
};

// Expert e's biases, in F32.
ExpertSource GptOssBiases(const StackedBiases& b, int e, int64_t h, int64_t inter) {
  ExpertSource es;
  for (int64_t j = 0; j < inter; ++j) {
    const int64_t o = static_cast<int64_t>(e) * 2 * inter + 2 * j;
    es.bias_gate.push_back(LoadAsF32(b.gate_up.data, b.gate_up.info->dtype, o));
    es.bias_up.push_back(LoadAsF32(b.gate_up.data, b.gate_up.info->dtype, o + 1));
  }
  for (int64_t j = 0; j < h; ++j) {
    es.bias_down.push_back(
        LoadAsF32(b.down.data, b.down.info->dtype, static_cast<int64_t>(e) * h + j));
  }
  return es;
}

// Routed expert e, in the family's layout: stacked (gpt-oss with its biases, Step-3.5) or one
// tensor per expert and matrix.
Result<ExpertWeights> LoadRoutedExpert(const TensorSource& src, const ModelSpec& spec,
                                       const FamilyNames& names, const StackedBiases& biases, int e,
                                       const CpuKernels& kernels, const LoadOptions& opts) {
  const int64_t h = spec.hidden;
  const int64_t inter = spec.expert_inter;
  const int experts = spec.num_experts;
  if (spec.family == Family::kGptOss) {
    MOERUN_ASSIGN_OR_RETURN(MatrixSource g, src.GptOss(0, experts, e, h, inter));
    MOERUN_ASSIGN_OR_RETURN(MatrixSource u, src.GptOss(1, experts, e, h, inter));
    MOERUN_ASSIGN_OR_RETURN(MatrixSource d, src.GptOss(2, experts, e, h, inter));
    return PackMatrices(kernels, opts.hold_as, h, inter, g, u, d, GptOssBiases(biases, e, h, inter),
                        opts.threads);
  }
  if (spec.family == Family::kStep3p5) {
    MOERUN_ASSIGN_OR_RETURN(MatrixSource g,
                            src.Matrix("moe.gate_proj.weight", inter, h, experts, e));
    MOERUN_ASSIGN_OR_RETURN(MatrixSource u, src.Matrix("moe.up_proj.weight", inter, h, experts, e));
    MOERUN_ASSIGN_OR_RETURN(MatrixSource d,
                            src.Matrix("moe.down_proj.weight", h, inter, experts, e));
    return PackMatrices(kernels, opts.hold_as, h, inter, g, u, d, {}, opts.threads);
  }
  return LoadSeparateExpert(src, names.expert_prefix + std::to_string(e), names.g.c_str(),
                            names.u.c_str(), names.d.c_str(), h, inter, kernels, opts.hold_as,
                            opts.threads);
}

// The routed experts the mask asks for, into w->experts, calling opts.progress after each.
Status LoadRoutedExperts(const TensorSource& src, const ModelSpec& spec, const FamilyNames& names,
                         const CpuKernels& kernels, const LoadOptions& opts, MoeLayerWeights* w) {
  const int experts = spec.num_experts;
  int todo = 0;
  for (int e = 0; e < experts; ++e) todo += opts.load_expert.empty() || opts.load_expert[e];
  int done = 0;
  size_t bytes = 0;
  StackedBiases biases;
  if (spec.family == Family::kGptOss) {
    MOERUN_ASSIGN_OR_RETURN(
        biases.gate_up, src.Get("mlp.experts.gate_up_proj_bias", {experts, 2 * spec.expert_inter}));
    MOERUN_ASSIGN_OR_RETURN(biases.down,
                            src.Get("mlp.experts.down_proj_bias", {experts, spec.hidden}));
  }
  for (int e = 0; e < experts; ++e) {
    if (!opts.load_expert.empty() && !opts.load_expert[e]) continue;
    MOERUN_ASSIGN_OR_RETURN(ExpertWeights ew,
                            LoadRoutedExpert(src, spec, names, biases, e, kernels, opts));
    bytes += ew.bytes();
    w->experts[static_cast<size_t>(e)] = std::move(ew);
    ++done;
    if (opts.progress) opts.progress(done, todo, bytes);
  }
  return Status::Ok();
}

// The shared expert of the families that have one (spec.shared_inter > 0).
Result<ExpertWeights> LoadSharedExpert(const TensorSource& src, const ModelSpec& spec,
                                       const CpuKernels& kernels, const LoadOptions& opts) {
  std::string base;
  switch (spec.family) {
    case Family::kQwen2Moe:
      base = "mlp.shared_expert";
      break;
    case Family::kDeepseekV3:
      base = "mlp.shared_experts";
      break;
    case Family::kStep3p5:
      base = "share_expert";
      break;
    default:
      return Status::Internal("shared expert in a family without one");
  }
  return LoadSeparateExpert(src, base, ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight",
                            spec.hidden, spec.shared_inter, kernels, opts.hold_as, opts.threads);
}

// The type the layer's experts are held in: hold_as, else that of the first loaded expert.
DType HeldType(const MoeLayerWeights& w, const ModelSpec& spec, const LoadOptions& opts) {
  if (opts.hold_as) return *opts.hold_as;
  for (const auto& e : w.experts) {
    if (!e.w13.empty()) return e.w13.dtype();
  }
  // A router that loads no routed expert still names their format (its logs, its replies).
  if (w.shared) return w.shared->w13.dtype();
  if (spec.quant.method == QuantMethod::kFp8) return DType::kF8E4M3;
  if (spec.quant.method == QuantMethod::kMxfp4) return DType::kF4;
  return DType::kF32;
}

}  // namespace

Result<int> ResolveMoeLayer(const ModelSpec& spec, int layer) {
  if (layer < 0) {
    if (spec.moe_layers.empty()) {
      return Status::InvalidArgument(std::string(FamilyName(spec.family)) + ": no MoE layers");
    }
    return spec.FirstMoeLayer();
  }
  if (layer >= spec.num_layers) {
    return Status::InvalidArgument("layer " + std::to_string(layer) + " is beyond the model's " +
                                   std::to_string(spec.num_layers) + " layers");
  }
  if (!spec.IsMoeLayer(layer)) {
    return Status::InvalidArgument(
        "layer " + std::to_string(layer) +
        " is a dense layer, not an MoE layer (MoE layers: " + spec.Summary() + ")");
  }
  return layer;
}

Result<MoeLayerWeights> LoadLayer(const Checkpoint& ckpt, const ModelSpec& spec,
                                  const CpuKernels& kernels, const LoadOptions& opts) {
  MOERUN_RETURN_IF_ERROR(spec.Validate());
  MOERUN_ASSIGN_OR_RETURN(const int layer, ResolveMoeLayer(spec, opts.layer));
  MOERUN_RETURN_IF_ERROR(CheckLoadOptions(spec, opts));
  TensorSource src(ckpt, "model.layers." + std::to_string(layer) + ".", spec.quant);
  const FamilyNames names = NamesOf(spec.family);

  MoeLayerWeights w;
  w.spec = spec;
  w.layer = layer;
  w.experts.resize(static_cast<size_t>(spec.num_experts));
  if (!opts.experts_only) {
    MOERUN_RETURN_IF_ERROR(LoadRouter(src, spec, names.gate, kernels, &w));
  }
  MOERUN_RETURN_IF_ERROR(LoadRoutedExperts(src, spec, names, kernels, opts, &w));
  if (spec.shared_inter > 0 && !opts.experts_only) {
    MOERUN_ASSIGN_OR_RETURN(ExpertWeights sw, LoadSharedExpert(src, spec, kernels, opts));
    w.shared = std::move(sw);
  }
  w.dtype = HeldType(w, spec, opts);
  return w;
}

}  // namespace moerun
