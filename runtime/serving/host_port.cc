#include "runtime/serving/host_port.h"

namespace moerun {
namespace {

Status Bad(const std::string& text, const std::string& why) {
  return Status::InvalidArgument("invalid address \"" + text + "\": " + why +
                                 " (expected HOST:PORT, [IPv6]:PORT or :PORT)");
}

bool IsHostChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
         c == '-' || c == '_';
}

bool IsV6Char(char c) {
  return (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F') || (c >= '0' && c <= '9') || c == ':' ||
         c == '.' || c == '%' || IsHostChar(c);  // '%' and a zone name: fe80::1%eth0
}

}  // namespace

Result<HostPort> ParseHostPort(const std::string& text) {
  HostPort hp;
  std::string port_text;
  if (!text.empty() && text[0] == '[') {
    size_t close = text.find(']');
    if (close == std::string::npos) return Bad(text, "missing ']'");
    hp.host = text.substr(1, close - 1);
    if (hp.host.empty()) return Bad(text, "empty IPv6 address");
    for (char c : hp.host) {
      if (!IsV6Char(c)) return Bad(text, "bad character in the IPv6 address");
    }
    if (hp.host.find(':') == std::string::npos) return Bad(text, "not an IPv6 address in [...]");
    if (close + 1 >= text.size() || text[close + 1] != ':') return Bad(text, "missing ':PORT'");
    port_text = text.substr(close + 2);
  } else {
    size_t colon = text.rfind(':');
    if (colon == std::string::npos) return Bad(text, "missing ':PORT'");
    hp.host = text.substr(0, colon);
    if (hp.host.find(':') != std::string::npos) {
      return Bad(text, "an IPv6 address must be written in brackets");
    }
    if (hp.host.empty()) hp.host = "0.0.0.0";
    for (char c : hp.host) {
      if (!IsHostChar(c)) return Bad(text, "bad character in the host");
    }
    port_text = text.substr(colon + 1);
  }
  if (port_text.empty()) return Bad(text, "empty port");
  if (port_text.size() > 5) return Bad(text, "port out of range 0..65535");
  uint32_t port = 0;
  for (char c : port_text) {
    if (c < '0' || c > '9') return Bad(text, "port is not a number");
    port = port * 10 + static_cast<uint32_t>(c - '0');
  }
  if (port > 65535) return Bad(text, "port out of range 0..65535");
  hp.port = static_cast<uint16_t>(port);
  return hp;
}

HostPort WithPortOffset(HostPort hp, int offset) {
  if (hp.port == 0) return hp;  // any free port stays any free port
  hp.port = static_cast<uint16_t>(static_cast<int>(hp.port) + offset);
  return hp;
}

std::string FormatHostPort(const HostPort& hp) {
  if (hp.host.find(':') != std::string::npos) {
    return "[" + hp.host + "]:" + std::to_string(hp.port);
  }
  return hp.host + ":" + std::to_string(hp.port);
}

}  // namespace moerun
