#include "launch/death_survival.h"

#include <strings.h>

#include <cstring>

namespace moerun {
namespace {

bool IsSet(const EnvLookup& env, const char* name) {
  const char* v = env(name);
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

}  // namespace

DeathSurvival JudgeDeathSurvival(const std::string& transport, std::chrono::milliseconds deadline,
                                 const EnvLookup& env) {
  using V = DeathSurvival::Verdict;
  const std::string ms = std::to_string(deadline.count()) + " ms";
  if (transport == "inproc") {
    return {V::kDoesNot,
            "this job does not outlive a dead expert rank: its ranks are threads of one process "
            "(transport inproc); launch it with mpirun --enable-recovery or srun --no-kill and "
            "transport: ucx for one that does"};
  }
  if (transport == "nccl") {
    return {V::kDoesNot,
            "this job does not outlive a dead expert rank: NCCL's communicators do not survive a "
            "peer's death (transport nccl); transport: ucx with mpirun --enable-recovery does"};
  }
  const bool ompi = env("OMPI_COMM_WORLD_SIZE") != nullptr;
  const bool slurm = !ompi && env("SLURM_STEP_ID") != nullptr;
  const std::string notice =
      transport == "ucx"
          ? std::string("a death is noticed in about a second (UCX's keep-alive)")
          : "the mpi transport notices a death only by deadline_ms (" + ms +
                ": every request in flight waits that long; transport: ucx notices it in about a "
                "second)";
  if (ompi) {
    if (IsSet(env, "OMPI_MCA_orte_enable_recovery")) {
      return {V::kSurvives,
              "this job outlives a dead expert rank (mpirun --enable-recovery, "
              "transport " +
                  transport + "): " + notice};
    }
    return {V::kDoesNot,
            "this job does not outlive a dead expert rank: mpirun ends every rank when one dies; "
            "launch it with mpirun --enable-recovery (transport " +
                transport + ": " + notice + ")"};
  }
  if (slurm) {
    // srun reads SLURM_NO_KILL as --no-kill's value ("set"; "off" or "no" turn it off) and
    // passes it on to the ranks.
    const char* no_kill = env("SLURM_NO_KILL");
    if (no_kill != nullptr && strcasecmp(no_kill, "off") != 0 && strcasecmp(no_kill, "no") != 0) {
      return {V::kSurvives, "this job outlives a dead expert rank (srun --no-kill, transport " +
                                transport + "): " + notice};
    }
    return {V::kDependsOnLauncher,
            "this job outlives a dead expert rank only if srun was given --no-kill (Slurm does not "
            "tell its ranks; SLURM_NO_KILL=set says so), transport " +
                transport + ": " + notice};
  }
  return {V::kDependsOnLauncher,
          "whether this job outlives a dead expert rank depends on its launcher (it must not end "
          "the other ranks: mpirun --enable-recovery, srun --no-kill), transport " +
              transport + ": " + notice};
}

}  // namespace moerun
