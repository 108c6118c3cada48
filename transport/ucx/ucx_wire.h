// The ucx transport's wire format: how its UCX tags are made (which space, which source rank,
// which channel tag) and the control notes of the put protocol (RTR, REVOKE, FIN). Internal to
// transport/ucx/; both ends of a job are built from the same source, so the layout is the
// contract (host byte order: one job runs on one architecture).
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace moerun::ucx {

constexpr uint32_t kNoteMagic = 0x52584355;  // "UCXR"
constexpr size_t kMaxRkey = 512;

// The tag spaces: eager data, and the three control notes of the put protocol.
enum Space : uint64_t { kData = 1, kRtr = 2, kRevoke = 3, kFin = 4 };
enum FinCode : uint32_t { kFinOk = 0, kFinSizeMismatch = 1, kFinRevoked = 2 };
constexpr uint32_t kRtrTemporary = 1;  // the region is registered for this message only

// Ready to receive: the receiver tells the sender where to put the bytes.
struct RtrMsg {
  uint32_t magic = kNoteMagic;
  uint32_t rkey_len = 0;
  uint64_t id = 0;  // the receiver's request id
  uint64_t bytes = 0;
  uint64_t addr = 0;
  uint64_t region = 0;  // the receiver's region uid (the sender caches its unpacked key)
  uint32_t flags = 0;
  uint32_t pad = 0;
  uint8_t rkey[kMaxRkey] = {};
};
constexpr size_t kRtrHeader = offsetof(RtrMsg, rkey);
// The receiver cancelled the receive whose RTR has this id.
struct RevokeMsg {
  uint32_t magic = kNoteMagic;
  uint32_t pad = 0;
  uint64_t id = 0;
};
// The sender's answer to an RTR: the bytes are in place, or why not.
struct FinMsg {
  uint32_t magic = kNoteMagic;
  uint32_t code = kFinOk;
  uint64_t id = 0;
  uint64_t bytes = 0;  // the sender's size
};

inline ucp_tag_t MakeTag(Space s, int src, int tag) {
  return (static_cast<uint64_t>(s) << 56) |
         (static_cast<uint64_t>(static_cast<uint32_t>(src) & 0xffffffu) << 32) |
         static_cast<uint32_t>(tag);
}
constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};
// Every message from `src`, whatever its space and tag (MakeTag's source bits only).
constexpr ucp_tag_t kSourceMask = ucp_tag_t{0xffffff} << 32;
inline ucp_tag_t SourceTag(int src) {
  return static_cast<uint64_t>(static_cast<uint32_t>(src) & 0xffffffu) << 32;
}

// A FIN is addressed to one receive (by its slot in the receiver's request table), not to the
// (peer, tag) channel: sends of one channel may finish out of order.
inline int FinTag(uint64_t receive_id) { return static_cast<int>((receive_id & 0x7fffffffu)); }

inline std::string UcsError(ucs_status_t s) { return ucs_status_string(s); }

}  // namespace moerun::ucx
