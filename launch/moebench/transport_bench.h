// `moebench transport`: the dispatch + combine of a real plan over the job's transport, against
// raw MPI_Alltoallv of exactly the same byte matrix in the same run
// (efficiency_vs_alltoallv = Alltoallv time / ours), and the time of a whole expert-parallel layer
// of the same shape with and without microbatch overlap (overlap_gain = without / with).
// Under --transport ucx also, round by round in the same run: a raw ucp_put_nbx loop over the
// same bytes (efficiency_vs_raw_ucx = raw / ours), our protocol over a plain mpi transport
// (speedup_vs_mpi_transport = mpi / ours), and the ucx transport's counters over the timed rounds
// (zero_copy).
// Run it under mpirun (rank 0 is the router, the others host experts); JSON on rank 0's stdout.
#pragma once

#include <cstdint>

#include "launch/job_launch.h"

namespace moerun::bench {

struct TransportBenchFlags {
  LaunchFlags launch;
  int64_t tokens = 0;          // or derived from bytes_per_peer
  int64_t bytes_per_peer = 0;  // target bytes to each expert rank per direction
  int64_t hidden = 7168;
  int topk = 8;
  int experts = 256;
  int64_t inter = 0;              // expert intermediate size for the layer timing (0: hidden / 8)
  int64_t shared_inter = 0;       // a shared expert on the router, for the layer timing (0: none)
  int64_t microbatch_tokens = 0;  // for the overlapped layer timing (0: a quarter of the batch)
  int iters = 20;
  uint64_t seed = 1;
  bool layer = true;
  bool json = false;
};

int RunTransportBench(const TransportBenchFlags& f);

}  // namespace moerun::bench
