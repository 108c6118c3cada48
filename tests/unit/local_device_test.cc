#include "launch/local_device.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace moerun {
namespace {

// A fake environment: only the given variables are set.
EnvLookup Env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

TEST(LocalDeviceTest, NoLauncherIsLocalRankZero) {
  const LocalDeviceChoice c = ChooseLocalDevice(Env({}), 8);
  ASSERT_TRUE(c.ok()) << c.error.ToString();
  EXPECT_EQ(c.device, 0);
  EXPECT_EQ(c.local_rank, 0);
  EXPECT_EQ(c.local_size, 1);
  EXPECT_FALSE(c.shared);
  EXPECT_TRUE(c.nccl_usable());
}

TEST(LocalDeviceTest, OpenMpi) {
  const LocalDeviceChoice c = ChooseLocalDevice(
      Env({{"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}}), 8);
  ASSERT_TRUE(c.ok()) << c.error.ToString();
  EXPECT_EQ(c.device, 3);
  EXPECT_EQ(c.local_rank, 3);
  EXPECT_EQ(c.local_size, 8);
  EXPECT_EQ(c.ranks_sharing_device, 1);
  EXPECT_FALSE(c.shared);
  EXPECT_NE(c.source.find("OMPI_COMM_WORLD_LOCAL_RANK=3"), std::string::npos) << c.source;
}

TEST(LocalDeviceTest, OpenMpiWinsOverSlurm) {
  // srun --mpi=pmix with Open MPI sets both.
  const LocalDeviceChoice c =
      ChooseLocalDevice(Env({{"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"SLURM_LOCALID", "5"}}), 8);
  ASSERT_TRUE(c.ok()) << c.error.ToString();
  EXPECT_EQ(c.device, 1);
}

TEST(LocalDeviceTest, Mpich) {
  const LocalDeviceChoice c =
      ChooseLocalDevice(Env({{"MPI_LOCALRANKID", "5"}, {"MPI_LOCALNRANKS", "6"}}), 4);
  ASSERT_TRUE(c.ok()) << c.error.ToString();
  EXPECT_EQ(c.device, 1);
  EXPECT_EQ(c.local_size, 6);
  EXPECT_EQ(c.ranks_sharing_device, 2);  // local ranks 1 and 5
  EXPECT_TRUE(c.shared);
  EXPECT_FALSE(c.nccl_usable());
}

TEST(LocalDeviceTest, SlurmNtasksPerNode) {
  const LocalDeviceChoice c =
      ChooseLocalDevice(Env({{"SLURM_LOCALID", "2"}, {"SLURM_NTASKS_PER_NODE", "4"}}), 4);
  ASSERT_TRUE(c.ok()) << c.error.ToString();
  EXPECT_EQ(c.device, 2);
  EXPECT_EQ(c.local_size, 4);
  EXPECT_FALSE(c.shared);
}

TEST(LocalDeviceTest, SlurmTasksPerNodeOfThisNode) {
  // Three nodes of 2 tasks, then one of 1: node 3 has one task.
  const auto env = [](const char* node) {
    return Env(
        {{"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "2(x3),1"}, {"SLURM_NODEID", node}});
  };
  LocalDeviceChoice c = ChooseLocalDevice(env("1"), 1);
  ASSERT_TRUE(c.ok()) << c.error.ToString();
  EXPECT_EQ(c.local_size, 2);
  EXPECT_TRUE(c.shared);
  c = ChooseLocalDevice(env("3"), 1);
  ASSERT_TRUE(c.ok()) << c.error.ToString();
  EXPECT_EQ(c.local_size, 1);
  EXPECT_FALSE(c.shared);
  c = ChooseLocalDevice(env("4"), 1);
  EXPECT_EQ(c.error.code(), StatusCode::kInvalidArgument);
  // Without SLURM_NODEID: the first entry.
  c = ChooseLocalDevice(Env({{"SLURM_LOCALID", "1"}, {"SLURM_TASKS_PER_NODE", "4,2"}}), 4);
  ASSERT_TRUE(c.ok()) << c.error.ToString();
  EXPECT_EQ(c.local_size, 4);
}

TEST(LocalDeviceTest, UnknownLocalSizeIsAtLeastTheRank) {
  const LocalDeviceChoice c = ChooseLocalDevice(Env({{"SLURM_LOCALID", "2"}}), 2);
  ASSERT_TRUE(c.ok()) << c.error.ToString();
  EXPECT_EQ(c.device, 0);
  EXPECT_FALSE(c.local_size_known);
  EXPECT_EQ(c.local_size, 3);
  EXPECT_EQ(c.ranks_sharing_device, 2);  // ranks 0 and 2 at least
}

TEST(LocalDeviceTest, GarbageValuesAreErrors) {
  for (const char* bad : {"", "abc", "-1", "1x", " 1", "99999999999999"}) {
    LocalDeviceChoice c = ChooseLocalDevice(Env({{"OMPI_COMM_WORLD_LOCAL_RANK", bad}}), 8);
    EXPECT_EQ(c.error.code(), StatusCode::kInvalidArgument) << "'" << bad << "'";
    EXPECT_NE(c.error.message().find("OMPI_COMM_WORLD_LOCAL_RANK"), std::string::npos)
        << c.error.message();
    c = ChooseLocalDevice(Env({{"MPI_LOCALRANKID", "0"}, {"MPI_LOCALNRANKS", bad}}), 8);
    EXPECT_EQ(c.error.code(), StatusCode::kInvalidArgument) << "'" << bad << "'";
  }
  for (const char* bad : {"2(x", "2(3)", "x", "2,,1", "2(x0)"}) {
    const LocalDeviceChoice c =
        ChooseLocalDevice(Env({{"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", bad}}), 8);
    EXPECT_EQ(c.error.code(), StatusCode::kInvalidArgument) << "'" << bad << "'";
  }
  // A local rank beyond the local size.
  const LocalDeviceChoice c = ChooseLocalDevice(
      Env({{"OMPI_COMM_WORLD_LOCAL_RANK", "4"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}), 8);
  EXPECT_EQ(c.error.code(), StatusCode::kInvalidArgument);
}

TEST(LocalDeviceTest, FourRanksOnOneGpuShare) {
  for (int r = 0; r < 4; ++r) {
    const LocalDeviceChoice c =
        ChooseLocalDevice(Env({{"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}),
                          1);
    ASSERT_TRUE(c.ok()) << c.error.ToString();
    EXPECT_EQ(c.device, 0);
    EXPECT_EQ(c.ranks_sharing_device, 4);
    EXPECT_TRUE(c.shared);
    EXPECT_FALSE(c.nccl_usable());
    EXPECT_NE(c.Describe().find("NCCL"), std::string::npos) << c.Describe();
  }
}

TEST(LocalDeviceTest, EightRanksOnEightGpusDoNotShare) {
  for (int r = 0; r < 8; ++r) {
    const LocalDeviceChoice c =
        ChooseLocalDevice(Env({{"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r)},
                               {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}}),
                          8);
    ASSERT_TRUE(c.ok()) << c.error.ToString();
    EXPECT_EQ(c.device, r);
    EXPECT_EQ(c.ranks_sharing_device, 1);
    EXPECT_TRUE(c.nccl_usable());
  }
}

TEST(LocalDeviceTest, ThreeRanksOnTwoGpus) {
  const int expected_device[] = {0, 1, 0};
  const int expected_sharing[] = {2, 1, 2};
  for (int r = 0; r < 3; ++r) {
    const LocalDeviceChoice c = ChooseLocalDevice(
        Env({{"MPI_LOCALRANKID", std::to_string(r)}, {"MPI_LOCALNRANKS", "3"}}), 2);
    ASSERT_TRUE(c.ok()) << c.error.ToString();
    EXPECT_EQ(c.device, expected_device[r]) << "rank " << r;
    EXPECT_EQ(c.ranks_sharing_device, expected_sharing[r]) << "rank " << r;
    EXPECT_EQ(c.shared, expected_sharing[r] > 1) << "rank " << r;
  }
}

TEST(LocalDeviceTest, ExplicitDevice) {
  LocalDeviceChoice c = ChooseLocalDevice(
      Env({{"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}), 4, 3);
  ASSERT_TRUE(c.ok()) << c.error.ToString();
  EXPECT_EQ(c.device, 3);
  EXPECT_FALSE(c.shared);
  EXPECT_NE(c.source.find("explicit"), std::string::npos) << c.source;

  c = ChooseLocalDevice(Env({{"CUDA_VISIBLE_DEVICES", "2,3"}}), 2, 2);
  EXPECT_EQ(c.error.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.error.message().find("CUDA_VISIBLE_DEVICES=2,3"), std::string::npos)
      << c.error.message();
  c = ChooseLocalDevice(Env({}), 2, -2);
  EXPECT_EQ(c.error.code(), StatusCode::kInvalidArgument);
}

TEST(LocalDeviceTest, VisibleDevicesAreOrdinals) {
  // CUDA_VISIBLE_DEVICES=4,5 leaves two devices, numbered 0 and 1.
  const LocalDeviceChoice c = ChooseLocalDevice(Env({{"CUDA_VISIBLE_DEVICES", "4,5"},
                                                     {"SLURM_LOCALID", "1"},
                                                     {"SLURM_NTASKS_PER_NODE", "2"}}),
                                                2);
  ASSERT_TRUE(c.ok()) << c.error.ToString();
  EXPECT_EQ(c.device, 1);
  EXPECT_EQ(c.visible_devices, "4,5");
  EXPECT_NE(c.Describe().find("CUDA_VISIBLE_DEVICES=4,5"), std::string::npos) << c.Describe();
}

TEST(LocalDeviceTest, NoDeviceIsUnavailable) {
  const LocalDeviceChoice c = ChooseLocalDevice(Env({}), 0);
  EXPECT_EQ(c.error.code(), StatusCode::kUnavailable);
  EXPECT_FALSE(c.nccl_usable());
}

}  // namespace
}  // namespace moerun
