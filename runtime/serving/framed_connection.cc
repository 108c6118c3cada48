#include "runtime/serving/framed_connection.h"

#include <algorithm>
#include <cstring>

#include "base/log.h"
#include "base/peer_log.h"

namespace moerun::framed {

Connection::Connection(FramedServer::Impl* srv, tcp::socket socket, uint64_t id, std::string peer)
    : srv_(srv),
      socket_(std::move(socket)),
      timer_(srv->io),
      write_timer_(srv->io),
      id_(id),
      peer_(std::move(peer)) {
  if (srv->opts.tls) {
    tls_ = std::make_unique<asio::ssl::stream<tcp::socket&>>(socket_, srv->opts.tls->native());
  }
}

void Connection::Start() {
  peer_held_ = srv_->JoinPeer(peer_);
  boost::system::error_code ec;
  socket_.set_option(tcp::no_delay(true), ec);
  if (!tls_) return ReadHeader();
  // The handshake must end within the first frame's timeout (the timer closes it otherwise).
  Expect(Wait::kFirstFrame);
  auto self = shared_from_this();
  tls_->async_handshake(asio::ssl::stream_base::server,
                        WithMemory(&read_mem_, [this, self](const boost::system::error_code& e) {
                          if (!open_) return;
                          if (e) {
                            PeerLog(PeerEvent::kTlsHandshake, spdlog::level::debug,
                                    "{}: connection {} from {}: TLS handshake failed: {}",
                                    srv_->opts.name, id_, peer_, e.message());
                            return Close();
                          }
                          ReadHeader();
                        }));
}

void Connection::Send(std::string frame) {
  if (!open_) return;
  OutFrame f;
  f.text = std::move(frame);
  f.size = f.text.size();
  Queue(std::move(f));
}

void Connection::Send(PooledBuffer buffer, size_t offset, size_t size) {
  if (!open_) return;
  OutFrame f;
  f.buffer = std::move(buffer);
  f.offset = offset;
  f.size = size;
  Queue(std::move(f));
}

void Connection::Resume() {
  if (!paused_) return;
  paused_ = false;
  MaybeRead();
}

void Connection::MaybeRead() {
  if (open_ && !reading_ && !closing_ && !read_eof_ && !paused_ && !WriteBlocked()) {
    ReadHeader();
  }
}

void Connection::MarkTrusted() {
  if (trusted_ || !open_) return;
  trusted_ = true;
  ++srv_->trusted_open;
}

void Connection::Close() {
  if (!open_) return;
  open_ = false;
  boost::system::error_code ec;
  wait_ = Wait::kNone;
  ++timer_gen_;
  timer_.cancel();
  ++write_gen_;
  write_timer_.cancel();
  socket_.shutdown(tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  body_.Release();
  body_lease_.Release();
  srv_->Forget(id_, peer_, trusted_);
}

bool Connection::ReadOk(const boost::system::error_code& ec) {
  if (!open_ || closing_) return false;
  // (Over TLS, a client that half-closes without close_notify reads as a truncated stream.)
  const bool eof = ec == asio::error::eof || (tls_ && ec == asio::ssl::error::stream_truncated);
  if (eof && have_ == 0 && srv_->handlers.on_read_closed) {
    // The client finished sending (half close): it may still read the answers in flight.
    Expect(Wait::kNone);
    reading_ = false;
    read_eof_ = true;
    srv_->handlers.on_read_closed(shared_from_this());
    return false;
  }
  if (ec) {
    Close();
    return false;
  }
  return true;
}

void Connection::ReadHeader() {
  if (!open_ || closing_ || paused_ || read_eof_ || WriteBlocked()) return;
  reading_ = true;
  have_ = 0;
  Expect(frames_ == 0 ? Wait::kFirstFrame : Wait::kIdle);
  ReadHeaderMore();
}

void Connection::ReadHeaderMore() {
  auto self = shared_from_this();
  ReadSome(asio::buffer(header_ + have_, kFrameHeaderBytes - have_),
           WithMemory(&read_mem_, [this, self](const boost::system::error_code& ec, size_t n) {
             if (!ReadOk(ec)) return;
             if (have_ == 0 && n > 0) Expect(Wait::kFrame);
             have_ += n;
             if (have_ < kFrameHeaderBytes) return ReadHeaderMore();
             OnHeader(GetFrameLength(header_));
           }));
}

void Connection::Expect(Wait w) {
  wait_ = w;
  if (w == Wait::kNone) return;
  const FramedServerOptions& o = srv_->opts;
  const auto d = w == Wait::kFrame  ? o.frame_timeout
                 : w == Wait::kIdle ? o.idle_timeout
                                    : o.first_frame_timeout;
  deadline_ = Clock::now() + d;
  if (timer_armed_ && timer_at_ <= deadline_) return;
  ArmTimer();
}

void Connection::ArmTimer() {
  timer_armed_ = true;
  timer_at_ = deadline_;
  const uint64_t gen = ++timer_gen_;
  timer_.expires_at(deadline_);  // a wait still pending ends with operation_aborted
  auto self = shared_from_this();
  timer_.async_wait(WithMemory(&timer_mem_, [this, self, gen](const boost::system::error_code&) {
    if (gen != timer_gen_) return;  // re-armed or closed meanwhile
    timer_armed_ = false;
    if (open_) OnTimer();
  }));
}

void Connection::OnTimer() {
  if (wait_ == Wait::kNone) return;
  if (Clock::now() < deadline_) return ArmTimer();
  const FramedServerOptions& o = srv_->opts;
  if (wait_ != Wait::kFrame) {
    // Answers still owed (or being written): not idle; wait again.
    if (held > 0 || writes_count_ > 0) return Expect(Wait::kIdle);
    PeerLog(PeerEvent::kSlowFrame, spdlog::level::debug,
            "{}: connection {} from {} sent no frame within {} ms; closing", o.name, id_, peer_,
            (wait_ == Wait::kIdle ? o.idle_timeout : o.first_frame_timeout).count());
    return Close();
  }
  srv_->NoteFrameTimeout(peer_);
  const uint64_t request_id = discarding_ ? discard_id_ : FrameId(got_);
  wait_ = Wait::kNone;
  reading_ = false;
  closing_ = true;
  body_lease_.Release();  // the buffer stays until Close: the pending read may still use it
  boost::system::error_code ignored;
  socket_.shutdown(tcp::socket::shutdown_receive, ignored);  // ends the pending read
  Send(srv_->handlers.error_frame(
      ErrorCode::FRAME_TIMEOUT,
      "frame not completed within " + std::to_string(o.frame_timeout.count()) + " ms", request_id));
}

void Connection::OnHeader(uint32_t len) {
  if (len > srv_->opts.max_frame_bytes) {
    Expect(Wait::kNone);
    reading_ = false;
    return Refuse(ErrorCode::FRAME_TOO_LARGE,
                  "frame of " + std::to_string(len) + " bytes is over the limit of " +
                      std::to_string(srv_->opts.max_frame_bytes),
                  true);
  }
  // Nothing is reserved for the announced length: bytes are charged as they arrive.
  want_ = len;
  got_ = 0;
  body_lease_ = BudgetLease(&srv_->budget, peer_held_);
  if (len == 0) {
    body_ = srv_->buffers.Take(0);
    return FrameDone();
  }
  if (tls_) return ReadFirstChunk();
  boost::system::error_code ec;
  if (socket_.available(ec) > 0 && !ec) return ReadBody();
  // No body byte yet: wait for one before taking a buffer.
  auto self = shared_from_this();
  socket_.async_wait(tcp::socket::wait_read,
                     WithMemory(&read_mem_, [this, self](const boost::system::error_code& e) {
                       if (!ReadOk(e)) return;
                       ReadBody();
                     }));
}

void Connection::ReadFirstChunk() {
  auto self = shared_from_this();
  ReadSome(asio::buffer(scratch_, std::min(want_, sizeof scratch_)),
           WithMemory(&read_mem_, [this, self](const boost::system::error_code& ec, size_t n) {
             if (!ReadOk(ec)) return;
             body_ = srv_->buffers.Take(std::min<size_t>(want_, std::max(kFirstChunk, 2 * n)));
             std::memcpy(body_.data(), scratch_, n);
             if (!body_lease_.TryGrow(static_cast<int64_t>(n), srv_->peer_limit)) {
               return OverBudget(n);
             }
             got_ = n;
             if (got_ < want_) return ReadBody();
             FrameDone();
           }));
}

void Connection::ReadBody() {
  if (got_ == body_.size()) {
    // The buffer is full: grow it, to at most twice what arrived (and the announced length).
    const size_t cap = std::min<size_t>(want_, std::max(kFirstChunk, 2 * got_));
    PooledBuffer bigger = srv_->buffers.Take(cap);
    if (got_ > 0) std::memcpy(bigger.data(), body_.data(), got_);
    body_ = std::move(bigger);
  }
  auto self = shared_from_this();
  ReadSome(asio::buffer(body_.data() + got_, body_.size() - got_),
           WithMemory(&read_mem_, [this, self](const boost::system::error_code& ec, size_t n) {
             if (!ReadOk(ec)) return;
             if (!body_lease_.TryGrow(static_cast<int64_t>(n), srv_->peer_limit)) {
               return OverBudget(n);
             }
             got_ += n;
             if (got_ < want_) return ReadBody();
             FrameDone();
           }));
}

void Connection::FrameDone() {
  Expect(Wait::kNone);
  reading_ = false;
  ++frames_;
  srv_->handlers.on_frame(shared_from_this(), std::move(body_), std::move(body_lease_));
  MaybeRead();
}

void Connection::OverBudget(size_t just_read) {
  discard_id_ = FrameId(got_ + just_read);
  discarding_ = true;
  const size_t left = want_ - got_ - just_read;
  body_.Release();
  body_lease_.Release();
  Discard(static_cast<uint32_t>(left));
}

void Connection::Discard(uint32_t left) {
  if (left == 0) {
    Expect(Wait::kNone);
    reading_ = false;
    discarding_ = false;
    ++frames_;
    Refuse(ErrorCode::OVERLOADED, "the server holds too many request bytes; retry later", false,
           discard_id_);
    return MaybeRead();
  }
  auto self = shared_from_this();
  const size_t n = std::min<size_t>(left, sizeof scratch_);
  ReadSome(
      asio::buffer(scratch_, n),
      WithMemory(&read_mem_, [this, self, left](const boost::system::error_code& ec, size_t got) {
        if (!ReadOk(ec)) return;
        Discard(left - static_cast<uint32_t>(got));
      }));
}

void Connection::Queue(OutFrame f) {
  if (writes_count_ == writes_.size()) {
    std::vector<OutFrame> bigger(std::max<size_t>(8, writes_.size() * 2));
    for (size_t i = 0; i < writes_count_; ++i) {
      bigger[i] = std::move(writes_[(writes_head_ + i) % writes_.size()]);
    }
    writes_ = std::move(bigger);
    writes_head_ = 0;
  }
  queued_ += f.size;
  writes_[(writes_head_ + writes_count_) % writes_.size()] = std::move(f);
  if (++writes_count_ == 1) WriteNext();
}

void Connection::PopFront() {
  Front() = OutFrame{};
  writes_head_ = (writes_head_ + 1) % writes_.size();
  --writes_count_;
}

void Connection::WriteNext() {
  auto self = shared_from_this();
  const uint64_t gen = ++write_gen_;
  write_timer_.expires_after(srv_->opts.write_timeout);
  write_timer_.async_wait(
      WithMemory(&write_timer_mem_, [this, self, gen](const boost::system::error_code& ec) {
        if (ec || !open_ || gen != write_gen_) return;
        PeerLog(PeerEvent::kSlowReader, spdlog::level::warn,
                "{}: connection {} from {} did not read its answers for {} ms; closing",
                srv_->opts.name, id_, peer_, srv_->opts.write_timeout.count());
        Close();
      }));
  auto done = WithMemory(&write_mem_, [this, self](const boost::system::error_code& ec, size_t) {
    ++write_gen_;
    write_timer_.cancel();
    if (ec || !open_) return Close();
    const bool was_blocked = WriteBlocked();
    queued_ -= Front().size;
    PopFront();
    if (was_blocked && !WriteBlocked()) MaybeRead();
    if (writes_count_ > 0) return WriteNext();
    if (closing_) Close();
  });
  const auto buf = asio::buffer(Front().data(), Front().size);
  if (tls_) {
    asio::async_write(*tls_, buf, std::move(done));
  } else {
    asio::async_write(socket_, buf, std::move(done));
  }
}

}  // namespace moerun::framed
