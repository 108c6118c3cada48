// Test helpers: a job on a golden fixture, and every rank of an expert-parallel job as a thread
// of this process over the inproc transport, each running RunRank to the end.
#pragma once

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "experts/cpu/isa.h"
#include "runtime/ranks/rank_job.h"
#include "tests/unit/test_util.h"
#include "transport/inproc.h"

namespace moerun::testing {

// A job on a fixture's layer 0, one thread per rank, experts round robin.
inline JobOptions FixtureJob(const std::string& fixture, int64_t microbatch_tokens) {
  JobOptions opts;
  opts.source.model = FixtureDir(fixture);
  opts.layers = {0};
  opts.placement = "round_robin";
  opts.ep.microbatch_tokens = microbatch_tokens;
  opts.threads = 1;
  opts.isa = BestIsa();
  return opts;
}

// The statuses by rank.
inline std::vector<Status> RunInprocJob(int ranks, const JobOptions& options,
                                        const RouterWork& work,
                                        const ExpertSetup& expert_setup = nullptr,
                                        std::shared_ptr<InprocFabric> fabric = nullptr) {
  if (!fabric) fabric = InprocFabric::Create(ranks);
  std::vector<Status> results(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      auto t = fabric->Endpoint(r);
      results[static_cast<size_t>(r)] = RunRank(t.get(), options, work, expert_setup);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

}  // namespace moerun::testing
