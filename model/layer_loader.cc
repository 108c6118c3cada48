#include "model/layer_loader.h"

#include <array>
#include <bit>
#include <cstdio>
#include <cstring>

namespace moerun {
namespace {

// Element (n, k) of a logical matrix W [rows][cols] is at data[n*rs + k*cs] (elements).
struct MatrixView {
  const uint8_t* data = nullptr;
  DType dtype = DType::kF32;
  int64_t rows = 0, cols = 0, rs = 0, cs = 0;
};

RowReader Reader(const MatrixView& v) {
  return [v](int64_t n, float* out) {
    if (v.cs == 1 && v.dtype == DType::kF32) {
      std::memcpy(out, v.data + n * v.rs * 4, static_cast<size_t>(v.cols) * 4);
      return;
    }
    for (int64_t k = 0; k < v.cols; ++k) out[k] = LoadAsF32(v.data, v.dtype, n * v.rs + k * v.cs);
  };
}

std::string ShapeStr(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

class TensorSource {
 public:
  TensorSource(const Checkpoint& ck, std::string prefix) : ck_(ck), prefix_(std::move(prefix)) {}

  std::string Name(const std::string& suffix) const { return prefix_ + suffix; }
  bool Has(const std::string& suffix) const { return ck_.Has(Name(suffix)); }

  // The tensor `suffix`, checked for a kernel dtype and for `shape`.
  Result<TensorRef> Get(const std::string& suffix, const std::vector<int64_t>& shape) const {
    const std::string name = Name(suffix);
    if (!ck_.Has(name)) {
      // Name the quantised forms precisely: they are a known, not-yet-supported layout.
      for (const char* q : {"_blocks", "_scales"}) {
        if (ck_.Has(name + q)) {
          return Status::Unsupported("tensor '" + name + q +
                                     "' is MXFP4 (U8 blocks with E8M0 scales): not supported yet");
        }
      }
      return Status::NotFound("tensor '" + name + "' is missing from the checkpoint " + ck_.path());
    }
    MOERUN_ASSIGN_OR_RETURN(TensorRef t, ck_.Get(name));
    const DType dt = t.info->dtype;
    if (!IsKernelWeightType(dt)) {
      std::string what = DTypeName(dt);
      const std::string base =
          name.size() > 7 && name.ends_with(".weight") ? name.substr(0, name.size() - 7) : name;
      if (dt == DType::kF8E4M3 || dt == DType::kF8E5M2) {
        what += ck_.Has(base + ".weight_scale_inv") ? " (FP8 block-scaled, with weight_scale_inv)"
                                                    : " (FP8)";
      } else if (dt == DType::kU8 && suffix.ends_with("_blocks")) {
        what += " (MXFP4 blocks)";
      }
      return Status::Unsupported("tensor '" + name + "' has dtype " + what +
                                 ": not supported yet (F32, BF16 and F16 are)");
    }
    if (t.info->shape != shape) {
      return Status::InvalidArgument("tensor '" + name + "' has shape " + ShapeStr(t.info->shape) +
                                     " but the config implies " + ShapeStr(shape));
    }
    return t;
  }

  Result<MatrixView> Matrix(const std::string& suffix, int64_t rows, int64_t cols) const {
    MOERUN_ASSIGN_OR_RETURN(TensorRef t, Get(suffix, {rows, cols}));
    return MatrixView{t.data, t.info->dtype, rows, cols, cols, 1};
  }

  Result<std::vector<float>> Vector(const std::string& suffix, int64_t n) const {
    MOERUN_ASSIGN_OR_RETURN(TensorRef t, Get(suffix, {n}));
    std::vector<float> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = LoadAsF32(t.data, t.info->dtype, i);
    return v;
  }

  void WillNeed(const TensorRef& t) const {
    t.file->WillNeed(static_cast<uint64_t>(t.data - t.file->data()), t.info->end - t.info->begin);
  }

 private:
  const Checkpoint& ck_;
  std::string prefix_;
};

DType PackType(DType a, DType b, DType c) { return a == b && b == c ? a : DType::kF32; }

float RoundTo(float v, DType t) {
  if (t == DType::kBF16) return Bf16ToF32(F32ToBf16(v));
  if (t == DType::kF16) return F16ToF32(F32ToF16(v));
  return v;
}

// The gate, up and down tensors an expert comes from (for errors).
using TensorNames = std::array<std::string, 3>;

// OK when every weight of `es` is exactly representable in `held`; otherwise names the first
// tensor and value that is not.
Status CheckExact(const ExpertSource& es, DType held, int64_t hidden, int64_t inter,
                  const TensorNames& names) {
  std::vector<float> row;
  const RowReader* readers[3] = {&es.gate, &es.up, &es.down};
  for (int m = 0; m < 3; ++m) {
    const int64_t rows = m < 2 ? inter : hidden;
    const int64_t cols = m < 2 ? hidden : inter;
    row.resize(static_cast<size_t>(cols));
    for (int64_t n = 0; n < rows; ++n) {
      (*readers[m])(n, row.data());
      for (int64_t k = 0; k < cols; ++k) {
        const float v = row[static_cast<size_t>(k)];
        if (std::bit_cast<uint32_t>(RoundTo(v, held)) == std::bit_cast<uint32_t>(v)) continue;
        char buf[160];
        std::snprintf(buf, sizeof buf, "%.9g (output %lld, input %lld of the matrix)",
                      static_cast<double>(v), static_cast<long long>(n), static_cast<long long>(k));
        return Status::InvalidArgument(
            "tensor '" + names[static_cast<size_t>(m)] + "' holds the value " + buf + ", which " +
            DTypeName(held) + " cannot hold exactly; the experts are held as " + DTypeName(held) +
            " and would be rounded: refusing (store the weights as " + DTypeName(held) + ")");
      }
    }
  }
  return Status::Ok();
}

// Packs an expert in `hold_as`, or in `stored` (the source's type) if unset. A conversion to F32
// is exact; one to a 16-bit type is made only if CheckExact passes.
Result<ExpertWeights> Pack(const CpuKernels& kernels, DType stored,
                           const std::optional<DType>& hold_as, int64_t hidden, int64_t inter,
                           const ExpertSource& es, const TensorNames& names, int threads) {
  const DType held = hold_as.value_or(stored);
  if (held != stored && held != DType::kF32) {
    MOERUN_RETURN_IF_ERROR(CheckExact(es, held, hidden, inter, names));
  }
  return PackExpert(kernels, held, hidden, inter, es, threads);
}

// Per-expert matrices named <expert>.<gate|up|down> (Mixtral w1/w3/w2, others *_proj.weight).
Result<ExpertWeights> LoadSeparateExpert(const TensorSource& src, const std::string& base,
                                         const char* gate, const char* up, const char* down,
                                         int64_t hidden, int64_t inter, const CpuKernels& kernels,
                                         const std::optional<DType>& hold_as, int threads) {
  MOERUN_ASSIGN_OR_RETURN(MatrixView g, src.Matrix(base + gate, inter, hidden));
  MOERUN_ASSIGN_OR_RETURN(MatrixView u, src.Matrix(base + up, inter, hidden));
  MOERUN_ASSIGN_OR_RETURN(MatrixView d, src.Matrix(base + down, hidden, inter));
  ExpertSource es{Reader(g), Reader(u), Reader(d), {}, {}, {}};
  return Pack(kernels, PackType(g.dtype, u.dtype, d.dtype), hold_as, hidden, inter, es,
              {src.Name(base + gate), src.Name(base + up), src.Name(base + down)}, threads);
}

// The router (with the Qwen2-MoE shared-expert gate as its last row), router bias and selection
// bias.
Status LoadRouter(const TensorSource& src, const ModelSpec& spec, const std::string& gate_name,
                  const CpuKernels& kernels, MoeLayerWeights* w) {
  const int64_t h = spec.hidden;
  const int experts = spec.num_experts;
  MOERUN_ASSIGN_OR_RETURN(MatrixView gate, src.Matrix(gate_name, experts, h));
  MatrixView shared_gate;
  if (spec.shared_gated) {
    MOERUN_ASSIGN_OR_RETURN(shared_gate, src.Matrix("mlp.shared_expert_gate.weight", 1, h));
  }
  const int64_t gate_rows = experts + (spec.shared_gated ? 1 : 0);
  w->gate = PackedMatrix(DType::kF32, gate_rows, h, kernels.nr);
  const RowReader gate_reader = Reader(gate);
  const RowReader shared_gate_reader = spec.shared_gated ? Reader(shared_gate) : RowReader();
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
  const int64_t h = spec.hidden;
  const int64_t inter = spec.expert_inter;
  const int experts = spec.num_experts;
  if (!opts.load_expert.empty() && opts.load_expert.size() != static_cast<size_t>(experts)) {
    return Status::InvalidArgument("expert mask size does not match the expert count");
  }
  if (opts.hold_as && !IsKernelWeightType(*opts.hold_as)) {
    return Status::InvalidArgument(std::string("cannot hold expert weights as ") +
                                   DTypeName(*opts.hold_as) + " (F32, BF16 and F16 can be)");
  }
  const std::string L = "model.layers." + std::to_string(layer) + ".";
  TensorSource src(ckpt, L);

  MoeLayerWeights w;
  w.spec = spec;
  w.layer = layer;
  w.experts.resize(static_cast<size_t>(experts));

  // Router.
  std::string gate_name, expert_prefix, g_name, u_name, d_name;
  switch (spec.family) {
    case Family::kMixtral:
      gate_name = "block_sparse_moe.gate.weight";
      expert_prefix = "block_sparse_moe.experts.";
      g_name = ".w1.weight", u_name = ".w3.weight", d_name = ".w2.weight";
      break;
    case Family::kQwen2Moe:
    case Family::kQwen3Moe:
    case Family::kDeepseekV3:
      gate_name = "mlp.gate.weight";
      expert_prefix = "mlp.experts.";
      g_name = ".gate_proj.weight", u_name = ".up_proj.weight", d_name = ".down_proj.weight";
      break;
    case Family::kGptOss:
      gate_name = "mlp.router.weight";
      break;
    case Family::kStep3p5:
      gate_name = "moe.gate.weight";
      break;
  }
  if (!opts.experts_only) {
    MOERUN_RETURN_IF_ERROR(LoadRouter(src, spec, gate_name, kernels, &w));
  }

  // Routed experts.
  int todo = 0;
  for (int e = 0; e < experts; ++e) todo += opts.load_expert.empty() || opts.load_expert[e];
  int done = 0;
  size_t bytes = 0;
  // Stacked families: one tensor per projection for all experts.
  TensorRef gate_up, gate_up_bias, down, down_bias, st_gate, st_up, st_down;
  if (spec.family == Family::kGptOss) {
    MOERUN_ASSIGN_OR_RETURN(gate_up, src.Get("mlp.experts.gate_up_proj", {experts, h, 2 * inter}));
    MOERUN_ASSIGN_OR_RETURN(gate_up_bias,
                            src.Get("mlp.experts.gate_up_proj_bias", {experts, 2 * inter}));
    MOERUN_ASSIGN_OR_RETURN(down, src.Get("mlp.experts.down_proj", {experts, inter, h}));
    MOERUN_ASSIGN_OR_RETURN(down_bias, src.Get("mlp.experts.down_proj_bias", {experts, h}));
  } else if (spec.family == Family::kStep3p5) {
    MOERUN_ASSIGN_OR_RETURN(st_gate, src.Get("moe.gate_proj.weight", {experts, inter, h}));
    MOERUN_ASSIGN_OR_RETURN(st_up, src.Get("moe.up_proj.weight", {experts, inter, h}));
    MOERUN_ASSIGN_OR_RETURN(st_down, src.Get("moe.down_proj.weight", {experts, h, inter}));
  }
  for (int e = 0; e < experts; ++e) {
    if (!opts.load_expert.empty() && !opts.load_expert[e]) continue;
    ExpertWeights ew;
    if (spec.family == Family::kGptOss) {
      // [E, H, 2I]: x @ W, gate = even columns, up = odd columns; down [E, I, H]: x @ W.
      const DType dt = gate_up.info->dtype;
      const int64_t base = static_cast<int64_t>(e) * h * 2 * inter;
      const MatrixView g{gate_up.data, dt, inter, h, 0, 2 * inter};
      ExpertSource es;
      es.gate = [g, base](int64_t n, float* out) {
        for (int64_t k = 0; k < g.cols; ++k)
          out[k] = LoadAsF32(g.data, g.dtype, base + k * g.cs + 2 * n);
      };
      es.up = [g, base](int64_t n, float* out) {
        for (int64_t k = 0; k < g.cols; ++k) {
          out[k] = LoadAsF32(g.data, g.dtype, base + k * g.cs + 2 * n + 1);
        }
      };
      const DType ddt = down.info->dtype;
      const int64_t dbase = static_cast<int64_t>(e) * inter * h;
      const uint8_t* dd = down.data;
      es.down = [dd, ddt, dbase, inter, h](int64_t n, float* out) {
        for (int64_t k = 0; k < inter; ++k) out[k] = LoadAsF32(dd, ddt, dbase + k * h + n);
      };
      for (int64_t j = 0; j < inter; ++j) {
        const int64_t o = static_cast<int64_t>(e) * 2 * inter + 2 * j;
        es.bias_gate.push_back(LoadAsF32(gate_up_bias.data, gate_up_bias.info->dtype, o));
        es.bias_up.push_back(LoadAsF32(gate_up_bias.data, gate_up_bias.info->dtype, o + 1));
      }
      for (int64_t j = 0; j < h; ++j) {
        es.bias_down.push_back(
            LoadAsF32(down_bias.data, down_bias.info->dtype, static_cast<int64_t>(e) * h + j));
      }
      const std::string gu_name = src.Name("mlp.experts.gate_up_proj");
      MOERUN_ASSIGN_OR_RETURN(
          ew, Pack(kernels, PackType(dt, ddt, dt), opts.hold_as, h, inter, es,
                   {gu_name, gu_name, src.Name("mlp.experts.down_proj")}, opts.threads));
    } else if (spec.family == Family::kStep3p5) {
      const int64_t gu = static_cast<int64_t>(e) * inter * h;
      const MatrixView g{st_gate.data, st_gate.info->dtype, inter, h, h, 1};
      const MatrixView u{st_up.data, st_up.info->dtype, inter, h, h, 1};
      const MatrixView d{st_down.data, st_down.info->dtype, h, inter, inter, 1};
      auto offset = [](MatrixView v, int64_t elems) {
        const int eb = v.dtype == DType::kF32 ? 4 : 2;
        v.data += elems * eb;
        return v;
      };
      ExpertSource es{
          Reader(offset(g, gu)), Reader(offset(u, gu)), Reader(offset(d, gu)), {}, {}, {}};
      MOERUN_ASSIGN_OR_RETURN(
          ew, Pack(kernels, PackType(g.dtype, u.dtype, d.dtype), opts.hold_as, h, inter, es,
                   {src.Name("moe.gate_proj.weight"), src.Name("moe.up_proj.weight"),
                    src.Name("moe.down_proj.weight")},
                   opts.threads));
    } else {
      MOERUN_ASSIGN_OR_RETURN(
          ew,
          LoadSeparateExpert(src, expert_prefix + std::to_string(e), g_name.c_str(), u_name.c_str(),
                             d_name.c_str(), h, inter, kernels, opts.hold_as, opts.threads));
    }
    bytes += ew.bytes();
    w.experts[static_cast<size_t>(e)] = std::move(ew);
    ++done;
    if (opts.progress) opts.progress(done, todo, bytes);
  }

  // Shared expert.
  if (spec.shared_inter > 0 && !opts.experts_only) {
    std::string base;
    const char* g = ".gate_proj.weight";
    const char* u = ".up_proj.weight";
    const char* d = ".down_proj.weight";
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
    MOERUN_ASSIGN_OR_RETURN(ExpertWeights sw,
                            LoadSeparateExpert(src, base, g, u, d, h, spec.shared_inter, kernels,
                                               opts.hold_as, opts.threads));
    w.shared = std::move(sw);
  }
  w.dtype = DType::kF32;
  if (opts.hold_as) {
    w.dtype = *opts.hold_as;
  } else {
    for (const auto& e : w.experts) {
      if (!e.w13.empty()) {
        w.dtype = e.w13.dtype();
        break;
      }
    }
  }
  return w;
}

}  // namespace moerun
