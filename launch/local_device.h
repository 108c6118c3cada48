// Which GPU a rank uses: its rank among the ranks of its node (the launcher's "local rank"),
// modulo the number of devices this process sees. CUDA_VISIBLE_DEVICES, when set, has already
// narrowed and renumbered the devices: the choice is an ordinal among the visible ones.
//
// Launcher variables, the first one set wins (its local size is read from the same launcher):
//   Open MPI (mpirun, and srun --mpi=pmix): OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE
//   MPICH / Intel MPI (Hydra):              MPI_LOCALRANKID, MPI_LOCALNRANKS
//   Slurm (srun):                           SLURM_LOCALID, SLURM_NTASKS_PER_NODE, else this
//                                           node's entry (SLURM_NODEID) of SLURM_TASKS_PER_NODE
//                                           ("2(x3),1": three nodes of 2 tasks, then one of 1)
// None set: local rank 0 of 1 (started alone).
//
// When several local ranks map to one device (more ranks than GPUs), NCCL cannot be used:
// it refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"); device data
// must then move host-staged (the mpi or ucx transport).
//
// Pure: the environment comes in through `env`; no CUDA call (the caller passes the device count
// from its own probe). Thread-safe as far as `env` is.
#pragma once

#include <functional>
#include <string>

#include "base/status.h"

namespace moerun {

// Returns the variable's value, or nullptr when it is not set.
using EnvLookup = std::function<const char*(const char*)>;

// The process environment (std::getenv).
EnvLookup ProcessEnvironment();

struct LocalDeviceChoice {
  Status error;          // a bad variable or device: the fields below are then not to be used
  int device = -1;       // ordinal among the visible devices
  int device_count = 0;  // visible devices, as given
  int local_rank = 0;    // this rank's index among the ranks of its node
  int local_size = 1;    // ranks on this node (at least local_rank + 1 when not known)
  bool local_size_known = false;
  int ranks_sharing_device = 1;  // local ranks mapped to `device`, this one included
  bool shared = false;           // ranks_sharing_device > 1: NCCL cannot be used
  std::string source;            // where the choice came from: "OMPI_COMM_WORLD_LOCAL_RANK=3"
  std::string visible_devices;   // CUDA_VISIBLE_DEVICES as set, or empty

  bool ok() const { return error.ok(); }
  bool nccl_usable() const { return ok() && device >= 0 && !shared; }
  // One line for the log: "GPU 3 of 8 (OMPI_COMM_WORLD_LOCAL_RANK=3, local size 8 from ...)".
  std::string Describe() const;
};

// device_count: devices this process sees (after CUDA_VISIBLE_DEVICES); explicit_device: the
// user's choice (--device), -1 to choose from the local rank. With an explicit device the other
// local ranks' choices are unknown: the sharing is counted as if ranks spread evenly over the
// devices (shared when the node has more local ranks than devices).
// Errors (InvalidArgument): a launcher variable that is not a non-negative integer, a local rank
// not below the local size, explicit_device < -1 or >= device_count; (Unavailable) no device.
LocalDeviceChoice ChooseLocalDevice(const EnvLookup& env, int device_count,
                                    int explicit_device = -1);

// For --transport nccl (one GPU per rank): Ok when `c` gives this rank a GPU of its own;
// otherwise one line (InvalidArgument, exit 2) saying why: the choice's own error (no GPU
// visible, a bad launcher variable), or more local ranks than visible GPUs (NCCL refuses two
// ranks of one communicator on one GPU), with the counts and what to do instead.
Status CheckOneGpuPerRank(const LocalDeviceChoice& c);

}  // namespace moerun
