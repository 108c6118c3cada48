// How a command ends on an error: the error is logged (with the rank and role of log.h) and the
// process exit code follows from its kind, the same in every binary: 2 for bad arguments or input
// (kInvalidArgument, kNotFound: the user can fix the command line or the file), 1 otherwise.
#pragma once

#include "base/status.h"

namespace moerun {

// Logs `s` and returns the exit code for it.
int FailWith(const Status& s);

// The exit code for `s` without logging (0 for OK).
int ExitCodeOf(const Status& s);

}  // namespace moerun
