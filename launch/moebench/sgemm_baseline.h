// The sgemm baseline of `moebench layer`: the same total GEMM shape as the layer (every expert's
// rows as one dense matrix, so no grouping cost at all) through OpenBLAS, the best BLAS Debian
// ships. OpenBLAS picks its kernels from OPENBLAS_CORETYPE when the library loads, so the
// baseline runs in a child process (`moebench sgemm`) started with that variable set; the child
// reports the core name OpenBLAS says it uses.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/status.h"

namespace moerun::bench {

struct GemmShape {
  int64_t m, n, k;
};

// The child side: times the shapes back to back; prints JSON {corename, ms, gflops, reps}.
int RunSgemmChild(const std::vector<GemmShape>& shapes, int threads, double min_seconds);

// The parent side: runs the child once per core type ("" = as installed) and returns each result
// (with "coretype" added), or an error if the child could not run.
Result<nlohmann::json> RunSgemmBaseline(const std::vector<GemmShape>& shapes, int threads,
                                        double min_seconds, const std::string& coretype);

// Core types worth trying on this CPU, best first after "" (as installed).
std::vector<std::string> CandidateCoreTypes();

std::string ShapesToArg(const std::vector<GemmShape>& shapes);
Result<std::vector<GemmShape>> ShapesFromArg(const std::string& arg);

}  // namespace moerun::bench
