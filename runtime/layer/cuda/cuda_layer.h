// One MoE layer on one CUDA GPU: gate (fp32) -> top-k -> group rows by expert -> grouped expert
// FFN -> weighted combine in the fixed k order. Plain C++ interface: no CUDA type appears here, so
// callers build whether or not this build has CUDA (without it, Create returns Unsupported).
//
// Two kinds of math for the expert FFN:
//   kExact       fp32 on CUDA cores, one fused multiply-add chain per output in k order, weights
//                widened exactly from their type: the same contract as the CPU kernels, so the
//                output is bitwise the CPU backend's (the reference-fixture path).
//   kTensorCore  bf16 or f16 inputs and weights on tensor cores (mma 16x16x16), fp32 accumulation;
//                the hidden activations are rounded to the input type. Within 1e-2 of the CPU.
// Block-scaled expert weights (FP8 e4m3 with 128 x 128 block scales, MXFP4 e2m1 with e8m0 scales
// per 32 inputs) stay quantized on the device, about 1 and 0.53 bytes a weight, and the GEMMs
// decode them in their loads (runtime/layer/cuda/device_weights.h, experts/cuda/quant_layout.h).
// kExact applies each scale to its block's fp32 sum, as the CPU kernels do: bitwise the CPU again.
// kTensorCore takes FP8 on bf16 or f16 (codes exact in both, one scale per 64 x 128 tile block
// applied to fp32 accumulators) and MXFP4 on bf16 only (f16 cannot hold e8m0 scales: Upload says
// so). Both are batch-invariant (deterministic mode is the only mode): every output element is
// reduced in the same order whatever the batch (no split-K, no atomics on outputs, tile shapes
// fixed), so outputs are bitwise equal across batchings, ranks and placements on the same GPU type.
//
// Memory: weights are uploaded once; every per-batch buffer comes from the arena of a rank's ONE
// device context (CudaRankContext: a stream, events, the arena laid out by the rank's memory plan
// (runtime/layer/cuda/device_plan.h PlanRankMemory), page-locked staging tables and the CUDA
// graphs), shared by every layer the rank holds; nothing is allocated per batch. Two roles:
//   - the whole layer (Upload / FromPreset without a context: `moerun forward --device cuda` in
//     one process): the layer makes its own context of the whole-layer plan. The gate, routing
//     and grouping stay on the device (no host round trip inside a forward), so a whole forward
//     can be captured as a CUDA graph; one graph per token-count bucket (powers of two up to
//     `graph_max_tokens`) is captured on first use and replayed with the batch's real token count
//     read from device memory.
//   - an expert rank (Upload with the rank's context of an expert plan): the layer holds its
//     experts' weights and their group descriptors only; RunExperts uses the context's arena
//     (sized for the largest microbatch of the plan, the same for every layer). Forward,
//     LastRouting and Time are refused (no gate).
// Quantized weights (FP8, MXFP4) on tensor cores always decode to bf16, whatever mma_type says
// (f16 activations overflow past 65504; with f16 rows of plain f16 weights a set overflow flag
// turns into an error after the batch).
// Thread-safety: one call at a time per context (it owns one stream): all layers of a context
// are used by one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "runtime/layer/cuda/device_plan.h"
#include "runtime/model/layer_weights.h"
#include "runtime/model/preset.h"

namespace moerun {

enum class CudaMath { kExact, kTensorCore };
const char* CudaMathName(CudaMath m);

struct CudaLayerOptions {
  int device = 0;  // CUDA device ordinal (see launch/local_device.h)
  CudaMath math = CudaMath::kTensorCore;
  DType mma_type = DType::kBF16;   // kTensorCore: kBF16 or kF16
  int64_t max_tokens = 8192;       // the arena's size; Forward rejects larger batches
  int64_t graph_max_tokens = 256;  // 0: no CUDA graphs
};

// The device state of one rank, shared by all its layers: made once from the rank's memory plan
// (the arena is exactly plan.arena; the kernel images are checked for the device once here).
class CudaRankContext {
 public:
  // opts: the device, math and max_tokens (graph_max_tokens for the whole layer); `plan` must be
  // of role kExpertRank or kWholeLayer and planned for the same math.
  static Result<std::shared_ptr<CudaRankContext>> Create(const CudaLayerOptions& opts,
                                                         const cuda_plan::RankMemoryPlan& plan);
  virtual ~CudaRankContext() = default;
  // Page-locks host memory the rank copies rows from and to (cudaHostRegister), so that the
  // copies run asynchronously on the context's stream; Unpin before that memory is freed.
  virtual Status PinHost(void* p, size_t bytes) = 0;
  virtual void UnpinHost(void* p) = 0;
  virtual const cuda_plan::RankMemoryPlan& plan() const = 0;
  virtual const CudaLayerOptions& options() const = 0;
  virtual std::string Describe() const = 0;  // "H200 (sm_90, device 0), arena 3.1 GB, ..."
};

// Device-side timings of repeated forwards of one batch (CUDA events around each).
struct CudaTimes {
  std::vector<double> ms;  // one per repetition
  double median_ms = 0, min_ms = 0;
};

class CudaMoeLayer {
 public:
  // Copies the layer's weights (any CPU packing and type) to the device. Every expert must be
  // loaded. kTensorCore converts f32 weights to `mma_type`; no other conversion happens (FP8 and
  // MXFP4 go up as codes and scales; an expert of another type than the layer's is an error).
  static Result<std::unique_ptr<CudaMoeLayer>> Upload(const MoeLayerWeights& w,
                                                      const CudaLayerOptions& opts);
  // An expert rank's layer: its experts' weights and descriptors, computing in `ctx` (whose
  // options it takes; the layer must fit the context's plan: hidden, expert size, slots).
  static Result<std::unique_ptr<CudaMoeLayer>> Upload(const MoeLayerWeights& w,
                                                      std::shared_ptr<CudaRankContext> ctx);
  // A preset's layer generated on the device: the same values as BuildPresetLayer(spec, opts)
  // without building it on the host (full-size models: DeepSeek-V3's 256 experts are 22 GB).
  // Block-scaled presets (FP8, MXFP4) are built by BuildPresetLayer on the host, then uploaded.
  static Result<std::unique_ptr<CudaMoeLayer>> FromPreset(const ModelSpec& spec,
                                                          const PresetOptions& preset,
                                                          const CudaLayerOptions& opts);
  virtual ~CudaMoeLayer() = default;

  // x [tokens][hidden] -> out [tokens][hidden], host memory, synchronous.
  virtual Status Forward(const float* x, int64_t tokens, float* out) = 0;
  // The routing of the last forward (copied back on demand): [tokens * k] each.
  virtual Status LastRouting(std::vector<int32_t>* ids, std::vector<float>* weights) = 0;

  // Benchmarks: uploads x once, then times `reps` device-only forwards (no copies), after
  // `warmup` untimed ones.
  virtual Result<CudaTimes> Time(const float* x, int64_t tokens, int warmup, int reps) = 0;

  // Expert ranks: the grouped FFN alone, on rows already grouped by the dispatch plan.
  // rows [total][hidden] (host), group_expert[g] the local expert index (-1: shared expert),
  // group_rows[g] its row count; y [total][hidden] (host).
  virtual Status RunExperts(const float* rows, const std::vector<int32_t>& group_expert,
                            const std::vector<int64_t>& group_rows, float* y) = 0;

  virtual const ModelSpec& spec() const = 0;
  virtual std::string Describe() const = 0;  // "H200 (sm_90), tensor-core bf16, 3.2 GB weights"
  virtual size_t weight_bytes() const = 0;   // on the device: experts (values or codes + scales)
  virtual int64_t graphs_captured() const = 0;
};

}  // namespace moerun
