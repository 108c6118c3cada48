// Starting the ranks of an expert-parallel job, however they were launched: under mpirun/srun
// (transports mpi, ucx, nccl: this process is one rank) or as threads of this process (transport
// inproc). nccl: one GPU per rank (each rank's GPU from its local rank, launch/local_device.h;
// routers need one too), the microbatches' rows and results over NCCL, everything else over MPI
// (transport/nccl/nccl_transport.h); without a build with NCCL, a GPU, an MPI launcher, or with
// more local ranks than visible GPUs, the command line is refused in one line (exit 2).
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "runtime/ranks/rank_job.h"
#include "transport/inproc.h"
#include "transport/transport.h"

namespace moerun {

struct LaunchFlags {
  std::string transport;  // mpi | ucx | nccl | inproc; empty: DefaultTransport()
  int ranks = 1;          // inproc only: ranks as threads
  int routers = 1;
  std::string placement = "linear";
  int64_t microbatch_tokens = 0;
  int64_t deadline_ms = 30000;
  int64_t startup_timeout_s = 600;
};

// Adds --transport, --ranks, --routers, --placement, --microbatch-tokens, --deadline-ms.
void AddLaunchFlags(CLI::App* cmd, LaunchFlags* f);

// The flags' own checks (names, ranges; --placement names linear, round_robin or an existing
// file), no transport started: the commands run it while parsing, JobLaunch::Create again. For
// --transport nccl it also probes the GPUs (CheckOneGpuPerRank) and the launcher.
Status ValidateLaunchFlags(const LaunchFlags& flags);

// The transport of a job that names none: under mpirun or srun, MOERUN_TRANSPORT when set (mpi,
// ucx or nccl: the whole test suite runs on mpi so), else ucx where this build has it (a dead
// expert rank is noticed in about a second, and ranks can join) and mpi where it does not;
// without a launcher, inproc (ranks as threads). kInvalidArgument for another MOERUN_TRANSPORT.
Result<std::string> DefaultTransport();

// JobOptions::ep, the routers, the placement and the start-up timeout from launch flags.
void FillJobOptions(const LaunchFlags& flags, JobOptions* options);

class JobLaunch {
 public:
  // Initialises the transport (MPI_Init for mpi) and sets each rank's log tag.
  static Result<std::unique_ptr<JobLaunch>> Create(const LaunchFlags& flags);
  ~JobLaunch();

  const std::string& transport() const { return transport_; }
  int rank() const { return rank_; }  // this process's rank (0 for inproc)
  int size() const { return size_; }
  bool is_router() const { return rank_ < flags_.routers; }
  // Runs `rank_main` for every rank this process holds (on its transport endpoint), to the end;
  // the first error (a rank names itself in it). A failing rank 0 of an inproc job ends the
  // process (the others would wait for it forever), as mpirun ends the job.
  using RankMain = std::function<Status(Transport* transport)>;
  Status Run(const RankMain& rank_main);
  // RunRank on every rank this process holds.
  Status Run(const JobOptions& options, const RouterWork& work,
             const ExpertSetup& expert_setup = nullptr);
  // Ends the whole job (MPI_Abort under mpirun) after a fatal error.
  [[noreturn]] void Abort(int exit_code);
  // This process's endpoint when each rank is a process (mpi, ucx or nccl; null for inproc).
  Transport* mpi_transport() const { return mpi_.get(); }
  bool multi_process() const { return mpi_ != nullptr; }
  // JobOptions::ep and the rest from the flags (FillJobOptions).
  void Fill(JobOptions* options) const;

 private:
  LaunchFlags flags_;
  std::string transport_;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<Transport> mpi_;
  std::shared_ptr<InprocFabric> fabric_;
};

}  // namespace moerun
