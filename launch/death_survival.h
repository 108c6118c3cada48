// Whether a serving job outlives the death of an expert rank, judged at start from its transport
// and what its launcher told its processes, and the line rank 0 logs about it once, so that an
// operator learns before a rank dies, not after, what the job will do then and what to change.
//
//   inproc   ranks are threads of one process: a death ends the job
//   nccl     NCCL's communicators do not survive a peer's death
//   mpi/ucx  under mpirun: only with --enable-recovery (mpirun kills the job on a rank's death
//            otherwise; Open MPI tells the ranks: OMPI_MCA_orte_enable_recovery=1); the mpi
//            transport notices a death by deadline_ms only (every request in flight waits that
//            long), ucx in about a second (its keep-alive)
//            under srun: only with --no-kill, which Slurm does not tell its ranks unless it comes
//            as SLURM_NO_KILL=set (srun reads it as --no-kill and passes it on): the line says so
//
// Pure: the environment comes in through `env` (launch/local_device.h's EnvLookup).
#pragma once

#include <chrono>
#include <string>

#include "launch/local_device.h"

namespace moerun {

struct DeathSurvival {
  enum class Verdict { kSurvives, kDoesNot, kDependsOnLauncher };
  Verdict verdict = Verdict::kDoesNot;
  std::string line;  // what rank 0 logs: the verdict, why, and what to change
};

DeathSurvival JudgeDeathSurvival(const std::string& transport, std::chrono::milliseconds deadline,
                                 const EnvLookup& env);

}  // namespace moerun
