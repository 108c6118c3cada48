// The gate on the device: router logits and the gate function per token, bit for bit as the
// CPU gate (router/gate.h, router/gating.h). Launchers of router/cuda/gate_kernels.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "experts/cuda/kernel_image.h"
#include "router/gate.h"

namespace moerun::cuda_kernels {

// logits[t][r] = fma chain over h (in order) of x[t][h] * gate[r][h], r < gate_rows: the CPU
// GEMM's contract, so the logits are bitwise the CPU's.
void LaunchGateLogits(const float* x, const float* gate, int64_t tokens_bound, int64_t hidden,
                      int gate_rows, float* logits, const int32_t* ntok, cudaStream_t s);
// The gate function per token (router/gate.h semantics, bit for bit), the shared-expert scale,
// and a flag set when a token is routed to an expert that is not loaded (present[e] == 0): the
// largest such id + 1. A warp per token (router/cuda/route_warp.h), registers only. Needs
// 1 <= num_experts <= 512 and 1 <= top_k <= min(64, num_experts), which the caller checks
// (outside that the kernel traps: an error at the next synchronisation, never wrong routing).
void LaunchRoute(const GateSpec& g, const float* logits, int gate_rows, const float* gate_bias,
                 const float* selection_bias, bool shared_gated, const uint8_t* present,
                 int64_t tokens_bound, int32_t* ids, float* weights, float* shared_scale,
                 int32_t* error_flag, const int32_t* ntok, cudaStream_t s);

// Appends the image of every kernel above, as the current device would run it (kernel_image.h).
void AppendGateKernelImages(std::vector<KernelImage>& out);

}  // namespace moerun::cuda_kernels
