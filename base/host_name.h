// This host's name (gethostname), as the logs, moectl status and a joining rank report it; "?"
// where it cannot be read. Thread-safe.
#pragma once

#include <string>

namespace moerun {

std::string HostName();

}  // namespace moerun
