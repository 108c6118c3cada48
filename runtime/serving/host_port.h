// Network addresses as users write them on the command line: "HOST:PORT", "[v6addr]:PORT" or
// ":PORT" (every IPv4 interface). Parsing checks the syntax only; nothing is resolved.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"

namespace moerun {

struct HostPort {
  std::string host;  // a name, an IPv4 address or an IPv6 address (without brackets)
  uint16_t port = 0;
};

// "HOST:PORT", "[v6addr]:PORT", ":PORT" (host 0.0.0.0); port 0..65535. Errors name the text.
Result<HostPort> ParseHostPort(const std::string& text);

// port + offset ("port + rank"); port 0 (any free port) stays 0. The caller checks that the
// sum is within 0..65535.
HostPort WithPortOffset(HostPort hp, int offset);

// "host:port", or "[v6addr]:port" when the host contains ':'.
std::string FormatHostPort(const HostPort& hp);

}  // namespace moerun
