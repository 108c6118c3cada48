#include "runtime/migration/drain_relay.h"

#include <nlohmann/json.hpp>
#include <string>

namespace moerun {

Status DrainRelay::TellOthers(int routers) {
  const std::string body = nlohmann::json{{"id", 0}, {"op", "drain"}}.dump();
  for (int r = 1; r < routers; ++r) {
    if (!link_->Gone(r)) MOERUN_RETURN_IF_ERROR(link_->SendToRouter(r, body));
  }
  return Status::Ok();
}

}  // namespace moerun
