#include "runtime/serving/tracing_options.h"

#include <cmath>
#include <cstdlib>

namespace moerun {

Result<OtlpTarget> ParseOtlpEndpoint(const std::string& endpoint) {
  std::string rest = endpoint;
  const size_t scheme = rest.find("://");
  if (scheme != std::string::npos) {
    const std::string s = rest.substr(0, scheme);
    if (s != "http") {
      return Status::InvalidArgument(
          "tracing endpoint '" + endpoint + "': only http:// is supported (OTLP/HTTP); for " + s +
          " run an OpenTelemetry Collector beside the router and let it forward");
    }
    rest = rest.substr(scheme + 3);
  }
  OtlpTarget t;
  const size_t slash = rest.find('/');
  t.path = slash == std::string::npos ? "/v1/traces" : rest.substr(slash);
  rest = rest.substr(0, slash);
  size_t colon = rest.rfind(':');
  if (!rest.empty() && rest.front() == '[') {  // [v6]:port
    const size_t close = rest.find(']');
    if (close == std::string::npos || close + 1 >= rest.size() || rest[close + 1] != ':') {
      return Status::InvalidArgument("tracing endpoint '" + endpoint +
                                     "': expected [ADDRESS]:PORT");
    }
    t.host = rest.substr(1, close - 1);
    colon = close + 1;
  } else if (colon != std::string::npos) {
    t.host = rest.substr(0, colon);
  }
  if (colon == std::string::npos || t.host.empty()) {
    return Status::InvalidArgument("tracing endpoint '" + endpoint +
                                   "': expected http://HOST:PORT[/PATH] (an OTLP/HTTP receiver, "
                                   "e.g. http://collector:4318)");
  }
  t.port = rest.substr(colon + 1);
  char* end = nullptr;
  const long port = std::strtol(t.port.c_str(), &end, 10);
  if (t.port.empty() || *end != '\0' || port < 1 || port > 65535) {
    return Status::InvalidArgument("tracing endpoint '" + endpoint + "': bad port '" + t.port +
                                   "'");
  }
  return t;
}

Status CheckTracingOptions(const TracingOptions& o) {
  if (!o.enabled()) return Status::Ok();
  MOERUN_RETURN_IF_ERROR(ParseOtlpEndpoint(o.endpoint).status());
  if (!std::isfinite(o.sample) || o.sample < 0 || o.sample > 1) {
    return Status::InvalidArgument("tracing.sample must be a share in [0, 1]");
  }
  if (o.slow_ms < 0) return Status::InvalidArgument("tracing.slow_ms must be >= 0");
  if (o.max_queue_spans < 64) return Status::InvalidArgument("tracing queue must hold >= 64 spans");
  return Status::Ok();
}

}  // namespace moerun
