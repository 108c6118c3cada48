// MOERUN_HD marks plain functions that CUDA code also calls on the device (the gate math, the
// activation, preset weights), so that one definition serves both and the bits agree.
#pragma once

#if defined(__CUDACC__)
#define MOERUN_HD __host__ __device__
#else
#define MOERUN_HD
#endif
