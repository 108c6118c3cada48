// One connection of a FramedServer (runtime/serving/framed_server.h says what it guarantees): reads
// frames as their bytes arrive and charges them to the budgets, writes answers in order, and
// keeps the timers of the first frame, the idle wait, a frame in progress and a stalled write;
// over TLS when the server has it. I/O thread only.
#pragma once

#include "runtime/serving/framed_server_impl.h"  // first: it includes what Boost.Asio needs

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/serving/frame.h"
#include "runtime/serving/handler_memory.h"
#include "runtime/serving/tls_context.h"

namespace moerun::framed {

namespace asio = boost::asio;
using asio::ip::tcp;
using moerun::v1::ErrorCode;

class Connection : public FramedConnection, public std::enable_shared_from_this<Connection> {
 public:
  Connection(FramedServer::Impl* srv, tcp::socket socket, uint64_t id, std::string peer);

  void Start();
  // For a connection refused at accept: counted under its peer until it closes.
  void JoinPeerOnly() { peer_held_ = srv_->JoinPeer(peer_); }

  void Send(std::string frame) override;
  void Send(PooledBuffer buffer, size_t offset, size_t size) override;
  void Pause() override { paused_ = true; }
  void Resume() override;
  // Reads the next frame unless paused, closing, or the client is not reading its answers.
  void MaybeRead();
  bool WriteBlocked() const { return queued_ > WriteLimit(); }
  // Answers queued beyond this stop the reading of new frames (one answer of any size still
  // goes out; this memory is outside the request budget, so it is kept small).
  static constexpr size_t WriteLimit() { return size_t{4} << 20; }
  void CloseAfterWrites() override {
    closing_ = true;
    if (writes_count_ == 0) Close();
  }
  bool open() const override { return open_; }
  uint64_t id() const override { return id_; }
  const std::string& peer_address() const override { return peer_; }
  void MarkTrusted() override;
  bool trusted() const override { return trusted_; }
  uint64_t frames() const { return frames_; }
  // Nothing started, nothing held, nothing to write: waiting for the client's next frame.
  bool Waiting() const {
    return open_ && !closing_ && held == 0 && writes_count_ == 0 &&
           (wait_ == Wait::kFirstFrame || wait_ == Wait::kIdle);
  }
  // Holds nothing for the client (it may be in the middle of sending a frame).
  bool Quiet() const { return open_ && !closing_ && held == 0 && writes_count_ == 0; }

  void Close();

 private:
  // What the connection's timer guards.
  enum class Wait : uint8_t { kNone, kFirstFrame, kIdle, kFrame };

  void Refuse(ErrorCode code, const std::string& message, bool close, uint64_t request_id = 0) {
    Send(srv_->handlers.error_frame(code, message, request_id));
    if (close) CloseAfterWrites();
  }

  // The request id that the body's bytes so far carry (0 if unknown).
  uint64_t FrameId(size_t bytes) const {
    if (!srv_->handlers.frame_id || body_.empty() || bytes == 0) return 0;
    return srv_->handlers.frame_id(std::string_view(body_.data(), bytes));
  }

  // A read ended: false if the connection is done reading (closed by the peer, or closing).
  bool ReadOk(const boost::system::error_code& ec);

  void ReadHeader();

  void ReadHeaderMore();

  // Sets what the timer guards, from now. The timer is re-armed only when the new deadline is
  // earlier than the one it waits for; otherwise it fires first and waits for the rest.
  void Expect(Wait w);

  void ArmTimer();

  void OnTimer();

  void OnHeader(uint32_t len);

  // Over TLS, bytes may already wait inside OpenSSL, which the socket cannot be asked about: the
  // first chunk is read into scratch space, then a buffer fitting it is taken.
  void ReadFirstChunk();

  void ReadBody();

  void FrameDone();

  // A chunk did not fit the budget: drop the frame (its id kept for the refusal) and the bytes
  // it held, read the rest of its body into scratch space, then say OVERLOADED.
  void OverBudget(size_t just_read);

  void Discard(uint32_t left);
  // A frame waiting to be written: a string, or bytes of a pooled buffer.
  struct OutFrame {
    std::string text;
    PooledBuffer buffer;
    size_t offset = 0, size = 0;
    const char* data() const { return buffer.empty() ? text.data() : buffer.data() + offset; }
  };

  // The write queue is a ring that grows when full (no allocation once it is large enough).
  void Queue(OutFrame f);
  OutFrame& Front() { return writes_[writes_head_]; }
  void PopFront();

  void WriteNext();

  // One read of what has arrived, through TLS when the connection has it.
  template <typename Buffer, typename Handler>
  void ReadSome(const Buffer& buffer, Handler&& handler) {
    if (tls_) {
      tls_->async_read_some(buffer, std::forward<Handler>(handler));
    } else {
      socket_.async_read_some(buffer, std::forward<Handler>(handler));
    }
  }

  FramedServer::Impl* srv_;
  tcp::socket socket_;
  std::unique_ptr<asio::ssl::stream<tcp::socket&>> tls_;  // over socket_, with options.tls
  asio::steady_timer timer_, write_timer_;
  const uint64_t id_;
  const std::string peer_;  // the peer's address
  std::shared_ptr<std::atomic<int64_t>> peer_held_;
  uint8_t header_[kFrameHeaderBytes] = {};
  size_t have_ = 0;
  size_t want_ = 0, got_ = 0;  // the body: its announced length, what arrived
  PooledBuffer body_;
  BudgetLease body_lease_;
  uint64_t discard_id_ = 0;  // the id of a frame being dropped
  uint64_t frames_ = 0;      // frames read
  Wait wait_ = Wait::kNone;
  Clock::time_point deadline_{}, timer_at_{};
  bool timer_armed_ = false, trusted_ = false, discarding_ = false;
  char scratch_[16384];
  std::vector<OutFrame> writes_;  // ring: writes_count_ frames from writes_head_
  size_t writes_head_ = 0, writes_count_ = 0;
  size_t queued_ = 0;  // bytes in writes_
  HandlerMemory read_mem_, write_mem_, timer_mem_, write_timer_mem_;
  uint64_t timer_gen_ = 0, write_gen_ = 0;
  bool open_ = true, reading_ = false, paused_ = false, closing_ = false, read_eof_ = false;
};

}  // namespace moerun::framed
