// A TCP server of length-prefixed frames on Boost.Asio: what the serving and the control
// endpoints share. A frame is a 4-byte big-endian length, then that many bytes (one Protobuf
// message); see runtime/serving/frame.h.
//
// What a client can make the server hold is what it has sent. A frame's length is checked
// against max_frame_bytes when its header arrives (else FRAME_TOO_LARGE and the connection is
// closed), but nothing is reserved for it then: its body is read in chunks as it arrives, into a
// buffer that grows by doubling (first 64 KiB, at most twice what arrived, at most the announced
// length), and every chunk is charged to a byte budget when it arrives: the server's
// (max_buffered_bytes, across all connections) and the peer address's
// (max_buffered_bytes_per_peer). A chunk over either budget drops the frame: the rest of its
// body is read into a small scratch buffer and dropped, and the client gets OVERLOADED carrying
// the request's id when the handler can read one from the bytes that arrived (frame_id); the
// connection stays usable.
//
// Timeouts: a new connection must start its first frame within first_frame_timeout, and a
// connection between frames must start its next one within idle_timeout unless it waits for
// answers (the handler holds requests of it, or answers are being written); else it is closed
// quietly. A frame once started must complete within frame_timeout (else FRAME_TIMEOUT, with the
// request's id where readable, and close: a client that trickles bytes cannot hold a connection).
//
// Capacity: at most max_connections, and at most max_untrusted_connections that the handler has
// not marked trusted (FramedConnection::MarkTrusted, e.g. once authenticated), and at most
// max_connections_per_peer from one peer address. A new connection past a cap closes, to make
// room, one untrusted connection (of the same address for the per-address cap; else of the
// address that holds the most connections, then of any address): the oldest that has sent nothing
// yet, else the oldest untrusted one that waits quietly between frames (nothing held, nothing to
// write), else the oldest untrusted one that holds nothing; only when there is none is the new
// connection refused (OVERLOADED and close). So a flood of
// silent or unauthenticated connections pushes out its own kind, never trusted ones, and a new
// client always gets in. A client that does not read its answers stops being read once 4 MiB of
// answers wait for it (one answer may be larger), and is closed when a write makes no progress
// for write_timeout. Stop lets queued answers go out (up to 2 s).
//
// TLS: with options.tls, every connection is TLS (1.2 or newer) and carries the same frames inside
// it. The handshake must complete within first_frame_timeout; a connection refused at accept is
// closed without a word (no TLS session to say it in).
//
// Threads: everything runs on one I/O thread. Handlers run on it and must not block; work for
// other threads is handed off, and its results come back posted to io().
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "base/status.h"
#include "moerun/v1/serving.pb.h"
#include "runtime/serving/buffer_pool.h"
#include "runtime/serving/handler_memory.h"
#include "runtime/serving/host_port.h"

namespace boost::asio {
class io_context;
}

namespace moerun {

class TlsServerContext;

struct FramedServerOptions {
  HostPort listen;
  std::string name = "server";  // for logs
  uint32_t max_frame_bytes = 64u << 20;
  int max_connections = 4096;
  // A frame, once its first byte arrived, must complete within this.
  std::chrono::milliseconds frame_timeout{10000};
  // A new connection must start its first frame within this.
  std::chrono::milliseconds first_frame_timeout{10000};
  // Between frames, with no answer owed, a connection must start its next frame within this.
  std::chrono::milliseconds idle_timeout{60000};
  // A write that makes no progress for this long closes the connection (a client that stopped
  // reading its answers).
  std::chrono::milliseconds write_timeout{30000};
  int64_t max_buffered_bytes = int64_t{1} << 30;
  // Request bytes that the connections of one peer address may hold at once (0: half of
  // max_buffered_bytes), so that one address cannot take the whole budget.
  int64_t max_buffered_bytes_per_peer = 0;
  // Connections not marked trusted (0: max_connections).
  int max_untrusted_connections = 0;
  // Connections from one peer address (0: no cap of its own).
  int max_connections_per_peer = 0;
  // TLS on every connection (runtime/serving/tls_context.h); null: plain TCP.
  std::shared_ptr<TlsServerContext> tls;
  // Listen, but accept connections only once StartAccepting is called (a handler that must set
  // itself up after Start, knowing the I/O context, sees no frame before it is ready).
  bool defer_accept = false;
};

// Bytes taken from the server's budget (and from a peer address's, when it has one), given back
// when the lease is destroyed. Thread-safety: one owner at a time; the budgets are atomics, so a
// lease may be released on any thread.
class BudgetLease {
 public:
  BudgetLease() = default;
  BudgetLease(std::atomic<int64_t>* pool, int64_t bytes) : pool_(pool), bytes_(bytes) {}
  // An empty lease on both budgets, grown by TryGrow.
  BudgetLease(std::atomic<int64_t>* pool, std::shared_ptr<std::atomic<int64_t>> peer)
      : pool_(pool), peer_(std::move(peer)) {}
  BudgetLease(BudgetLease&& o) noexcept
      : pool_(o.pool_), peer_(std::move(o.peer_)), bytes_(o.bytes_) {
    o.pool_ = nullptr;
  }
  BudgetLease& operator=(BudgetLease&& o) noexcept;
  BudgetLease(const BudgetLease&) = delete;
  BudgetLease& operator=(const BudgetLease&) = delete;
  ~BudgetLease() { Release(); }
  // Takes `n` more bytes if they fit both in the pool (what is left of it) and in the peer's
  // budget (at most `peer_limit` held); else takes nothing and returns false.
  bool TryGrow(int64_t n, int64_t peer_limit);
  void Release();
  int64_t bytes() const { return pool_ ? bytes_ : 0; }

 private:
  std::atomic<int64_t>* pool_ = nullptr;        // what is left of the server's budget
  std::shared_ptr<std::atomic<int64_t>> peer_;  // what the peer address holds (may be null)
  int64_t bytes_ = 0;
};

class FramedConnection {
 public:
  virtual ~FramedConnection() = default;
  // Queues a whole frame (length prefix included) for writing. I/O thread only.
  virtual void Send(std::string frame) = 0;
  // Queues the frame at bytes [offset, offset + size) of `buffer` (written in place there, e.g.
  // an answer after its header); the buffer goes back to its pool once written. I/O thread only.
  virtual void Send(PooledBuffer buffer, size_t offset, size_t size) = 0;
  // Stops / restarts reading new frames (a connection's in-flight limit). I/O thread only.
  virtual void Pause() = 0;
  virtual void Resume() = 0;
  // Closes once queued frames are written. I/O thread only.
  virtual void CloseAfterWrites() = 0;
  virtual bool open() const = 0;
  virtual uint64_t id() const = 0;
  // The peer's IP address as text ("127.0.0.1", "::1"; "?" if it could not be read).
  virtual const std::string& peer_address() const = 0;
  // Marks the connection trusted (e.g. it authenticated): it no longer counts against
  // max_untrusted_connections and is never closed to make room. I/O thread only.
  virtual void MarkTrusted() = 0;
  virtual bool trusted() const = 0;

  // The handler's bookkeeping of this connection (I/O thread only): requests it holds, and
  // whether to close once they are answered.
  int held = 0;
  bool close_when_answered = false;
};

struct FramedHandlers {
  // A whole frame's body arrived (in a buffer of the server's pool); `lease` holds its bytes in
  // the budget (keep it as long as the body is held). The connection may be kept (shared_ptr) to
  // answer later.
  std::function<void(const std::shared_ptr<FramedConnection>&, PooledBuffer body,
                     BudgetLease lease)>
      on_frame;
  // The protocol's error frame (length prefix included) for the server's own refusals; `id` is
  // the refused request's (from frame_id), or 0 when unknown.
  std::function<std::string(moerun::v1::ErrorCode code, const std::string& message, uint64_t id)>
      error_frame;
  // The request id that the first bytes of a frame's body carry, or 0 if they do not say (the
  // bytes may be cut anywhere). Optional: without it, refusals carry 0.
  std::function<uint64_t(std::string_view body_prefix)> frame_id;
  // The client closed its sending side with no frame half-read; the connection stays open for
  // the answers in flight (the handler closes it with CloseAfterWrites once they are sent).
  // Optional: without it, the connection closes at once.
  std::function<void(const std::shared_ptr<FramedConnection>&)> on_read_closed;
  // Connection count changes (metrics); optional.
  std::function<void(int open_connections)> on_connections;
};

class FramedServer {
 public:
  static Result<std::unique_ptr<FramedServer>> Start(const FramedServerOptions& options,
                                                     FramedHandlers handlers);
  ~FramedServer();

  uint16_t port() const { return port_; }
  // The I/O thread's context (handlers' timers, and their work posted from other threads).
  boost::asio::io_context& io();
  // Takes `bytes` from the budget, if they fit.
  bool TryLease(int64_t bytes, BudgetLease* lease);
  // The pool the frame bodies come from; handlers take their answers' buffers from it too.
  BufferPool& buffers();
  // Memory for a handler's own asynchronous operations on io() (runtime/serving/handler_memory.h),
  // valid as long as the server: it outlives every operation the I/O context still holds.
  HandlerMemory* NewHandlerMemory();
  // With options.defer_accept: starts accepting connections (any thread, once).
  void StartAccepting();
  // Stops accepting new connections (any thread).
  void StopAccepting();
  // Closes every connection and joins the I/O thread (any thread but the I/O thread);
  // idempotent.
  void Stop();
  int connections() const;

  struct Impl;

 private:
  explicit FramedServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  uint16_t port_ = 0;
};

}  // namespace moerun
