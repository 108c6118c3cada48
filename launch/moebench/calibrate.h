// `moebench calibrate`: measures this machine for the performance model (perf_model.h) with
// moerun's own code and prints the profile as JSON. Alone (one process): the grouped expert FFN
// per weight type at several rows per expert (fitted per type as W * (fixed + rows * row) ns, W
// the expert's weights), the gate (fixed + ns per multiply-add) and the combine (ns per value).
// Under mpirun -np N (--transport mpi or ucx) or with --transport inproc --ranks N: the
// transport's round trip from rank 0 to every other rank at several message sizes, fitted as
// latency per message + bytes / bandwidth, for that transport and rank count. --out FILE writes
// the profile there, keeping the parts of an existing profile this run did not measure (so one
// file gathers the kernels and several transports and rank counts).
#pragma once

#include <string>

#include "launch/job_launch.h"

namespace moerun::bench {

struct CalibrateFlags {
  LaunchFlags launch;
  std::string out;                       // --out FILE (merged into)
  bool quick = false;                    // fewer points, shorter timings
  std::string preset = "qwen3-30b-a3b";  // the shape the kernels are timed on
  int experts = 8;                       // experts of that preset timed per pass (>= top-k)
  std::string dtypes = "f32,bf16,fp8";   // weight types timed
  int threads = 0;                       // kernel threads (0: all cores)
};

int RunCalibrate(const CalibrateFlags& f);

}  // namespace moerun::bench
