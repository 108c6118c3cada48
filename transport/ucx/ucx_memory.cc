#include "transport/ucx/ucx_memory.h"

#include <string>

#include "transport/ucx/ucx_wire.h"

namespace moerun::ucx {

const Region* UcxRegistrations::Find(const void* p, size_t bytes) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (const Region& r : regions_) {
    if (a >= r.base && a + bytes <= r.base + r.len) return &r;
  }
  return nullptr;
}

Result<Region> UcxRegistrations::Map(void* p, size_t bytes) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = p;
  mp.length = bytes;
  Region r;
  ucs_status_t s = ucp_mem_map(context_, &mp, &r.memh);
  if (s != UCS_OK) {
    return Status::Unavailable("ucx: registering " + std::to_string(bytes) +
                               " bytes: " + UcsError(s));
  }
  void* packed = nullptr;
  size_t len = 0;
  s = ucp_rkey_pack(context_, r.memh, &packed, &len);
  if (s != UCS_OK || len > kMaxRkey) {
    if (s == UCS_OK) ucp_rkey_buffer_release(packed);
    ucp_mem_unmap(context_, r.memh);
    return Status::Unavailable(s != UCS_OK ? "ucx: packing a remote key: " + UcsError(s)
                                           : "ucx: a remote key of " + std::to_string(len) +
                                                 " bytes (at most " + std::to_string(kMaxRkey) +
                                                 " supported)");
  }
  r.packed.assign(static_cast<uint8_t*>(packed), static_cast<uint8_t*>(packed) + len);
  ucp_rkey_buffer_release(packed);
  r.base = reinterpret_cast<uintptr_t>(p);
  r.len = bytes;
  r.uid = next_uid_++;
  registrations_.fetch_add(1, std::memory_order_relaxed);
  return r;
}

Status UcxRegistrations::Register(void* p, size_t bytes) {
  if (p == nullptr || bytes == 0 || Find(p, bytes) != nullptr) return Status::Ok();
  const auto a = reinterpret_cast<uintptr_t>(p);
  for (size_t i = 0; i < regions_.size();) {  // overlapped registrations are stale
    const Region& r = regions_[i];
    if (r.base < a + bytes && a < r.base + r.len) {
      ucp_mem_unmap(context_, r.memh);
      regions_.erase(regions_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  MOERUN_ASSIGN_OR_RETURN(Region r, Map(p, bytes));
  regions_.push_back(std::move(r));
  return Status::Ok();
}

void UcxRegistrations::Unregister(void* p) {
  for (size_t i = 0; i < regions_.size(); ++i) {
    if (regions_[i].base == reinterpret_cast<uintptr_t>(p)) {
      ucp_mem_unmap(context_, regions_[i].memh);
      regions_.erase(regions_.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
  }
}

void UcxRegistrations::UnmapAll() {
  for (const Region& r : regions_) ucp_mem_unmap(context_, r.memh);
  regions_.clear();
}

Result<ucp_rkey_h> UnpackRemoteKey(ucp_ep_h ep, int peer, const void* packed) {
  ucp_rkey_h rkey = nullptr;
  const ucs_status_t s = ucp_ep_rkey_unpack(ep, packed, &rkey);
  if (s != UCS_OK) {
    return Status::Unavailable("ucx: unpacking rank " + std::to_string(peer) +
                               "'s remote key: " + UcsError(s));
  }
  return rkey;
}

void UcxRemoteKeys::Resize(size_t peers) {
  keys_.resize(peers);
  for (auto& m : keys_) m.reserve(64);
}

ucp_rkey_h UcxRemoteKeys::Find(int peer, uint64_t region) const {
  const auto& m = keys_[static_cast<size_t>(peer)];
  auto it = m.find(region);
  return it != m.end() ? it->second : nullptr;
}

void UcxRemoteKeys::Add(int peer, uint64_t region, ucp_rkey_h rkey) {
  keys_[static_cast<size_t>(peer)].emplace(region, rkey);
}

void UcxRemoteKeys::DropPeer(int peer) {
  auto& m = keys_[static_cast<size_t>(peer)];
  for (auto& [uid, rkey] : m) ucp_rkey_destroy(rkey);
  m.clear();
}

void UcxRemoteKeys::DropAll() {
  for (size_t p = 0; p < keys_.size(); ++p) DropPeer(static_cast<int>(p));
}

}  // namespace moerun::ucx
