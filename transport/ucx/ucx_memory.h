// The ucx transport's memory: the regions registered with UCX (ucp_mem_map) and their packed
// remote keys, on the receiving side; and the cache of peers' unpacked remote keys, on the
// sending side. Internal to transport/ucx/. Thread-safety: none, except the registrations
// counter, which any thread may read.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "base/status.h"

namespace moerun::ucx {

// A registered region and its remote key, as an RTR carries it.
struct Region {
  uintptr_t base = 0;
  size_t len = 0;
  ucp_mem_h memh = nullptr;
  uint64_t uid = 0;             // unique for the transport's life (the senders' cache key)
  std::vector<uint8_t> packed;  // the remote key
};

// The regions of RegisterMemory, kept mapped until UnregisterMemory or UnmapAll.
class UcxRegistrations {
 public:
  void set_context(ucp_context_h context) { context_ = context; }
  // Registers [p, p + bytes) unless a region holds it already; regions it overlaps are stale
  // and unmapped.
  Status Register(void* p, size_t bytes);
  // Unmaps the region that starts at p, if any.
  void Unregister(void* p);
  // The region holding [p, p + bytes), or null.
  const Region* Find(const void* p, size_t bytes) const;
  // Maps [p, p + bytes) and packs its remote key, without keeping it (the caller unmaps its
  // memh with Unmap): a region for one message. Counted as a registration.
  Result<Region> Map(void* p, size_t bytes);
  void Unmap(ucp_mem_h memh) { ucp_mem_unmap(context_, memh); }
  void UnmapAll();
  // Every ucp_mem_map so far (kept regions and one-message ones).
  uint64_t registrations() const { return registrations_.load(std::memory_order_relaxed); }

 private:
  ucp_context_h context_ = nullptr;
  std::vector<Region> regions_;
  uint64_t next_uid_ = 1;
  std::atomic<uint64_t> registrations_{0};
};

// Unpacks a peer's remote key on its endpoint ("ucx: unpacking rank N's remote key: ...").
Result<ucp_rkey_h> UnpackRemoteKey(ucp_ep_h ep, int peer, const void* packed);

// Per peer, the unpacked remote keys of its kept regions, by region uid. The keys belong to the
// peer's endpoint: drop them (DropPeer) before it closes.
class UcxRemoteKeys {
 public:
  void Resize(size_t peers);
  // The cached key of (peer, region), or null.
  ucp_rkey_h Find(int peer, uint64_t region) const;
  void Add(int peer, uint64_t region, ucp_rkey_h rkey);
  void DropPeer(int peer);
  void DropAll();

 private:
  std::vector<std::unordered_map<uint64_t, ucp_rkey_h>> keys_;
};

}  // namespace moerun::ucx
