// The grouped expert FFN on CPU: every expert runs once over all the rows routed to it.
//
// Rows arrive grouped by expert (the dispatch plan's order). Work is cut into tasks that each own
// a disjoint block of outputs (a group's rows x a range of output panels) and run on a thread
// pool; every output element is one FMA chain over k in the kernels' fixed order, so the result
// of a row is bitwise the same whatever the other rows, the grouping, the thread count or the
// schedule. Scratch buffers grow to the largest batch seen and are then reused (no allocation
// per batch after warm-up). Not thread-safe: one Run at a time per instance.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "base/aligned_buffer.h"
#include "base/thread_pool.h"
#include "experts/cpu/expert_weights.h"
#include "experts/cpu/kernels.h"

namespace moerun {

struct ExpertGroup {
  const ExpertWeights* weights = nullptr;
  ActParams act;
  int64_t first_row = 0;  // rows [first_row, first_row + rows) of the row list and of y
  int64_t rows = 0;
};

class GroupedFfn {
 public:
  GroupedFfn(const CpuKernels& kernels, ThreadPool* pool);

  // For every group g and row r of it: y[r] = FFN_g(x[row_token[r]]). x has `hidden` columns with
  // row stride ldx; y gets `hidden` columns (and zeros up to the padded width) with row stride
  // ldy >= the padded hidden size (PaddedHidden).
  void Run(std::span<const ExpertGroup> groups, const float* x, int64_t ldx,
           const int32_t* row_token, float* y, int64_t ldy);

  int64_t PaddedHidden(int64_t hidden) const {
    return (hidden + kernels_.nr - 1) / kernels_.nr * kernels_.nr;
  }
  const CpuKernels& kernels() const { return kernels_; }

 private:
  struct Task {
    int32_t group;
    int32_t mblock0, mblocks;  // m-blocks of the group
    int32_t panel0, panels;    // output panels (GEMM1: panel pairs)
  };
  // The packed inputs' layout (apack_off_, hpack_off_, mblock_base_: per group, its m blocks of
  // [k][mr]); returns the m blocks of all groups.
  int64_t LayOutPacks(std::span<const ExpertGroup> groups);
  // Phase 1: every group's rows of x, gathered into apack as [k][mr] tiles.
  void GatherRows(std::span<const ExpertGroup> groups, const float* x, int64_t ldx,
                  const int32_t* row_token, float* apack);
  // Phase 2, one task: gate and up projections with the activation, into hpack (GEMM2's input).
  void GateUpTask(const Task& t, std::span<const ExpertGroup> groups, const float* apack,
                  float* hpack, int worker);
  // Phase 3, one task: the down projection (and its bias) straight into y.
  void DownTask(const Task& t, std::span<const ExpertGroup> groups, const float* hpack, float* y,
                int64_t ldy, int worker);
  void BuildTasks(std::span<const ExpertGroup> groups, bool first_gemm);
  // Visits every (k block, panel, m block) tile of a task; prepare(k0, klen, p) runs before the
  // m blocks of each (k block, panel).
  template <typename Prep, typename Fn>
  void ForEachTile(int64_t k, int64_t kc, int panels, int mblocks, Prep&& prepare, Fn&& fn) const;
  // Whether a task of `mblocks` m blocks (`rows` rows from its first) streams all its panels
  // through one tile_panels call.
  bool StreamsOneBlock(int mblocks, int64_t rows, int64_t k) const;
  // The worker's buffer for decoded panel blocks, or null where tiles decode codes themselves.
  float* DecodeBuffer(const PackedMatrix& m, int mblocks, int worker);
  void RunTile(const PackedMatrix& m, const float* dq, int rows, int64_t klen, const float* a,
               int64_t panel, int64_t k0, float* c, int64_t ldc) const;

  const CpuKernels& kernels_;
  ThreadPool* pool_;
  std::vector<int64_t> apack_off_, hpack_off_, mblock_base_;
  std::vector<Task> tasks_;
  AlignedBuffer apack_, hpack_;
  std::vector<AlignedBuffer> scratch_;  // one per worker
  std::vector<AlignedBuffer> decoded_;  // one per worker: a decoded panel block
};

}  // namespace moerun
