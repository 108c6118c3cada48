// Whether this process was started by an MPI launcher. Only reads environment variables, so it
// is built whether or not this build has an MPI transport (the runtime chooses its default
// transport, and explains a missing one, with it).
#pragma once

namespace moerun {

// True when this process was started by an MPI launcher (mpirun, srun --mpi=pmix).
bool LaunchedByMpiLauncher();

}  // namespace moerun
