// The CUDA backend's layer factories (cuda_backend.h; cuda_backend.cc forwards the public ones
// here): the whole layer (its own context of the whole-layer plan), an expert rank's layer (into
// the rank's context) and a preset's layer generated on the device.
#include <utility>

#include "runtime/layer/cuda/cuda_backend.h"
#include "runtime/layer/cuda/cuda_layer_impl.h"

namespace moerun {
namespace {

using cuda_impl::ContextImpl;
using cuda_impl::CudaLayerImpl;
using cuda_impl::MakeContext;
using cuda_plan::WeightFormat;

Result<WeightFormat> ChooseFormat(DType source, const CudaLayerOptions& opts) {
  return cuda_plan::ChooseWeightFormat(source, opts.math == CudaMath::kTensorCore, opts.mma_type);
}

// The whole layer's memory plan, from what the process loaded (or will generate).
Result<cuda_plan::RankMemoryPlan> WholeLayerPlan(const MoeLayerWeights& w, int loaded,
                                                 bool expert_bias, WeightFormat format,
                                                 const CudaLayerOptions& opts) {
  const ModelSpec& s = w.spec;
  cuda_plan::RankMemoryInput in;
  in.role = cuda_plan::DeviceRole::kWholeLayer;
  in.hidden = s.hidden;
  in.expert_inter = s.expert_inter;
  in.shared_inter = w.shared ? w.shared->inter : 0;
  in.top_k = s.top_k;
  in.experts = s.num_experts;
  in.gate_rows = s.num_experts + (s.shared_gated ? 1 : 0);
  in.expert_bias = expert_bias;
  in.gate_bias = !w.gate_bias.empty();
  in.selection_bias = !w.selection_bias.empty();
  in.layers = {cuda_plan::HostedLayer{w.layer, loaded, loaded}};
  in.format = format;
  in.tensor_cores = opts.math == CudaMath::kTensorCore;
  in.max_tokens = opts.max_tokens;
  in.graph_max_tokens = opts.graph_max_tokens;
  return cuda_plan::PlanRankMemory(in);
}

}  // namespace

Result<std::unique_ptr<CudaMoeLayer>> cuda_backend::Upload(const MoeLayerWeights& w,
                                                           const CudaLayerOptions& opts) {
  MOERUN_ASSIGN_OR_RETURN(const WeightFormat format, ChooseFormat(w.dtype, opts));
  int loaded = 0;
  bool bias = false;
  for (const auto& e : w.experts) {
    loaded += !e.w13.empty();
    bias = bias || !e.bias_gate.empty() || !e.bias_down.empty();
  }
  MOERUN_ASSIGN_OR_RETURN(auto plan, WholeLayerPlan(w, loaded, bias, format, opts));
  MOERUN_ASSIGN_OR_RETURN(auto ctx, MakeContext(opts, std::move(plan)));
  auto layer = std::make_unique<CudaLayerImpl>(w.spec, w.layer, std::move(ctx), format);
  MOERUN_RETURN_IF_ERROR(layer->Init(w.shared.has_value(), w.shared ? w.shared->inter : 0));
  MOERUN_RETURN_IF_ERROR(layer->UploadGate(w));
  const ActParams act = w.spec.RoutedAct(w.layer);
  for (size_t e = 0; e < w.experts.size(); ++e) {
    if (w.experts[e].w13.empty()) continue;  // not hosted here: routing to it is an error
    MOERUN_RETURN_IF_ERROR(layer->UploadExpert(static_cast<int>(e), w.experts[e], act));
  }
  if (w.shared) {
    MOERUN_RETURN_IF_ERROR(
        layer->UploadExpert(w.spec.num_experts, *w.shared, w.spec.SharedAct(w.layer)));
  }
  MOERUN_RETURN_IF_ERROR(layer->Finish());
  return std::unique_ptr<CudaMoeLayer>(std::move(layer));
}

Result<std::unique_ptr<CudaMoeLayer>> cuda_backend::UploadTo(const MoeLayerWeights& w,
                                                             std::shared_ptr<CudaRankContext> ctx) {
  auto impl = std::dynamic_pointer_cast<ContextImpl>(ctx);
  if (impl == nullptr || impl->plan().role != cuda_plan::DeviceRole::kExpertRank) {
    return Status::InvalidArgument("CUDA layer: Upload into a context needs an expert rank's");
  }
  MOERUN_ASSIGN_OR_RETURN(const WeightFormat format, ChooseFormat(w.dtype, impl->options()));
  auto layer = std::make_unique<CudaLayerImpl>(w.spec, w.layer, std::move(impl), format);
  // The shared expert runs on the router in expert parallelism: not here.
  MOERUN_RETURN_IF_ERROR(layer->Init(false, 0));
  const ActParams act = w.spec.RoutedAct(w.layer);
  for (size_t e = 0; e < w.experts.size(); ++e) {
    if (w.experts[e].w13.empty()) continue;
    MOERUN_RETURN_IF_ERROR(layer->UploadExpert(static_cast<int>(e), w.experts[e], act));
  }
  MOERUN_RETURN_IF_ERROR(layer->Finish());
  return std::unique_ptr<CudaMoeLayer>(std::move(layer));
}

Result<std::unique_ptr<CudaMoeLayer>> cuda_backend::FromPreset(const ModelSpec& spec,
                                                               const PresetOptions& preset,
                                                               const CudaLayerOptions& opts) {
  MOERUN_ASSIGN_OR_RETURN(const WeightFormat format, ChooseFormat(preset.dtype, opts));
  if (!preset.load_expert.empty() &&
      preset.load_expert.size() != static_cast<size_t>(spec.num_experts)) {
    return Status::InvalidArgument("expert mask size does not match the expert count");
  }
  if (cuda_plan::IsQuantized(format)) {
    // Block-scaled presets come from the host's deterministic quantization
    // (runtime/model/preset.cc), then go up quantized: the device does not re-derive the rounding.
    MOERUN_ASSIGN_OR_RETURN(const MoeLayerWeights w,
                            BuildPresetLayer(spec, KernelsFor(Isa::kScalar), preset));
    return Upload(w, opts);
  }
  // The host builds the small parts (gate, biases, the shared expert); experts come from the GPU.
  PresetOptions host = preset;
  host.load_expert.assign(static_cast<size_t>(spec.num_experts), false);
  host.progress = nullptr;
  MOERUN_ASSIGN_OR_RETURN(MoeLayerWeights w,
                          BuildPresetLayer(spec, KernelsFor(Isa::kScalar), host));
  int todo = 0, done = 0;
  for (int e = 0; e < spec.num_experts; ++e) {
    todo += preset.load_expert.empty() || preset.load_expert[static_cast<size_t>(e)];
  }
  MOERUN_ASSIGN_OR_RETURN(auto plan, WholeLayerPlan(w, todo, spec.expert_bias, format, opts));
  MOERUN_ASSIGN_OR_RETURN(auto ctx, MakeContext(opts, std::move(plan)));
  auto layer = std::make_unique<CudaLayerImpl>(spec, w.layer, std::move(ctx), format);
  MOERUN_RETURN_IF_ERROR(layer->Init(w.shared.has_value(), w.shared ? w.shared->inter : 0));
  MOERUN_RETURN_IF_ERROR(layer->UploadGate(w));
  for (int e = 0; e < spec.num_experts; ++e) {
    if (!preset.load_expert.empty() && !preset.load_expert[static_cast<size_t>(e)]) continue;
    MOERUN_RETURN_IF_ERROR(layer->GenerateExpert(preset, e));
    ++done;
    if (preset.progress) preset.progress(done, todo, layer->weight_bytes());
  }
  if (w.shared) {
    MOERUN_RETURN_IF_ERROR(
        layer->UploadExpert(spec.num_experts, *w.shared, spec.SharedAct(w.layer)));
  }
  MOERUN_RETURN_IF_ERROR(layer->Finish());
  return std::unique_ptr<CudaMoeLayer>(std::move(layer));
}

}  // namespace moerun
