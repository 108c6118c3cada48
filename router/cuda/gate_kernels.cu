// Gate kernels: router logits (fp32, the CPU GEMM's k order) and the gate functions of
// router/gate.h, ported bit for bit (same ExpF, same operation order, no fused multiply-add:
// the build passes --fmad=false), so a token's experts and weights equal the CPU's.
#include <cmath>

#include "base/fast_exp.h"
#include "router/cuda/gate_kernels.h"
#include "router/cuda/route_token.h"

namespace moerun::cuda_kernels {
namespace {

constexpr int kTile = 32;

__global__ void GateLogitsKernel(const float* __restrict__ x, const float* __restrict__ gate,
                                 int64_t hidden, int rows, float* __restrict__ logits,
                                 const int32_t* ntok) {
  const int64_t tokens = *ntok;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kTile;
  if (t0 >= tokens) return;
  const int r0 = static_cast<int>(blockIdx.y) * kTile;
  __shared__ float xs[kTile][kTile + 1];  // [k][token]
  __shared__ float ws[kTile][kTile + 1];  // [k][gate row]
  const int tx = threadIdx.x, ty = threadIdx.y;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t k0 = 0; k0 < hidden; k0 += kTile) {
    for (int i = ty * kTile + tx; i < kTile * kTile; i += kTile * 8) {
      const int a = i / kTile, kk = i % kTile;
      const int64_t k = k0 + kk;
      xs[kk][a] = (t0 + a < tokens && k < hidden) ? x[(t0 + a) * hidden + k] : 0.0f;
      ws[kk][a] =
          (r0 + a < rows && k < hidden) ? gate[static_cast<int64_t>(r0 + a) * hidden + k] : 0.0f;
    }
    __syncthreads();
    const int kn = hidden - k0 < kTile ? static_cast<int>(hidden - k0) : kTile;
    for (int kk = 0; kk < kn; ++kk) {
      const float w = ws[kk][tx];
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = fmaf(xs[kk][ty + 8 * i], w, acc[i]);
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i) {
    const int64_t t = t0 + ty + 8 * i;
    if (t < tokens && r0 + tx < rows) logits[t * rows + r0 + tx] = acc[i];
  }
}

struct RouteArgs {
  GateSpec g;
  const float* logits;
  int rows;
  const float* gate_bias;
  const float* selection_bias;
  bool shared_gated;
  const uint8_t* present;
  int32_t* ids;
  float* weights;
  float* shared_scale;
  int32_t* error_flag;
  const int32_t* ntok;
};

__global__ void RouteKernel(RouteArgs a) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= *a.ntok) return;
  const GateSpec& g = a.g;
  const int n = g.num_experts, k = g.top_k;
  float logit[route_token::kMaxExperts], probs[route_token::kMaxExperts];
  int32_t order[route_token::kMaxExperts];
  uint32_t taken[route_token::kMaxExperts / 32];
  const float* row = a.logits + t * a.rows;
  for (int i = 0; i < n; ++i) logit[i] = a.gate_bias ? row[i] + a.gate_bias[i] : row[i];
  int32_t* ids = a.ids + t * k;
  route_token::Route(g, logit, a.selection_bias, route_token::Scratch{probs, order, taken}, ids,
                     a.weights + t * k);
  for (int i = 0; i < k; ++i) {
    if (!a.present[ids[i]]) atomicMax(a.error_flag, ids[i] + 1);
  }
  a.shared_scale[t] = a.shared_gated ? SigmoidF(row[n]) : 1.0f;
}

}  // namespace

void LaunchGateLogits(const float* x, const float* gate, int64_t tokens_bound, int64_t hidden,
                      int gate_rows, float* logits, const int32_t* ntok, cudaStream_t s) {
  const dim3 grid(static_cast<unsigned>((tokens_bound + kTile - 1) / kTile),
                  static_cast<unsigned>((gate_rows + kTile - 1) / kTile));
  GateLogitsKernel<<<grid, dim3(kTile, 8), 0, s>>>(x, gate, hidden, gate_rows, logits, ntok);
}

void LaunchRoute(const GateSpec& g, const float* logits, int gate_rows, const float* gate_bias,
                 const float* selection_bias, bool shared_gated, const uint8_t* present,
                 int64_t tokens_bound, int32_t* ids, float* weights, float* shared_scale,
                 int32_t* error_flag, const int32_t* ntok, cudaStream_t s) {
  RouteArgs a{g,       logits, gate_rows, gate_bias,    selection_bias, shared_gated,
              present, ids,    weights,   shared_scale, error_flag,     ntok};
  const int threads = 64;
  RouteKernel<<<static_cast<unsigned>((tokens_bound + threads - 1) / threads), threads, 0, s>>>(a);
}

}  // namespace moerun::cuda_kernels
