// Dense C = A B^T for the router gate (and any other small dense projection), on the same
// batch-invariant tiles as the expert FFN: each C element is one FMA chain over k in order.
// Reuses the caller's packing buffer (no allocation once it is large enough). The pool runs
// row blocks in parallel; call from one thread at a time per `apack` buffer.
#pragma once

#include <cstdint>

#include "base/aligned_buffer.h"
#include "base/thread_pool.h"
#include "experts/cpu/kernels.h"
#include "experts/cpu/packed_matrix.h"

namespace moerun {

// A [m][b.k()] row-major (stride lda) -> C [m][b.n_padded()] (stride ldc >= b.n_padded()).
void GemmPacked(const CpuKernels& kernels, ThreadPool* pool, int64_t m, const float* a, int64_t lda,
                const PackedMatrix& b, float* c, int64_t ldc, AlignedBuffer* apack);

}  // namespace moerun
