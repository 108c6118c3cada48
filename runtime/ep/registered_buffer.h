// Buffers that transfers land in or leave from, registered with the transport (RDMA backends
// write them directly; for others registration is a no-op). Registration happens only when a
// buffer grows, never per batch.
#pragma once

#include <cstddef>

#include "base/aligned_buffer.h"
#include "transport/transport.h"

namespace moerun {

// Grows `b` to at least `bytes` (contents not kept); a new allocation is registered with `t`
// and the old one unregistered before it is freed.
inline Status ReserveRegistered(Transport* t, AlignedBuffer& b, size_t bytes) {
  if (bytes <= b.size()) return Status::Ok();
  if (b.data() != nullptr) t->UnregisterMemory(b.data());
  b.Reserve(bytes);
  return t->RegisterMemory(b.data(), b.size());
}

// Unregisters `b` (before it is freed or handed elsewhere).
inline void Unregister(Transport* t, AlignedBuffer& b) {
  if (b.data() != nullptr) t->UnregisterMemory(b.data());
}

}  // namespace moerun
