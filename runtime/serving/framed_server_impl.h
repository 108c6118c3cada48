// FramedServer's inside, shared by framed_server.cc (accepting, capacity, budgets) and
// framed_connection.cc (one connection's reads, writes and timers). Not part of the interface.
#pragma once

// (first: Boost 1.74's Asio headers need what it brings, <utility>, before them)
#include "runtime/serving/framed_server.h"

#include <atomic>
#include <boost/asio.hpp>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

namespace moerun {

namespace framed {
class Connection;
using Clock = std::chrono::steady_clock;
// The first chunk of a frame's body; later ones double what arrived.
constexpr size_t kFirstChunk = 64 << 10;
}  // namespace framed

struct FramedServer::Impl {
  FramedServerOptions opts;
  FramedHandlers handlers;
  int64_t peer_limit = 0;  // bytes the connections of one address may hold
  int untrusted_limit = 0;
  // Declared before io: handlers destroyed with io may still give bytes back to the budget.
  std::atomic<int64_t> budget{0};
  std::atomic<int> open{0};
  int trusted_open = 0;  // I/O thread only
  std::atomic<bool> stopped{false};
  BufferPool buffers;                        // before io: buffers held by handlers go back here
  std::deque<HandlerMemory> handler_memory;  // before io: operations it holds may use it
  std::mutex handler_memory_mu;
  boost::asio::io_context io{1};
  // Keeps the I/O thread running while nothing is pending (a deferred accept); Stop ends it.
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> keep_running{
      io.get_executor()};
  boost::asio::ip::tcp::acceptor acceptor{io};
  std::thread thread;
  uint64_t next_id = 1;
  // Open connections by id, so oldest first (I/O thread only).
  std::map<uint64_t, std::weak_ptr<framed::Connection>> conns;
  // Per peer address: the bytes its connections hold (shared with their leases, which may
  // outlive the entry) and how many connections it has open (I/O thread only).
  struct Peer {
    std::shared_ptr<std::atomic<int64_t>> held;
    int connections = 0;
  };
  std::unordered_map<std::string, Peer> peers;

  void Accept();
  // A connection of `peer` did not complete a frame in time: one warning for the first of a
  // quiet period, then one summary per 10 s (a flood of trickling clients cannot flood the log).
  void NoteFrameTimeout(const std::string& peer);
  // Closes one untrusted connection to admit a new one: of address `only` when given.
  bool MakeRoom(const std::string* only = nullptr);
  // The address with the most open connections ("" if none has more than one).
  std::string BusiestPeer() const;
  std::chrono::steady_clock::time_point no_room_until{};
  std::shared_ptr<std::atomic<int64_t>> JoinPeer(const std::string& key) {
    Peer& p = peers[key];
    if (!p.held) p.held = std::make_shared<std::atomic<int64_t>>(0);
    ++p.connections;
    return p.held;
  }
  void Forget(uint64_t id, const std::string& peer, bool trusted) {
    if (conns.erase(id) > 0) {
      if (trusted) --trusted_open;
      auto it = peers.find(peer);
      if (it != peers.end() && --it->second.connections <= 0) peers.erase(it);
      const int n = --open;
      if (handlers.on_connections) handlers.on_connections(n);
    }
  }
};

}  // namespace moerun
