// Buffers of sends that could not be withdrawn (Transport::can_withdraw_sends is false: mpi, and
// ucx sends already started) may still be read by the peer: they are kept until the process
// ends instead of being freed under the transport. One place for every owner of such buffers
// (PeerHealth's probes and strands, the shutdown header, an expert rank's results and pongs).
// Thread-safe.
#pragma once

#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

namespace moerun {

// Keeps `value` (moved in; heap buffers inside it keep their addresses) alive for the process.
template <typename T>
void ParkForProcess(T&& value) {
  using V = std::decay_t<T>;
  static std::mutex mu;
  static std::vector<V> parked;
  std::lock_guard<std::mutex> lock(mu);
  parked.push_back(std::forward<T>(value));
}

}  // namespace moerun
