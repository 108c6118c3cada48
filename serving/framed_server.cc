#include "serving/framed_server.h"

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "base/log.h"
#include "serving/frame.h"
#include "serving/tls_context.h"

namespace moerun {

namespace asio = boost::asio;
using asio::ip::tcp;
using moerun::v1::ErrorCode;

BudgetLease& BudgetLease::operator=(BudgetLease&& o) noexcept {
  if (this != &o) {
    Release();
    pool_ = o.pool_;
    peer_ = std::move(o.peer_);
    bytes_ = o.bytes_;
    o.pool_ = nullptr;
  }
  return *this;
}

bool BudgetLease::TryGrow(int64_t n, int64_t peer_limit) {
  if (pool_ == nullptr || n < 0) return false;
  if (pool_->fetch_sub(n) < n) {
    pool_->fetch_add(n);
    return false;
  }
  if (peer_ && peer_->fetch_add(n) + n > peer_limit) {
    peer_->fetch_sub(n);
    pool_->fetch_add(n);
    return false;
  }
  bytes_ += n;
  return true;
}

void BudgetLease::Release() {
  if (pool_ != nullptr) {
    pool_->fetch_add(bytes_);
    if (peer_) peer_->fetch_sub(bytes_);
  }
  pool_ = nullptr;
  peer_.reset();
  bytes_ = 0;
}

namespace {
class Connection;
using Clock = std::chrono::steady_clock;
// The first chunk of a frame's body; later ones double what arrived.
constexpr size_t kFirstChunk = 64 << 10;
}  // namespace

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
  asio::io_context io{1};
  // Keeps the I/O thread running while nothing is pending (a deferred accept); Stop ends it.
  asio::executor_work_guard<asio::io_context::executor_type> keep_running{io.get_executor()};
  tcp::acceptor acceptor{io};
  std::thread thread;
  uint64_t next_id = 1;
  // Open connections by id, so oldest first (I/O thread only).
  std::map<uint64_t, std::weak_ptr<Connection>> conns;
  // Per peer address: the bytes its connections hold (shared with their leases, which may
  // outlive the entry) and how many connections it has open (I/O thread only).
  struct Peer {
    std::shared_ptr<std::atomic<int64_t>> held;
    int connections = 0;
  };
  std::unordered_map<std::string, Peer> peers;

  void Accept();
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

namespace {

class Connection : public FramedConnection, public std::enable_shared_from_this<Connection> {
 public:
  Connection(FramedServer::Impl* srv, tcp::socket socket, uint64_t id, std::string peer)
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

  void Start() {
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
                              spdlog::debug("{}: connection {} from {}: TLS handshake failed: {}",
                                            srv_->opts.name, id_, peer_, e.message());
                              return Close();
                            }
                            ReadHeader();
                          }));
  }
  // For a connection refused at accept: counted under its peer until it closes.
  void JoinPeerOnly() { peer_held_ = srv_->JoinPeer(peer_); }

  void Send(std::string frame) override {
    if (!open_) return;
    OutFrame f;
    f.text = std::move(frame);
    f.size = f.text.size();
    Queue(std::move(f));
  }
  void Send(PooledBuffer buffer, size_t offset, size_t size) override {
    if (!open_) return;
    OutFrame f;
    f.buffer = std::move(buffer);
    f.offset = offset;
    f.size = size;
    Queue(std::move(f));
  }
  void Pause() override { paused_ = true; }
  void Resume() override {
    if (!paused_) return;
    paused_ = false;
    MaybeRead();
  }
  // Reads the next frame unless paused, closing, or the client is not reading its answers.
  void MaybeRead() {
    if (open_ && !reading_ && !closing_ && !read_eof_ && !paused_ && !WriteBlocked()) {
      ReadHeader();
    }
  }
  bool WriteBlocked() const { return queued_ > WriteLimit(); }
  size_t WriteLimit() const {
    return std::max<size_t>(size_t{16} << 20, srv_->opts.max_frame_bytes);
  }
  void CloseAfterWrites() override {
    closing_ = true;
    if (writes_count_ == 0) Close();
  }
  bool open() const override { return open_; }
  uint64_t id() const override { return id_; }
  const std::string& peer_address() const override { return peer_; }
  void MarkTrusted() override {
    if (trusted_ || !open_) return;
    trusted_ = true;
    ++srv_->trusted_open;
  }
  bool trusted() const override { return trusted_; }
  uint64_t frames() const { return frames_; }
  // Nothing started, nothing held, nothing to write: waiting for the client's next frame.
  bool Waiting() const {
    return open_ && !closing_ && held == 0 && writes_count_ == 0 &&
           (wait_ == Wait::kFirstFrame || wait_ == Wait::kIdle);
  }
  // Holds nothing for the client (it may be in the middle of sending a frame).
  bool Quiet() const { return open_ && !closing_ && held == 0 && writes_count_ == 0; }

  void Close() {
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
  bool ReadOk(const boost::system::error_code& ec) {
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

  void ReadHeader() {
    if (!open_ || closing_ || paused_ || read_eof_ || WriteBlocked()) return;
    reading_ = true;
    have_ = 0;
    Expect(frames_ == 0 ? Wait::kFirstFrame : Wait::kIdle);
    ReadHeaderMore();
  }

  void ReadHeaderMore() {
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

  // Sets what the timer guards, from now. The timer is re-armed only when the new deadline is
  // earlier than the one it waits for; otherwise it fires first and waits for the rest.
  void Expect(Wait w) {
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

  void ArmTimer() {
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

  void OnTimer() {
    if (wait_ == Wait::kNone) return;
    if (Clock::now() < deadline_) return ArmTimer();
    const FramedServerOptions& o = srv_->opts;
    if (wait_ != Wait::kFrame) {
      // Answers still owed (or being written): not idle; wait again.
      if (held > 0 || writes_count_ > 0) return Expect(Wait::kIdle);
      spdlog::debug("{}: connection {} sent no frame within {} ms; closing", o.name, id_,
                    (wait_ == Wait::kIdle ? o.idle_timeout : o.first_frame_timeout).count());
      return Close();
    }
    spdlog::warn("{}: connection {} did not complete a frame within {} ms; closing", o.name, id_,
                 o.frame_timeout.count());
    const uint64_t request_id = discarding_ ? discard_id_ : FrameId(got_);
    wait_ = Wait::kNone;
    reading_ = false;
    closing_ = true;
    body_lease_.Release();  // the buffer stays until Close: the pending read may still use it
    boost::system::error_code ignored;
    socket_.shutdown(tcp::socket::shutdown_receive, ignored);  // ends the pending read
    Send(srv_->handlers.error_frame(
        ErrorCode::FRAME_TIMEOUT,
        "frame not completed within " + std::to_string(o.frame_timeout.count()) + " ms",
        request_id));
  }

  void OnHeader(uint32_t len) {
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

  // Over TLS, bytes may already wait inside OpenSSL, which the socket cannot be asked about: the
  // first chunk is read into scratch space, then a buffer fitting it is taken.
  void ReadFirstChunk() {
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

  void ReadBody() {
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

  void FrameDone() {
    Expect(Wait::kNone);
    reading_ = false;
    ++frames_;
    srv_->handlers.on_frame(shared_from_this(), std::move(body_), std::move(body_lease_));
    MaybeRead();
  }

  // A chunk did not fit the budget: drop the frame (its id kept for the refusal) and the bytes
  // it held, read the rest of its body into scratch space, then say OVERLOADED.
  void OverBudget(size_t just_read) {
    discard_id_ = FrameId(got_ + just_read);
    discarding_ = true;
    const size_t left = want_ - got_ - just_read;
    body_.Release();
    body_lease_.Release();
    Discard(static_cast<uint32_t>(left));
  }

  void Discard(uint32_t left) {
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
  // A frame waiting to be written: a string, or bytes of a pooled buffer.
  struct OutFrame {
    std::string text;
    PooledBuffer buffer;
    size_t offset = 0, size = 0;
    const char* data() const { return buffer.empty() ? text.data() : buffer.data() + offset; }
  };

  // The write queue is a ring that grows when full (no allocation once it is large enough).
  void Queue(OutFrame f) {
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
  OutFrame& Front() { return writes_[writes_head_]; }
  void PopFront() {
    Front() = OutFrame{};
    writes_head_ = (writes_head_ + 1) % writes_.size();
    --writes_count_;
  }

  void WriteNext() {
    auto self = shared_from_this();
    const uint64_t gen = ++write_gen_;
    write_timer_.expires_after(srv_->opts.write_timeout);
    write_timer_.async_wait(
        WithMemory(&write_timer_mem_, [this, self, gen](const boost::system::error_code& ec) {
          if (ec || !open_ || gen != write_gen_) return;
          spdlog::warn("{}: connection {} did not read its answers for {} ms; closing",
                       srv_->opts.name, id_, srv_->opts.write_timeout.count());
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

}  // namespace

std::string FramedServer::Impl::BusiestPeer() const {
  const std::string* best = nullptr;
  int most = 1;
  for (const auto& [address, p] : peers) {
    if (p.connections > most) {
      most = p.connections;
      best = &address;
    }
  }
  return best ? *best : std::string();
}

bool FramedServer::Impl::MakeRoom(const std::string* only) {
  // After a scan that found nothing to close, refuse without scanning for a while: a flood of
  // connections against a cap of busy ones must not cost a scan of every connection each.
  const auto now = Clock::now();
  if (only == nullptr && now < no_room_until) return false;
  // The oldest untrusted connection that has sent nothing yet; else the oldest untrusted one
  // that waits quietly between frames; else the oldest untrusted one that holds nothing for its
  // client (it may be sending a frame).
  for (int pass = 0; pass < 3; ++pass) {
    for (auto& [id, w] : conns) {
      auto c = w.lock();
      if (!c || c->trusted() || (only != nullptr && c->peer_address() != *only)) continue;
      const bool pick = pass == 0   ? c->Waiting() && c->frames() == 0
                        : pass == 1 ? c->Waiting()
                                    : c->Quiet();
      if (!pick) continue;
      spdlog::debug("{}: closing connection {} to make room for a new one", opts.name, id);
      c->Close();
      return true;
    }
  }
  if (only == nullptr) no_room_until = now + std::chrono::milliseconds(10);
  return false;
}

void FramedServer::Impl::Accept() {
  acceptor.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (ec) {
      if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
      // Out of descriptors and the like: log, back off a little, go on.
      spdlog::warn("{}: accept failed: {}", opts.name, ec.message());
      auto t = std::make_shared<asio::steady_timer>(io, std::chrono::milliseconds(50));
      t->async_wait([this, t](const boost::system::error_code&) {
        if (acceptor.is_open()) Accept();
      });
      return;
    }
    const uint64_t id = next_id++;
    boost::system::error_code pe;
    const tcp::endpoint remote = socket.remote_endpoint(pe);
    std::string peer = pe ? std::string("?") : remote.address().to_string();
    auto c = std::make_shared<Connection>(this, std::move(socket), id, std::move(peer));
    const auto full = [this] {
      return open.load() >= opts.max_connections || open.load() - trusted_open >= untrusted_limit;
    };
    const auto peer_full = [this, &c] {
      if (opts.max_connections_per_peer <= 0) return false;
      const auto it = peers.find(c->peer_address());
      return it != peers.end() && it->second.connections >= opts.max_connections_per_peer;
    };
    // Room is made first at the address that holds the most connections, so that a flood from
    // one address pushes out its own connections before anyone else's.
    const auto make_room = [this] {
      const std::string busiest = BusiestPeer();
      return (!busiest.empty() && MakeRoom(&busiest)) || MakeRoom();
    };
    std::string why;
    if (peer_full() && !(MakeRoom(&c->peer_address()) && !peer_full())) {
      why = "too many connections from " + c->peer_address() + " (" +
            std::to_string(opts.max_connections_per_peer) + ")";
    } else if (full() && !(make_room() && !full())) {
      why = "too many connections (" + std::to_string(opts.max_connections) + ")";
    }
    if (!why.empty()) {
      ++open;  // Forget() takes it back when the refused connection closes
      conns.emplace(id, c);
      c->JoinPeerOnly();
      if (opts.tls) {
        c->Close();  // no TLS session yet to say why in
      } else {
        c->Send(handlers.error_frame(ErrorCode::OVERLOADED, why, 0));
        c->CloseAfterWrites();
      }
    } else {
      conns.emplace(id, c);
      const int n = ++open;
      if (handlers.on_connections) handlers.on_connections(n);
      c->Start();
    }
    Accept();
  });
}

FramedServer::FramedServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<FramedServer>> FramedServer::Start(const FramedServerOptions& options,
                                                          FramedHandlers handlers) {
  if (!handlers.on_frame || !handlers.error_frame) {
    return Status::InvalidArgument("framed server: handlers missing");
  }
  auto impl = std::make_unique<Impl>();
  impl->opts = options;
  impl->handlers = std::move(handlers);
  impl->budget = options.max_buffered_bytes;
  impl->peer_limit = options.max_buffered_bytes_per_peer > 0 ? options.max_buffered_bytes_per_peer
                                                             : options.max_buffered_bytes / 2;
  impl->untrusted_limit = options.max_untrusted_connections > 0
                              ? std::min(options.max_untrusted_connections, options.max_connections)
                              : options.max_connections;
  if (options.frame_timeout.count() <= 0 || options.first_frame_timeout.count() <= 0 ||
      options.idle_timeout.count() <= 0 || options.max_connections <= 0) {
    return Status::InvalidArgument(options.name +
                                   ": timeouts and max_connections must be positive");
  }
  const std::string where = options.listen.host + ":" + std::to_string(options.listen.port);
  boost::system::error_code ec;
  const auto addr = asio::ip::make_address(options.listen.host, ec);
  if (ec) {
    return Status::InvalidArgument(options.name + ": bad listen address '" + options.listen.host +
                                   "': " + ec.message());
  }
  const tcp::endpoint ep(addr, options.listen.port);
  impl->acceptor.open(ep.protocol(), ec);
  if (!ec) impl->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(ep, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Status::Unavailable(options.name + ": cannot listen on " + where + ": " + ec.message());
  }
  std::unique_ptr<FramedServer> s(new FramedServer(std::move(impl)));
  s->port_ = s->impl_->acceptor.local_endpoint().port();
  Impl* raw = s->impl_.get();
  if (!options.defer_accept) raw->Accept();
  raw->thread = std::thread([raw] {
    for (;;) {
      try {
        raw->io.run();
        return;
      } catch (const std::exception& e) {
        spdlog::error("{}: handler failed: {}", raw->opts.name, e.what());
      }
    }
  });
  spdlog::info("{} listening on {}:{}{}", options.name, options.listen.host, s->port_,
               options.tls ? " with " + options.tls->description() : std::string());
  return s;
}

FramedServer::~FramedServer() { Stop(); }

boost::asio::io_context& FramedServer::io() { return impl_->io; }

int FramedServer::connections() const { return impl_->open.load(); }

BufferPool& FramedServer::buffers() { return impl_->buffers; }

HandlerMemory* FramedServer::NewHandlerMemory() {
  std::lock_guard<std::mutex> lock(impl_->handler_memory_mu);
  return &impl_->handler_memory.emplace_back();
}

bool FramedServer::TryLease(int64_t bytes, BudgetLease* lease) {
  const int64_t left = impl_->budget.fetch_sub(bytes);
  if (left < bytes) {
    impl_->budget.fetch_add(bytes);
    return false;
  }
  *lease = BudgetLease(&impl_->budget, bytes);
  return true;
}

void FramedServer::StartAccepting() {
  Impl* raw = impl_.get();
  asio::post(raw->io, [raw] { raw->Accept(); });
}

void FramedServer::StopAccepting() {
  Impl* raw = impl_.get();
  asio::post(raw->io, [raw] {
    boost::system::error_code ec;
    raw->acceptor.close(ec);
  });
}

void FramedServer::Stop() {
  Impl* raw = impl_.get();
  if (raw->stopped.exchange(true)) return;
  // First let every connection finish writing what it was given (a drain's last answers), for
  // up to 2 s; then close whatever is left and end the I/O thread.
  asio::post(raw->io, [raw] {
    boost::system::error_code ec;
    raw->acceptor.close(ec);
    auto conns = raw->conns;
    for (auto& [id, w] : conns) {
      if (auto c = w.lock()) c->CloseAfterWrites();
    }
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (raw->open.load() > 0 && std::chrono::steady_clock::now() < until &&
         raw->thread.joinable()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  asio::post(raw->io, [raw] {
    auto conns = raw->conns;
    for (auto& [id, w] : conns) {
      if (auto c = w.lock()) c->Close();
    }
    raw->io.stop();
  });
  if (raw->thread.joinable()) raw->thread.join();
}

}  // namespace moerun
