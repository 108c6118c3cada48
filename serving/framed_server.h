// A TCP server of length-prefixed frames on Boost.Asio: what the serving and the control
// endpoints share. A frame is a 4-byte big-endian length, then that many bytes (one Protobuf
// message); see serving/frame.h.
//
// The server enforces, before anything is allocated: a frame length at most max_frame_bytes
// (else FRAME_TOO_LARGE and the connection is closed), a budget of bytes held by frames being
// read or handled across all connections (else OVERLOADED: the body is read into a small scratch
// buffer and dropped, the connection stays usable), at most max_connections (else OVERLOADED and
// close), and a frame once started must complete within frame_timeout (else FRAME_TIMEOUT and
// close: a client that trickles bytes cannot hold a connection forever). Idle connections
// between frames are kept. A client that does not read its answers stops being read once 16 MiB
// (or one maximal frame) of answers wait for it, and is closed when a write makes no progress
// for write_timeout. Stop lets queued answers go out (up to 2 s).
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

#include "base/status.h"
#include "moerun/v1/serving.pb.h"
#include "serving/buffer_pool.h"
#include "serving/handler_memory.h"
#include "serving/host_port.h"

namespace boost::asio {
class io_context;
}

namespace moerun {

struct FramedServerOptions {
  HostPort listen;
  std::string name = "server";  // for logs
  uint32_t max_frame_bytes = 64u << 20;
  int max_connections = 4096;
  std::chrono::milliseconds frame_timeout{10000};
  // A write that makes no progress for this long closes the connection (a client that stopped
  // reading its answers).
  std::chrono::milliseconds write_timeout{30000};
  int64_t max_buffered_bytes = int64_t{1} << 30;
  // Listen, but accept connections only once StartAccepting is called (a handler that must set
  // itself up after Start, knowing the I/O context, sees no frame before it is ready).
  bool defer_accept = false;
};

// Bytes taken from the server's budget, given back when the lease is destroyed.
class BudgetLease {
 public:
  BudgetLease() = default;
  BudgetLease(std::atomic<int64_t>* pool, int64_t bytes) : pool_(pool), bytes_(bytes) {}
  BudgetLease(BudgetLease&& o) noexcept : pool_(o.pool_), bytes_(o.bytes_) { o.pool_ = nullptr; }
  BudgetLease& operator=(BudgetLease&& o) noexcept;
  BudgetLease(const BudgetLease&) = delete;
  BudgetLease& operator=(const BudgetLease&) = delete;
  ~BudgetLease() { Release(); }
  void Release();
  int64_t bytes() const { return pool_ ? bytes_ : 0; }

 private:
  std::atomic<int64_t>* pool_ = nullptr;
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
  // The protocol's error frame (length prefix included) for the server's own refusals.
  std::function<std::string(moerun::v1::ErrorCode code, const std::string& message)> error_frame;
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
  // Memory for a handler's own asynchronous operations on io() (serving/handler_memory.h),
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
