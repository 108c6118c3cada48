#include "transport/launcher_env.h"

#include <cstdlib>
#include <initializer_list>

namespace moerun {

bool LaunchedByMpiLauncher() {
  // Open MPI's, PMIx's (srun --mpi=pmix) and PMI-1/2's rank variables.
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

}  // namespace moerun
