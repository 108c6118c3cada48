// Gate kernels: router logits (fp32, the CPU GEMM's k order) and the gate functions of
// router/gate.h, ported bit for bit (same ExpF, same operation order, no fused multiply-add:
// the build passes --fmad=false), so a token's experts and weights equal the CPU's. The route
// kernel runs a warp per token over registers only (router/cuda/route_warp.h): no stack frame,
// so the driver reserves no local memory for it.
#include <cmath>

#include "base/fast_exp.h"
#include "experts/cuda/kernel_image.cuh"
#include "router/cuda/gate_kernels.h"
#include "router/cuda/route_warp.h"

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

constexpr int kRouteWarps = 4;  // warps (tokens) a block

// A warp per token: expert e in lane e % 32, slot e / 32 of S slots (router/cuda/route_warp.h),
// everything in registers. The grid covers the token bound; warps past *ntok return whole.
template <int S>
__global__ void RouteKernel(RouteArgs a) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouteWarps +
                    static_cast<int64_t>(threadIdx.x) / route_warp::kWarp;
  if (t >= *a.ntok) return;
  const int k = a.g.top_k;
  // The caller's contract (gate_kernels.h): past it the routing would be wrong, so stop loudly.
  if (a.g.num_experts < 1 || a.g.num_experts > S * route_warp::kWarp || k < 1 ||
      k > route_warp::kMaxTopK || k > a.g.num_experts) {
    __trap();
  }
  const route_warp::TokenArgs io{a.logits + t * a.rows, a.gate_bias,        a.selection_bias,
                                 a.shared_gated,        a.present,          a.ids + t * k,
                                 a.weights + t * k,     a.shared_scale + t, a.error_flag};
  route_warp::RouteToken<route_warp::DeviceWarp, S>(a.g, io);
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
  const auto blocks = static_cast<unsigned>((tokens_bound + kRouteWarps - 1) / kRouteWarps);
  const int threads = kRouteWarps * route_warp::kWarp;
  switch (route_warp::SlotsFor(g.num_experts)) {
    case 1:
      RouteKernel<1><<<blocks, threads, 0, s>>>(a);
      break;
    case 2:
      RouteKernel<2><<<blocks, threads, 0, s>>>(a);
      break;
    case 4:
      RouteKernel<4><<<blocks, threads, 0, s>>>(a);
      break;
    case 8:
      RouteKernel<8><<<blocks, threads, 0, s>>>(a);
      break;
    default:
      RouteKernel<16><<<blocks, threads, 0, s>>>(a);
      break;
  }
}

void AppendGateKernelImages(std::vector<KernelImage>& out) {
  // Plain CUDA-core code: the route kernel's warp shuffles (__shfl_sync, __shfl_xor_sync) exist
  // from sm_30, below every architecture CUDA 13 builds (sm_75 and up), so no architecture of
  // their own (0), as the grouping kernels' ballots.
  out.push_back(ImageOf(GateLogitsKernel, "GateLogitsKernel", 0));
  out.push_back(ImageOf(RouteKernel<1>, "RouteKernel<1>", 0));
  out.push_back(ImageOf(RouteKernel<2>, "RouteKernel<2>", 0));
  out.push_back(ImageOf(RouteKernel<4>, "RouteKernel<4>", 0));
  out.push_back(ImageOf(RouteKernel<8>, "RouteKernel<8>", 0));
  out.push_back(ImageOf(RouteKernel<16>, "RouteKernel<16>", 0));
}

}  // namespace moerun::cuda_kernels
