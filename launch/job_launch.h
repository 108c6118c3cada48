// Starting the ranks of an expert-parallel job, however they were launched: under mpirun/srun
// (transport mpi: this process is one rank) or as threads of this process (transport inproc).
#pragma once

#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "ranks/rank_job.h"
#include "transport/inproc.h"

namespace moerun {

struct LaunchFlags {
  std::string transport;  // mpi | ucx | inproc; empty: mpi under an MPI launcher, else inproc
  int ranks = 1;          // inproc only: ranks as threads
  int routers = 1;
  std::string placement = "linear";
  int64_t microbatch_tokens = 0;
  int64_t deadline_ms = 30000;
  int64_t startup_timeout_s = 600;
};

// Adds --transport, --ranks, --routers, --placement, --microbatch-tokens, --deadline-ms.
void AddLaunchFlags(CLI::App* cmd, LaunchFlags* f);

class JobLaunch {
 public:
  // Initialises the transport (MPI_Init for mpi) and sets each rank's log tag.
  static Result<std::unique_ptr<JobLaunch>> Create(const LaunchFlags& flags);
  ~JobLaunch();

  const std::string& transport() const { return transport_; }
  int rank() const { return rank_; }  // this process's rank (0 for inproc)
  int size() const { return size_; }
  bool is_router() const { return rank_ < flags_.routers; }
  // Runs every rank this process holds to the end; the first error (a rank names itself in it).
  Status Run(const JobOptions& options, const RouterWork& work);
  // Ends the whole job (MPI_Abort under mpirun) after a fatal error.
  [[noreturn]] void Abort(int exit_code);
  // This process's endpoint when each rank is a process (mpi or ucx; null for inproc).
  Transport* mpi_transport() const { return mpi_.get(); }
  bool multi_process() const { return mpi_ != nullptr; }
  // JobOptions::ep and the rest from the flags.
  void Fill(JobOptions* options) const;

 private:
  LaunchFlags flags_;
  std::string transport_;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<Transport> mpi_;
  std::shared_ptr<InprocFabric> fabric_;
};

}  // namespace moerun
