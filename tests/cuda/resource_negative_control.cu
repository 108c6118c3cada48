// The negative control of scripts/check_cuda_resources.py: a kernel whose array is indexed by a
// value known only at run time, so it must live in local memory (a stack frame). Built only by
// that test, never part of a library.
#include <cstdint>

__global__ void ResourceNegativeControlKernel(const int32_t* index, const float* in, float* out) {
  float local[256];
  for (int i = 0; i < 256; ++i) local[i] = in[i * blockDim.x + threadIdx.x];
  out[threadIdx.x] = local[index[threadIdx.x] & 255];
}
