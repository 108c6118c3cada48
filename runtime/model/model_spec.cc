#include "runtime/model/model_spec.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

namespace moerun {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxConfigBytes = 16u << 20;

// Typed access to config keys with errors that name the key and the file.
class Config {
 public:
  Config(const json& j, std::string source) : j_(j), source_(std::move(source)) {}

  bool Has(const char* key) const { return j_.contains(key) && !j_.at(key).is_null(); }

  Status Int(const char* key, int64_t* out) const {
    if (!Has(key)) return Missing(key);
    return IntValue(key, j_.at(key), out);
  }
  Status IntOr(const char* key, int64_t dflt, int64_t* out) const {
    if (!Has(key)) {
      *out = dflt;
      return Status::Ok();
    }
    return Int(key, out);
  }
  Status Float(const char* key, double* out) const {
    if (!Has(key)) return Missing(key);
    const json& v = j_.at(key);
    if (!v.is_number()) return Bad(key, "a number");
    *out = v.get<double>();
    if (!std::isfinite(*out)) return Bad(key, "a finite number");
    return Status::Ok();
  }
  Status FloatOr(const char* key, double dflt, double* out) const {
    if (!Has(key)) {
      *out = dflt;
      return Status::Ok();
    }
    return Float(key, out);
  }
  Status BoolOr(const char* key, bool dflt, bool* out) const {
    if (!Has(key)) {
      *out = dflt;
      return Status::Ok();
    }
    if (!j_.at(key).is_boolean()) return Bad(key, "true or false");
    *out = j_.at(key).get<bool>();
    return Status::Ok();
  }
  Status StringOr(const char* key, const std::string& dflt, std::string* out) const {
    if (!Has(key)) {
      *out = dflt;
      return Status::Ok();
    }
    if (!j_.at(key).is_string()) return Bad(key, "a string");
    *out = j_.at(key).get<std::string>();
    return Status::Ok();
  }
  Status IntList(const char* key, std::vector<int64_t>* out) const {
    out->clear();
    if (!Has(key)) return Status::Ok();
    const json& v = j_.at(key);
    if (!v.is_array()) return Bad(key, "a list of integers");
    for (const json& e : v) {
      int64_t x = 0;
      MOERUN_RETURN_IF_ERROR(IntValue(key, e, &x));
      out->push_back(x);
    }
    return Status::Ok();
  }
  // A per-layer list of numbers where null means 0.
  Status FloatList(const char* key, std::vector<float>* out) const {
    out->clear();
    if (!Has(key)) return Status::Ok();
    const json& v = j_.at(key);
    if (!v.is_array()) return Bad(key, "a list of numbers");
    for (const json& e : v) {
      if (e.is_null()) {
        out->push_back(0.0f);
      } else if (e.is_number() && std::isfinite(e.get<double>()) && e.get<double>() >= 0) {
        out->push_back(static_cast<float>(e.get<double>()));
      } else {
        return Bad(key, "a list of non-negative numbers or nulls");
      }
    }
    return Status::Ok();
  }
  Status Invalid(const std::string& why) const {
    return Status::InvalidArgument(source_ + ": " + why);
  }

 private:
  Status IntValue(const char* key, const json& v, int64_t* out) const {
    if (v.is_number_integer()) {
      *out = v.get<int64_t>();
      return Status::Ok();
    }
    if (v.is_number_float()) {  // 8.0 is fine, 8.5 is not
      const double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) {
        *out = static_cast<int64_t>(d);
        return Status::Ok();
      }
    }
    return Bad(key, "an integer");
  }
  Status Missing(const char* key) const {
    return Status::InvalidArgument(source_ + ": missing key \"" + key + "\"");
  }
  Status Bad(const char* key, const char* what) const {
    return Status::InvalidArgument(source_ + ": key \"" + key + "\" must be " + what);
  }

  const json& j_;
  std::string source_;
};

Status Positive(const Config& c, const char* what, int64_t v) {
  if (v <= 0) return c.Invalid(std::string(what) + " must be positive, got " + std::to_string(v));
  return Status::Ok();
}

// --- each family's keys: its table row names the keys of the expert count, top-k and expert
// width (the first present of each list is read; with none, the last is reported missing), and
// a function reads the rest (the gate and which layers are MoE).

void AllLayers(ModelSpec* s) {
  s->moe_layers.clear();
  for (int i = 0; i < s->num_layers; ++i) s->moe_layers.push_back(i);
}

int Clamped(int64_t v) { return static_cast<int>(std::clamp<int64_t>(v, -1, 1 << 20)); }

Status MixtralRest(const Config&, ModelSpec* s) {
  s->gate.kind = GateKind::kSoftmaxTopK;
  s->gate.renormalize = true;
  AllLayers(s);
  return Status::Ok();
}

Status QwenRest(const Config& c, ModelSpec* s, bool shared_expert) {
  s->gate.kind = GateKind::kSoftmaxTopK;
  MOERUN_RETURN_IF_ERROR(c.BoolOr("norm_topk_prob", false, &s->gate.renormalize));
  int64_t step = 1;
  MOERUN_RETURN_IF_ERROR(c.IntOr("decoder_sparse_step", 1, &step));
  MOERUN_RETURN_IF_ERROR(Positive(c, "decoder_sparse_step", step));
  std::vector<int64_t> mlp_only;
  MOERUN_RETURN_IF_ERROR(c.IntList("mlp_only_layers", &mlp_only));
  for (int i = 0; i < s->num_layers; ++i) {
    const bool dense = std::find(mlp_only.begin(), mlp_only.end(), i) != mlp_only.end();
    if (!dense && s->num_experts > 0 && (i + 1) % step == 0) s->moe_layers.push_back(i);
  }
  if (shared_expert) {
    MOERUN_RETURN_IF_ERROR(c.IntOr("shared_expert_intermediate_size", 0, &s->shared_inter));
    s->shared_gated = s->shared_inter > 0;
  }
  return Status::Ok();
}

Status DeepseekRest(const Config& c, ModelSpec* s) {
  GateSpec& g = s->gate;
  std::string scoring, method;
  MOERUN_RETURN_IF_ERROR(c.StringOr("scoring_func", "sigmoid", &scoring));
  MOERUN_RETURN_IF_ERROR(c.StringOr("topk_method", "noaux_tc", &method));
  if (scoring != "sigmoid" || method != "noaux_tc") {
    return Status::Unsupported("scoring_func \"" + scoring + "\" with topk_method \"" + method +
                               "\" (DeepSeek-V2 style) is not supported; " +
                               "DeepSeek-V3 uses sigmoid with noaux_tc");
  }
  g.kind = GateKind::kSigmoidTopK;
  g.selection_bias = true;
  g.renorm_eps = 1e-20f;
  MOERUN_RETURN_IF_ERROR(c.BoolOr("norm_topk_prob", true, &g.renormalize));
  double scale = 1.0;
  MOERUN_RETURN_IF_ERROR(c.FloatOr("routed_scaling_factor", 1.0, &scale));
  g.scale = static_cast<float>(scale);
  int64_t v = 0;
  MOERUN_RETURN_IF_ERROR(c.IntOr("n_group", 1, &v));
  g.n_group = Clamped(v);
  MOERUN_RETURN_IF_ERROR(c.IntOr("topk_group", g.n_group, &v));
  g.topk_group = Clamped(v);
  int64_t first_dense = 0, freq = 1, shared = 0;
  MOERUN_RETURN_IF_ERROR(c.IntOr("first_k_dense_replace", 0, &first_dense));
  MOERUN_RETURN_IF_ERROR(c.IntOr("moe_layer_freq", 1, &freq));
  MOERUN_RETURN_IF_ERROR(Positive(c, "moe_layer_freq", freq));
  for (int i = 0; i < s->num_layers; ++i) {
    if (i >= first_dense && i % freq == 0) s->moe_layers.push_back(i);
  }
  MOERUN_RETURN_IF_ERROR(c.IntOr("n_shared_experts", 0, &shared));
  if (shared < 0) return c.Invalid("n_shared_experts must not be negative");
  s->shared_inter = shared * s->expert_inter;
  return Status::Ok();
}

Status GptOssRest(const Config& c, ModelSpec* s) {
  s->gate.kind = GateKind::kTopKSoftmax;
  s->router_bias = true;
  s->expert_bias = true;
  s->act = ActKind::kGptOss;
  double limit = 7.0, alpha = 1.702;
  MOERUN_RETURN_IF_ERROR(c.FloatOr("swiglu_limit", 7.0, &limit));
  MOERUN_RETURN_IF_ERROR(c.FloatOr("swiglu_alpha", 1.702, &alpha));
  s->swiglu_limit = static_cast<float>(limit);
  s->swiglu_alpha = static_cast<float>(alpha);
  AllLayers(s);
  return Status::Ok();
}

// The router of the authors' Step3p5MoEMLP (docs/reference-semantics.md, section 6.1):
//   use_moe_router_bias: sigmoid; choose by sigmoid + router_bias; weights are the sigmoid
//     scores over (their sum + 1e-20). moe_router_activation is not read on this branch.
//   else "sigmoid": sigmoid over all experts, divided by its sum, top-k, over their sum
//     (no epsilon); the first division cancels, so: sigmoid, top-k, over the sum.
//   else ("softmax"): softmax, top-k, not renormalised.
//   Then on every branch x moe_router_scaling_factor. norm_expert_weight is not read: the
//   code passes renormalize=True to both routing functions, and its softmax branch never
//   renormalises. need_fp32_gate false: the router linear runs in the model's dtype.
// Defaults: the Step3p5Config that has them (vLLM's; the HF-hub class has none, so the
// modeling code fails on a missing key): router bias, softmax, fp32 gate, renormalise.
Status Step3p5Gate(const Config& c, ModelSpec* s) {
  GateSpec& g = s->gate;
  bool router_bias = true, fp32_gate = true, norm_weight = true;
  std::string activation;
  MOERUN_RETURN_IF_ERROR(c.BoolOr("use_moe_router_bias", true, &router_bias));
  MOERUN_RETURN_IF_ERROR(c.StringOr("moe_router_activation", "softmax", &activation));
  MOERUN_RETURN_IF_ERROR(c.BoolOr("need_fp32_gate", true, &fp32_gate));
  MOERUN_RETURN_IF_ERROR(c.BoolOr("norm_expert_weight", true, &norm_weight));  // checked only
  if (activation != "sigmoid" && activation != "softmax") {
    return Status::Unsupported("moe_router_activation \"" + activation +
                               "\" is not supported (sigmoid or softmax)");
  }
  if (router_bias || activation == "sigmoid") {
    g.kind = GateKind::kSigmoidTopK;
    g.selection_bias = router_bias;
    g.renormalize = true;
    g.renorm_eps = router_bias ? 1e-20f : 0.0f;
  } else {
    g.kind = GateKind::kSoftmaxTopK;
    g.renormalize = false;
  }
  double scale = 1.0;
  MOERUN_RETURN_IF_ERROR(c.FloatOr("moe_router_scaling_factor", 1.0, &scale));
  g.scale = static_cast<float>(scale);
  if (!fp32_gate) {
    // A float32 model's linear is the float32 product need_fp32_gate asks for; a bf16
    // model's rounds the logits to bf16 (its input is bf16 already).
    if (s->torch_dtype == "bfloat16") {
      g.bf16_logits = true;
    } else if (s->torch_dtype == "float16") {
      return Status::Unsupported(
          "need_fp32_gate false in a float16 model (the router would run in float16) is "
          "not supported; bfloat16 and float32 models are");
    }
  }
  return Status::Ok();
}

Status Step3p5Rest(const Config& c, ModelSpec* s) {
  MOERUN_RETURN_IF_ERROR(Step3p5Gate(c, s));
  MOERUN_RETURN_IF_ERROR(c.IntOr("share_expert_dim", 0, &s->shared_inter));
  s->act = ActKind::kSwiGluClamped;
  MOERUN_RETURN_IF_ERROR(c.FloatList("swiglu_limits", &s->swiglu_limits));
  MOERUN_RETURN_IF_ERROR(c.FloatList("swiglu_limits_shared", &s->swiglu_limits_shared));
  std::string layers;
  MOERUN_RETURN_IF_ERROR(c.StringOr("moe_layers_enum", "", &layers));
  if (layers.empty()) {
    for (int i = 1; i < s->num_layers; ++i) s->moe_layers.push_back(i);
    return Status::Ok();
  }
  auto parsed = ParseLayerList(layers, s->num_layers);
  if (!parsed.ok()) return c.Invalid("moe_layers_enum: " + parsed.status().message());
  s->moe_layers = std::move(parsed).value();
  return Status::Ok();
}

struct FamilyKeys {
  Family family;
  std::vector<const char*> experts, top_k;
  const char* expert_inter;
  std::function<Status(const Config&, ModelSpec*)> rest;
};

const std::vector<FamilyKeys>& FamilyTable() {
  static const std::vector<FamilyKeys> table = {
      {Family::kMixtral,
       {"num_local_experts"},
       {"num_experts_per_tok"},
       "intermediate_size",
       MixtralRest},
      {Family::kQwen2Moe,
       {"num_experts", "num_local_experts"},
       {"num_experts_per_tok"},
       "moe_intermediate_size",
       [](const Config& c, ModelSpec* s) { return QwenRest(c, s, true); }},
      {Family::kQwen3Moe,
       {"num_experts", "num_local_experts"},
       {"num_experts_per_tok"},
       "moe_intermediate_size",
       [](const Config& c, ModelSpec* s) { return QwenRest(c, s, false); }},
      {Family::kDeepseekV3,
       {"n_routed_experts", "num_local_experts"},
       {"num_experts_per_tok"},
       "moe_intermediate_size",
       DeepseekRest},
      {Family::kGptOss,
       {"num_local_experts", "num_experts"},
       {"num_experts_per_tok", "experts_per_token"},
       "intermediate_size",
       GptOssRest},
      {Family::kStep3p5, {"moe_num_experts"}, {"moe_top_k"}, "moe_intermediate_size", Step3p5Rest},
  };
  return table;
}

// The first of `keys` the config has (the last if it has none, to be reported missing).
Status IntOfFirst(const Config& c, const std::vector<const char*>& keys, int64_t* v) {
  for (const char* k : keys) {
    if (c.Has(k)) return c.Int(k, v);
  }
  return c.Int(keys.back(), v);
}

// What every family has: the width, the layer count, the activation and the dtype.
Status ParseCommon(const Config& c, ModelSpec* s) {
  int64_t v = 0;
  MOERUN_RETURN_IF_ERROR(c.Int("hidden_size", &v));
  s->hidden = v;
  MOERUN_RETURN_IF_ERROR(c.Int("num_hidden_layers", &v));
  MOERUN_RETURN_IF_ERROR(Positive(c, "num_hidden_layers", v));
  if (v > 100000) return c.Invalid("num_hidden_layers is implausibly large");
  s->num_layers = static_cast<int>(v);
  std::string act;
  MOERUN_RETURN_IF_ERROR(c.StringOr("hidden_act", "silu", &act));
  if (act != "silu" && act != "swish") {
    return Status::Unsupported("hidden_act \"" + act + "\" is not supported (only silu)");
  }
  MOERUN_RETURN_IF_ERROR(c.StringOr("torch_dtype", "", &s->torch_dtype));
  if (s->torch_dtype.empty()) MOERUN_RETURN_IF_ERROR(c.StringOr("dtype", "", &s->torch_dtype));
  return Status::Ok();
}

Status ParseFamily(const Config& c, Family family, ModelSpec* s) {
  MOERUN_RETURN_IF_ERROR(ParseCommon(c, s));
  for (const FamilyKeys& f : FamilyTable()) {
    if (f.family != family) continue;
    int64_t v = 0;
    MOERUN_RETURN_IF_ERROR(IntOfFirst(c, f.experts, &v));
    s->num_experts = Clamped(v);
    MOERUN_RETURN_IF_ERROR(IntOfFirst(c, f.top_k, &v));
    s->top_k = Clamped(v);
    MOERUN_RETURN_IF_ERROR(c.Int(f.expert_inter, &s->expert_inter));
    return f.rest(c, s);
  }
  return Status::Internal("no table row for a model family");
}

}  // namespace

const char* FamilyName(Family f) {
  switch (f) {
    case Family::kMixtral:
      return "mixtral";
    case Family::kQwen2Moe:
      return "qwen2_moe";
    case Family::kQwen3Moe:
      return "qwen3_moe";
    case Family::kDeepseekV3:
      return "deepseek_v3";
    case Family::kGptOss:
      return "gpt_oss";
    case Family::kStep3p5:
      return "step3p5";
  }
  return "?";
}

bool ModelSpec::IsMoeLayer(int layer) const {
  return std::binary_search(moe_layers.begin(), moe_layers.end(), layer);
}

ActParams ModelSpec::RoutedAct(int layer) const {
  ActParams p;
  p.kind = act;
  p.alpha = swiglu_alpha;
  if (act == ActKind::kGptOss) p.limit = swiglu_limit;
  if (act == ActKind::kSwiGluClamped && layer >= 0 &&
      static_cast<size_t>(layer) < swiglu_limits.size()) {
    p.limit = swiglu_limits[static_cast<size_t>(layer)];
  }
  return p;
}

ActParams ModelSpec::SharedAct(int layer) const {
  ActParams p;
  p.kind = act == ActKind::kSwiGluClamped ? ActKind::kSwiGluClamped : ActKind::kSwiGlu;
  if (act == ActKind::kSwiGluClamped && layer >= 0 &&
      static_cast<size_t>(layer) < swiglu_limits_shared.size()) {
    p.limit = swiglu_limits_shared[static_cast<size_t>(layer)];
  }
  return p;
}

std::string ModelSpec::Summary() const {
  std::ostringstream o;
  o << FamilyName(family) << ": " << moe_layers.size() << "/" << num_layers << " MoE layers";
  if (!moe_layers.empty()) {
    const bool contiguous =
        moe_layers.back() - moe_layers.front() + 1 == static_cast<int>(moe_layers.size());
    if (contiguous) {
      o << " (" << moe_layers.front() << ".." << moe_layers.back() << ")";
    } else {
      o << " (";
      for (size_t i = 0; i < moe_layers.size() && i < 8; ++i) o << (i ? "," : "") << moe_layers[i];
      o << (moe_layers.size() > 8 ? ",...)" : ")");
    }
  }
  o << ", " << num_experts << " experts top-" << top_k << ", hidden " << hidden
    << ", expert intermediate " << expert_inter;
  if (shared_inter > 0) o << ", shared " << shared_inter << (shared_gated ? " (gated)" : "");
  o << ", gate " << DescribeGate(gate);
  return o.str();
}

Status ModelSpec::Validate() const {
  const std::string f = FamilyName(family);
  auto bad = [&](const std::string& why) { return Status::InvalidArgument(f + ": " + why); };
  if (hidden <= 0) return bad("hidden size must be positive");
  if (num_experts <= 0) return bad("the expert count must be positive");
  if (num_experts > 65536) return bad("more than 65536 experts is not supported");
  if (top_k <= 0) return bad("top-k must be positive");
  if (top_k > 64) return bad("top-k above 64 is not supported");
  if (top_k > num_experts) {
    return bad("top-k " + std::to_string(top_k) + " is larger than the expert count " +
               std::to_string(num_experts));
  }
  if (expert_inter <= 0) return bad("the expert intermediate size must be positive");
  if (hidden > (1 << 20) || expert_inter > (1 << 22) || shared_inter > (1 << 22)) {
    return bad("sizes are implausibly large");
  }
  if (shared_inter < 0) return bad("the shared expert size must not be negative");
  if (gate.num_experts != num_experts || gate.top_k != top_k) {
    return Status::Internal(f + ": gate spec out of sync");
  }
  if (gate.n_group < 1 || gate.n_group > 256) return bad("n_group must be in 1..256");
  if (num_experts % gate.n_group != 0) {
    return bad("n_group " + std::to_string(gate.n_group) + " does not divide the expert count " +
               std::to_string(num_experts));
  }
  if (gate.topk_group < 1 || gate.topk_group > gate.n_group) {
    return bad("topk_group must be in 1..n_group");
  }
  if (static_cast<int64_t>(gate.topk_group) * (num_experts / gate.n_group) < top_k) {
    return bad("topk_group x experts per group is smaller than top-k");
  }
  for (int l : moe_layers) {
    if (l < 0 || l >= num_layers) return bad("MoE layer " + std::to_string(l) + " out of range");
  }
  return Status::Ok();
}

Result<std::vector<int>> ParseLayerList(const std::string& text, int num_layers) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const auto b = item.find_first_not_of(" \t");
    const auto e = item.find_last_not_of(" \t");
    if (b == std::string::npos) return Status::InvalidArgument("empty entry in \"" + text + "\"");
    item = item.substr(b, e - b + 1);
    if (item.size() > 9 || item.find_first_not_of("0123456789") != std::string::npos) {
      return Status::InvalidArgument("\"" + item + "\" is not a layer number");
    }
    const int layer = std::stoi(item);
    if (layer >= num_layers) {
      return Status::InvalidArgument("layer " + item + " is beyond num_hidden_layers " +
                                     std::to_string(num_layers));
    }
    out.push_back(layer);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

Result<ModelSpec> ParseModelSpec(const std::string& json_text, const std::string& source) {
  const json doc = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Status::Corrupt(source + ": not valid JSON");
  if (!doc.is_object()) return Status::Corrupt(source + ": not a JSON object");
  Config c(doc, source);
  std::string type;
  MOERUN_RETURN_IF_ERROR(c.StringOr("model_type", "", &type));
  ModelSpec s;
  if (type == "mixtral") {
    s.family = Family::kMixtral;
  } else if (type == "qwen2_moe") {
    s.family = Family::kQwen2Moe;
  } else if (type == "qwen3_moe") {
    s.family = Family::kQwen3Moe;
  } else if (type == "deepseek_v3") {
    s.family = Family::kDeepseekV3;
  } else if (type == "gpt_oss") {
    s.family = Family::kGptOss;
  } else if (type == "step3p5") {
    s.family = Family::kStep3p5;
  } else if (type.empty()) {
    return Status::InvalidArgument(source + ": no \"model_type\"");
  } else {
    return Status::Unsupported(source + ": model_type \"" + type +
                               "\" is not supported (mixtral, qwen2_moe, qwen3_moe, deepseek_v3, "
                               "gpt_oss, step3p5)");
  }
  MOERUN_RETURN_IF_ERROR(ParseFamily(c, s.family, &s));
  s.gate.num_experts = s.num_experts;
  s.gate.top_k = s.top_k;
  MOERUN_ASSIGN_OR_RETURN(s.quant, ParseQuantConfig(json_text, source));
  Status v = s.Validate();
  if (!v.ok()) return Status(v.code(), source + ": " + v.message());
  return s;
}

Result<ModelSpec> LoadModelSpec(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(model_dir) / "config.json").string();
  std::error_code ec;
  if (!fs::exists(path, ec)) return Status::NotFound(path + ": no such file");
  const auto size = fs::file_size(path, ec);
  if (ec) return Status::IoError(path + ": " + ec.message());
  if (size > kMaxConfigBytes) return Status::Corrupt(path + ": implausibly large config");
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::IoError(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseModelSpec(ss.str(), path);
}

}  // namespace moerun
