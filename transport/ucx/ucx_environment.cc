#include "transport/ucx/ucx_environment.h"

#include <algorithm>
#include <cstdlib>
#include <string>

#include "base/log.h"
#include "transport/ucx/ucx_transport.h"
#include "transport/ucx/ucx_wire.h"

namespace moerun {
namespace ucx {

bool SharedMemoryMayBeUsed() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr || *tls == '\0' || *tls == '^') return true;
  const std::string list = std::string(",") + tls + ",";
  for (const char* name : {",sm,", ",shm,", ",mm,", ",posix,", ",sysv,", ",all,", ",xpmem,"}) {
    if (list.find(name) != std::string::npos) return true;
  }
  return false;
}

bool TcpOnly() {
  const char* tls = std::getenv("UCX_TLS");
  if (tls == nullptr) return false;
  std::string list = tls;
  bool tcp = false;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t end = std::min(list.find(',', start), list.size());
    const std::string name = list.substr(start, end - start);
    if (name == "tcp") {
      tcp = true;
    } else if (name != "self" && !name.empty()) {
      return false;
    }
    start = end + 1;
  }
  return tcp;
}

void SetUcxEnvironmentDefaults(bool loud) {
  if (std::getenv("UCX_MM_ERROR_HANDLING") == nullptr && SharedMemoryMayBeUsed()) {
    ::setenv("UCX_MM_ERROR_HANDLING", "y", 0);
    if (loud) {
      spdlog::info(
          "ucx: set UCX_MM_ERROR_HANDLING=y (UCX's shared-memory transports need it to report a "
          "dead peer; set it yourself to override)");
    }
  }
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    // UCX's default (20 s and more) would leave a killed peer undetected for far longer than a
    // request's deadline; a stopped (not dead) peer still passes keepalive checks.
    ::setenv("UCX_KEEPALIVE_INTERVAL", "1s", 0);
    if (loud) {
      spdlog::info(
          "ucx: set UCX_KEEPALIVE_INTERVAL=1s, so that a dead peer is detected within "
          "about a second (set it yourself to override)");
    }
  }
}

Result<bool> ContextSupportsCuda(ucp_context_h context) {
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  const ucs_status_t s = ucp_context_query(context, &attr);
  if (s != UCS_OK) return Status::Unavailable("ucx: ucp_context_query: " + UcsError(s));
  return (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
}

}  // namespace ucx

Result<UcxOptions> UcxOptionsFromEnvironment() {
  UcxOptions o;
  if (const char* v = std::getenv("MOERUN_UCX_PUT_MIN")) {
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v, &end, 10);
    if (end == v || *end != '\0' || n == 0 || n > (1ull << 30)) {
      return Status::InvalidArgument(std::string("MOERUN_UCX_PUT_MIN must be a byte count from 1 "
                                                 "to 1073741824, not '") +
                                     v + "'");
    }
    o.put_min = static_cast<size_t>(n);
  }
  if (const char* v = std::getenv("MOERUN_UCX_SPARE_RANKS")) {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || n < 0 || n > 4096) {
      return Status::InvalidArgument(
          std::string("MOERUN_UCX_SPARE_RANKS must be a rank count from 0 to 4096, not '") + v +
          "'");
    }
    o.spare_ranks = static_cast<int>(n);
  }
  if (const char* v = std::getenv("MOERUN_UCX_PROTOCOL")) {
    const std::string p = v;
    if (p == "auto") {
      o.protocol = UcxProtocol::kAuto;
    } else if (p == "put") {
      o.protocol = UcxProtocol::kPut;
    } else if (p == "tag") {
      o.protocol = UcxProtocol::kTag;
    } else {
      return Status::InvalidArgument("MOERUN_UCX_PROTOCOL must be auto, put or tag, not '" + p +
                                     "'");
    }
  }
  return o;
}

Result<bool> UcxSupportsCudaMemory() {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) {
    return Status::Unavailable("ucx: reading UCX's configuration: " + ucx::UcsError(s));
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA;
  ucp_context_h context = nullptr;
  s = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (s != UCS_OK) return Status::Unavailable("ucx: ucp_init: " + ucx::UcsError(s));
  Result<bool> cuda = ucx::ContextSupportsCuda(context);
  ucp_cleanup(context);
  return cuda;
}

const char* UcxCudaMemoryNote(bool supported) {
  return supported
             ? "ucx: CUDA memory: registered directly"
             : "ucx: CUDA memory not supported by this UCX build: device buffers must be staged "
               "through pinned host memory";
}

}  // namespace moerun
