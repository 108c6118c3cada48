// launch/death_survival.h: what rank 0 says at start about a dead expert rank, from the
// transport and the launcher's environment.
#include "launch/death_survival.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace moerun {
namespace {

using V = DeathSurvival::Verdict;
using Env = std::map<std::string, std::string>;

DeathSurvival Judge(const std::string& transport, const Env& env) {
  return JudgeDeathSurvival(transport, std::chrono::milliseconds(10000),
                            [env](const char* name) -> const char* {
                              const auto it = env.find(name);
                              return it == env.end() ? nullptr : it->second.c_str();
                            });
}

TEST(DeathSurvivalTest, MpirunWithAndWithoutRecovery) {
  const Env plain = {{"OMPI_COMM_WORLD_SIZE", "4"}};
  Env recovery = plain;
  recovery["OMPI_MCA_orte_enable_recovery"] = "1";
  DeathSurvival d = Judge("ucx", recovery);
  EXPECT_EQ(d.verdict, V::kSurvives) << d.line;
  EXPECT_NE(d.line.find("about a second"), std::string::npos) << d.line;
  d = Judge("mpi", recovery);
  EXPECT_EQ(d.verdict, V::kSurvives) << d.line;
  EXPECT_NE(d.line.find("deadline_ms (10000 ms"), std::string::npos) << d.line;
  for (const char* t : {"mpi", "ucx"}) {
    d = Judge(t, plain);
    EXPECT_EQ(d.verdict, V::kDoesNot) << d.line;
    EXPECT_NE(d.line.find("mpirun --enable-recovery"), std::string::npos) << d.line;
  }
  recovery["OMPI_MCA_orte_enable_recovery"] = "0";
  EXPECT_EQ(Judge("ucx", recovery).verdict, V::kDoesNot);
}

TEST(DeathSurvivalTest, SrunSaysWhatItCannotSee) {
  const Env srun = {{"SLURM_STEP_ID", "0"}, {"PMIX_RANK", "0"}};
  DeathSurvival d = Judge("ucx", srun);
  EXPECT_EQ(d.verdict, V::kDependsOnLauncher) << d.line;
  EXPECT_NE(d.line.find("--no-kill"), std::string::npos) << d.line;
  Env no_kill = srun;
  no_kill["SLURM_NO_KILL"] = "set";  // srun's own reading: --no-kill
  EXPECT_EQ(Judge("ucx", no_kill).verdict, V::kSurvives);
  no_kill["SLURM_NO_KILL"] = "off";
  EXPECT_EQ(Judge("ucx", no_kill).verdict, V::kDependsOnLauncher);
}

TEST(DeathSurvivalTest, ThreadsAndNcclDoNot) {
  EXPECT_EQ(Judge("inproc", {}).verdict, V::kDoesNot);
  const Env recovery = {{"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_MCA_orte_enable_recovery", "1"}};
  const DeathSurvival d = Judge("nccl", recovery);
  EXPECT_EQ(d.verdict, V::kDoesNot) << d.line;
  EXPECT_NE(d.line.find("NCCL"), std::string::npos) << d.line;
}

}  // namespace
}  // namespace moerun
