// Test helper: every rank of an expert-parallel job as a thread of this process, over the inproc
// transport, each running RunRank to the end; the statuses by rank.
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include "ranks/rank_job.h"
#include "transport/inproc.h"

namespace moerun::testing {

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
