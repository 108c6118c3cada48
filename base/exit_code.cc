#include "base/exit_code.h"

#include "base/log.h"

namespace moerun {

int ExitCodeOf(const Status& s) {
  if (s.ok()) return 0;
  return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound ? 2 : 1;
}

int FailWith(const Status& s) {
  spdlog::error("{}", s.ToString());
  return s.ok() ? 1 : ExitCodeOf(s);  // a caller that fails has failed, whatever it passes
}

}  // namespace moerun
