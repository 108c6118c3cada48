// The ucx transport's environment: the UCX settings it makes before UCX reads its configuration
// (UCX_MM_ERROR_HANDLING, UCX_KEEPALIVE_INTERVAL), what it reads from UCX_TLS, and whether a UCX
// context handles CUDA memory. Internal to transport/ucx/ (the public functions of this duty,
// UcxOptionsFromEnvironment, UcxSupportsCudaMemory and UcxCudaMemoryNote, are declared in
// ucx_transport.h). Not thread-safe where it sets variables: called while a transport opens.
#pragma once

#include <ucp/api/ucp.h>

#include "base/status.h"

namespace moerun::ucx {

// Whether UCX_TLS lets UCX use its shared-memory transports (where UCX_MM_ERROR_HANDLING
// matters; elsewhere UCX would warn that the variable is unused).
bool SharedMemoryMayBeUsed();

// Whether UCX_TLS names TCP and nothing else but self (then UCX has no hardware put).
bool TcpOnly();

// Sets UCX_MM_ERROR_HANDLING=y (where shared memory may be used) and UCX_KEEPALIVE_INTERVAL=1s
// unless the user set them; logs each setting it made when `loud`.
void SetUcxEnvironmentDefaults(bool loud);

// Whether a context's UCX handles CUDA memory (ucp_context_query's memory types).
Result<bool> ContextSupportsCuda(ucp_context_h context);

}  // namespace moerun::ucx
