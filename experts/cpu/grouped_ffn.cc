#include "experts/cpu/grouped_ffn.h"

#include <algorithm>

namespace moerun {
namespace {

constexpr int kMBlocksPerTask = 16;              // rows per task: 16 tiles (keeps a task's A in L2)
constexpr int kColumnsPerTask = 256;             // output columns per task
constexpr int64_t kStreamMaxABytes = 256 << 10;  // tasks whose A fits in this stream panels
// One m block of at most kStreamWideMaxRows rows (the heights tile_panels keeps several panels'
// sums in flight for) streams all of a task's panels through tile_panels while its A (mr rows x
// k, read in k order beside the weights) is at most this: an AVX-512 tile of 12 rows at
// DeepSeek-V3's hidden 7168 is 344 KiB, and blocking it by k instead would leave one panel's two
// FMA chains per call (FP8 at 1 token: 27 -> 16.5 ms a layer on Zen 4). Taller blocks are
// blocked by k past kStreamMaxABytes, so that a k block of A stays in L1 across the panels (8
// rows at hidden 7168 streamed: FP8 3x slower).
constexpr int64_t kStreamOneBlockMaxABytes = 1 << 20;
constexpr int64_t kStreamWideMaxRows = 4;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

// Visits every (k block, panel, m block) tile of a task. Few rows (their A fits in L2): each
// panel is streamed front to back over all of k (one long sequential read of the weights, which
// is what bounds small batches). Many rows: k blocks outermost, so a panel's k block stays in L1
// across the m blocks. The order changes no result: each tile accumulates its k blocks in order
// either way.
template <typename Prep, typename Fn>
void GroupedFfn::ForEachTile(int64_t k, int64_t kc, int panels, int mblocks, Prep&& prepare,
                             Fn&& fn) const {
  auto panel_block = [&](int64_t k0, int p) {
    const int64_t klen = std::min(kc, k - k0);
    prepare(k0, klen, p);
    for (int mb = 0; mb < mblocks; ++mb) fn(k0, klen, p, mb);
  };
  if (static_cast<int64_t>(mblocks) * kernels_.mr * k * 4 <= kStreamMaxABytes) {
    for (int p = 0; p < panels; ++p) {
      for (int64_t k0 = 0; k0 < k; k0 += kc) panel_block(k0, p);
    }
    return;
  }
  for (int64_t k0 = 0; k0 < k; k0 += kc) {
    for (int p = 0; p < panels; ++p) panel_block(k0, p);
  }
}

// One m block whose A fits in L2: all of a task's panels over all of k in one tile_panels call
// (several panels' sums in flight; the same bits as tile by tile).
bool GroupedFfn::StreamsOneBlock(int mblocks, int64_t rows, int64_t k) const {
  const int64_t a_bytes = static_cast<int64_t>(kernels_.mr) * k * 4;
  return mblocks == 1 && (a_bytes <= kStreamMaxABytes ||
                          (rows <= kStreamWideMaxRows && a_bytes <= kStreamOneBlockMaxABytes));
}

GroupedFfn::GroupedFfn(const CpuKernels& kernels, ThreadPool* pool)
    : kernels_(kernels),
      pool_(pool),
      scratch_(static_cast<size_t>(pool->size())),
      decoded_(static_cast<size_t>(pool->size())) {}

float* GroupedFfn::DecodeBuffer(const PackedMatrix& m, int mblocks, int worker) {
  // Block-scaled weights over several m blocks: each panel block is decoded once to floats and
  // read by every m block (the same bits as decoding in every tile).
  if (!m.block_scaled() || mblocks < 2) return nullptr;
  AlignedBuffer& buf = decoded_[static_cast<size_t>(worker)];
  buf.Reserve(static_cast<size_t>(KcFor(kernels_, m.dtype()) * kernels_.nr) * sizeof(float));
  return buf.as<float>();
}

void GroupedFfn::RunTile(const PackedMatrix& m, const float* dq, int rows, int64_t klen,
                         const float* a, int64_t panel, int64_t k0, float* c, int64_t ldc) const {
  if (dq != nullptr) {
    kernels_.tile_decoded(rows, klen, a, dq, m.PanelAt(panel, k0), m.dtype(), c, ldc, k0 > 0);
  } else {
    kernels_.tile(rows, klen, a, m.PanelAt(panel, k0), m.dtype(), c, ldc, k0 > 0);
  }
}

void GroupedFfn::BuildTasks(std::span<const ExpertGroup> groups, bool first_gemm) {
  tasks_.clear();
  const int nr = kernels_.nr;
  const int per_task = std::max(1, kColumnsPerTask / (first_gemm ? 2 * nr : nr));
  for (size_t g = 0; g < groups.size(); ++g) {
    const ExpertGroup& grp = groups[g];
    if (grp.rows == 0) continue;
    const int64_t mblocks = CeilDiv(grp.rows, kernels_.mr);
    const int64_t units = first_gemm ? grp.weights->pairs : grp.weights->w2.panels();
    for (int64_t m0 = 0; m0 < mblocks; m0 += kMBlocksPerTask) {
      for (int64_t p0 = 0; p0 < units; p0 += per_task) {
        tasks_.push_back(
            Task{static_cast<int32_t>(g), static_cast<int32_t>(m0),
                 static_cast<int32_t>(std::min<int64_t>(kMBlocksPerTask, mblocks - m0)),
                 static_cast<int32_t>(p0),
                 static_cast<int32_t>(std::min<int64_t>(per_task, units - p0))});
      }
    }
  }
}

int64_t GroupedFfn::LayOutPacks(std::span<const ExpertGroup> groups) {
  const int mr = kernels_.mr;
  const size_t ng = groups.size();
  apack_off_.assign(ng + 1, 0);
  hpack_off_.assign(ng + 1, 0);
  mblock_base_.assign(ng + 1, 0);
  for (size_t g = 0; g < ng; ++g) {
    const int64_t mblocks = CeilDiv(groups[g].rows, mr);
    const int64_t hidden = groups[g].rows ? groups[g].weights->hidden : 0;
    const int64_t inter = groups[g].rows ? groups[g].weights->inter : 0;
    apack_off_[g + 1] = apack_off_[g] + mblocks * hidden * mr;
    hpack_off_[g + 1] = hpack_off_[g] + mblocks * inter * mr;
    mblock_base_[g + 1] = mblock_base_[g] + mblocks;
  }
  return mblock_base_[ng];
}

void GroupedFfn::GatherRows(std::span<const ExpertGroup> groups, const float* x, int64_t ldx,
                            const int32_t* row_token, float* apack) {
  const int mr = kernels_.mr;
  pool_->ParallelFor(mblock_base_.back(), [&](int64_t t, int) {
    const size_t g = static_cast<size_t>(
        std::upper_bound(mblock_base_.begin(), mblock_base_.end(), t) - mblock_base_.begin() - 1);
    const ExpertGroup& grp = groups[g];
    const int64_t mb = t - mblock_base_[g];
    const int64_t hidden = grp.weights->hidden;
    float* dst = apack + apack_off_[g] + mb * hidden * mr;
    const int64_t r0 = mb * mr;
    const int rows = static_cast<int>(std::min<int64_t>(mr, grp.rows - r0));
    for (int i = 0; i < rows; ++i) {
      const float* src = x + static_cast<int64_t>(row_token[grp.first_row + r0 + i]) * ldx;
      for (int64_t k = 0; k < hidden; ++k) dst[k * mr + i] = src[k];
    }
  });
}

void GroupedFfn::GateUpTask(const Task& t, std::span<const ExpertGroup> groups, const float* apack,
                            float* hpack, int worker) {
  const int mr = kernels_.mr;
  const int nr = kernels_.nr;
  const ExpertGroup& grp = groups[static_cast<size_t>(t.group)];
  const ExpertWeights& w = *grp.weights;
  const int64_t hidden = w.hidden;
  const int64_t ldc = 2 * static_cast<int64_t>(t.panels) * nr;
  AlignedBuffer& scratch = scratch_[static_cast<size_t>(worker)];
  scratch.Reserve(static_cast<size_t>(kMBlocksPerTask) * mr * ldc * sizeof(float));
  float* c = scratch.as<float>();
  const float* a = apack + apack_off_[static_cast<size_t>(t.group)];
  float* dq = DecodeBuffer(w.w13, t.mblocks, worker);
  if (StreamsOneBlock(t.mblocks, grp.rows - int64_t{t.mblock0} * mr, hidden)) {
    const int rows = static_cast<int>(std::min<int64_t>(mr, grp.rows - t.mblock0 * mr));
    kernels_.tile_panels(rows, 2 * t.panels, hidden, a + t.mblock0 * hidden * mr,
                         w.w13.panel(2 * t.panel0), w.w13.panel_bytes(), w.w13.dtype(), c, ldc,
                         false);
  } else {
    ForEachTile(
        hidden, KcFor(kernels_, w.w13.dtype()), 2 * t.panels, t.mblocks,
        [&](int64_t k0, int64_t klen, int p) {
          if (dq) kernels_.decode(klen, w.w13.PanelAt(2 * t.panel0 + p, k0), w.w13.dtype(), dq);
        },
        [&](int64_t k0, int64_t klen, int p, int mb) {
          const int64_t gmb = t.mblock0 + mb;
          const int rows = static_cast<int>(std::min<int64_t>(mr, grp.rows - gmb * mr));
          RunTile(w.w13, dq, rows, klen, a + (gmb * hidden + k0) * mr, 2 * t.panel0 + p, k0,
                  c + static_cast<int64_t>(mb) * mr * ldc + p * nr, ldc);
        });
  }
  float* h = hpack + hpack_off_[static_cast<size_t>(t.group)];
  const int64_t j0 = static_cast<int64_t>(t.panel0) * nr;
  for (int mb = 0; mb < t.mblocks; ++mb) {
    const int64_t gmb = t.mblock0 + mb;
    const int rows = static_cast<int>(std::min<int64_t>(mr, grp.rows - gmb * mr));
    kernels_.activate(grp.act, rows, t.panels, nr, c + static_cast<int64_t>(mb) * mr * ldc, ldc,
                      w.bias_gate.empty() ? nullptr : w.bias_gate.data(),
                      w.bias_up.empty() ? nullptr : w.bias_up.data(), j0, w.inter,
                      h + gmb * w.inter * mr, mr);
  }
}

void GroupedFfn::DownTask(const Task& t, std::span<const ExpertGroup> groups, const float* hpack,
                          float* y, int64_t ldy, int worker) {
  const int mr = kernels_.mr;
  const int nr = kernels_.nr;
  const ExpertGroup& grp = groups[static_cast<size_t>(t.group)];
  const ExpertWeights& w = *grp.weights;
  const int64_t inter = w.inter;
  const float* a = hpack + hpack_off_[static_cast<size_t>(t.group)];
  float* ybase = y + grp.first_row * ldy;
  float* dq = DecodeBuffer(w.w2, t.mblocks, worker);
  if (StreamsOneBlock(t.mblocks, grp.rows - int64_t{t.mblock0} * mr, inter)) {
    const int64_t r0 = static_cast<int64_t>(t.mblock0) * mr;
    const int rows = static_cast<int>(std::min<int64_t>(mr, grp.rows - r0));
    kernels_.tile_panels(rows, t.panels, inter, a + r0 * inter, w.w2.panel(t.panel0),
                         w.w2.panel_bytes(), w.w2.dtype(), ybase + r0 * ldy + t.panel0 * nr, ldy,
                         false);
  } else {
    ForEachTile(
        inter, KcFor(kernels_, w.w2.dtype()), t.panels, t.mblocks,
        [&](int64_t k0, int64_t klen, int p) {
          if (dq) kernels_.decode(klen, w.w2.PanelAt(t.panel0 + p, k0), w.w2.dtype(), dq);
        },
        [&](int64_t k0, int64_t klen, int p, int mb) {
          const int64_t panel = t.panel0 + p;
          const int64_t gmb = t.mblock0 + mb;
          const int rows = static_cast<int>(std::min<int64_t>(mr, grp.rows - gmb * mr));
          RunTile(w.w2, dq, rows, klen, a + (gmb * inter + k0) * mr, panel, k0,
                  ybase + gmb * mr * ldy + panel * nr, ldy);
        });
  }
  if (!w.bias_down.empty()) {
    const int64_t col0 = static_cast<int64_t>(t.panel0) * nr;
    const int64_t r0 = static_cast<int64_t>(t.mblock0) * mr;
    const int rows = static_cast<int>(std::min<int64_t>(grp.rows - r0, t.mblocks * mr));
    kernels_.add_bias(rows, static_cast<int64_t>(t.panels) * nr, w.bias_down.data() + col0,
                      ybase + r0 * ldy + col0, ldy);
  }
}

void GroupedFfn::Run(std::span<const ExpertGroup> groups, const float* x, int64_t ldx,
                     const int32_t* row_token, float* y, int64_t ldy) {
  if (LayOutPacks(groups) == 0) return;
  apack_.Reserve(static_cast<size_t>(apack_off_.back()) * sizeof(float));
  hpack_.Reserve(static_cast<size_t>(hpack_off_.back()) * sizeof(float));
  float* apack = apack_.as<float>();
  float* hpack = hpack_.as<float>();

  // 1. Gather each group's rows into [k][mr] tiles.
  GatherRows(groups, x, ldx, row_token, apack);

  // 2. Gate and up projections with the activation, written as GEMM2's packed input.
  BuildTasks(groups, /*first_gemm=*/true);
  pool_->ParallelFor(static_cast<int64_t>(tasks_.size()), [&](int64_t ti, int worker) {
    GateUpTask(tasks_[static_cast<size_t>(ti)], groups, apack, hpack, worker);
  });

  // 3. Down projection straight into y.
  BuildTasks(groups, /*first_gemm=*/false);
  pool_->ParallelFor(static_cast<int64_t>(tasks_.size()), [&](int64_t ti, int worker) {
    DownTask(tasks_[static_cast<size_t>(ti)], groups, hpack, y, ldy, worker);
  });
}

}  // namespace moerun
