#include "serving/framed_server.h"

#include <boost/asio.hpp>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "base/log.h"
#include "serving/frame.h"

namespace moerun {

namespace asio = boost::asio;
using asio::ip::tcp;
using moerun::v1::ErrorCode;

BudgetLease& BudgetLease::operator=(BudgetLease&& o) noexcept {
  if (this != &o) {
    Release();
    pool_ = o.pool_;
    bytes_ = o.bytes_;
    o.pool_ = nullptr;
  }
  return *this;
}

void BudgetLease::Release() {
  if (pool_ != nullptr) pool_->fetch_add(bytes_);
  pool_ = nullptr;
}

namespace {
class Connection;
}

struct FramedServer::Impl {
  FramedServerOptions opts;
  FramedHandlers handlers;
  // Declared before io: handlers destroyed with io may still give bytes back to the budget.
  std::atomic<int64_t> budget{0};
  std::atomic<int> open{0};
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
  std::unordered_map<uint64_t, std::weak_ptr<Connection>> conns;  // I/O thread only

  void Accept();
  void Forget(uint64_t id) {
    if (conns.erase(id) > 0) {
      const int n = --open;
      if (handlers.on_connections) handlers.on_connections(n);
    }
  }
};

namespace {

class Connection : public FramedConnection, public std::enable_shared_from_this<Connection> {
 public:
  Connection(FramedServer::Impl* srv, tcp::socket socket, uint64_t id)
      : srv_(srv), socket_(std::move(socket)), timer_(srv->io), write_timer_(srv->io), id_(id) {}

  void Start() {
    boost::system::error_code ec;
    socket_.set_option(tcp::no_delay(true), ec);
    ReadHeader();
  }

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

  void Close() {
    if (!open_) return;
    open_ = false;
    boost::system::error_code ec;
    StopFrameTimer();
    ++write_gen_;
    write_timer_.cancel();
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    srv_->Forget(id_);
  }

 private:
  void Refuse(ErrorCode code, const std::string& message, bool close) {
    Send(srv_->handlers.error_frame(code, message));
    if (close) CloseAfterWrites();
  }

  // A read ended: false if the connection is done reading (closed by the peer, or closing).
  bool ReadOk(const boost::system::error_code& ec) {
    if (!open_ || closing_) return false;
    if (ec == asio::error::eof && have_ == 0 && srv_->handlers.on_read_closed) {
      // The client finished sending (half close): it may still read the answers in flight.
      StopFrameTimer();
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
    ReadHeaderMore();
  }

  void ReadHeaderMore() {
    auto self = shared_from_this();
    socket_.async_read_some(
        asio::buffer(header_ + have_, kFrameHeaderBytes - have_),
        WithMemory(&read_mem_, [this, self](const boost::system::error_code& ec, size_t n) {
          if (!ReadOk(ec)) return;
          if (have_ == 0 && n > 0) ArmFrameTimer();
          have_ += n;
          if (have_ < kFrameHeaderBytes) return ReadHeaderMore();
          OnHeader(GetFrameLength(header_));
        }));
  }

  void StopFrameTimer() {
    ++frame_gen_;
    timer_.cancel();
  }

  void ArmFrameTimer() {
    const uint64_t gen = ++frame_gen_;
    timer_.expires_after(srv_->opts.frame_timeout);
    auto self = shared_from_this();
    timer_.async_wait(WithMemory(&timer_mem_, [this, self,
                                               gen](const boost::system::error_code& ec) {
      // A handler already queued when its frame completed must not close the connection.
      if (ec || !open_ || !reading_ || gen != frame_gen_) return;
      spdlog::warn("{}: connection {} did not complete a frame within {} ms; closing",
                   srv_->opts.name, id_, srv_->opts.frame_timeout.count());
      reading_ = false;
      closing_ = true;
      boost::system::error_code ignored;
      socket_.shutdown(tcp::socket::shutdown_receive, ignored);  // ends the pending read
      Send(srv_->handlers.error_frame(
          ErrorCode::FRAME_TIMEOUT, "frame not completed within " +
                                        std::to_string(srv_->opts.frame_timeout.count()) + " ms"));
    }));
  }

  void OnHeader(uint32_t len) {
    if (len > srv_->opts.max_frame_bytes) {
      StopFrameTimer();
      reading_ = false;
      return Refuse(ErrorCode::FRAME_TOO_LARGE,
                    "frame of " + std::to_string(len) + " bytes is over the limit of " +
                        std::to_string(srv_->opts.max_frame_bytes),
                    true);
    }
    const int64_t left = srv_->budget.fetch_sub(len);
    if (left < static_cast<int64_t>(len)) {
      srv_->budget.fetch_add(len);
      return Discard(len);
    }
    body_lease_ = BudgetLease(&srv_->budget, len);
    body_ = srv_->buffers.Take(len);
    auto self = shared_from_this();
    asio::async_read(
        socket_, asio::buffer(body_.data(), body_.size()),
        WithMemory(&read_mem_, [this, self](const boost::system::error_code& ec, size_t) {
          if (!ReadOk(ec)) return;
          StopFrameTimer();
          reading_ = false;
          srv_->handlers.on_frame(self, std::move(body_), std::move(body_lease_));
          MaybeRead();
        }));
  }

  // Over the byte budget: read the body into scratch space, drop it, say OVERLOADED.
  void Discard(uint32_t left) {
    if (left == 0) {
      StopFrameTimer();
      reading_ = false;
      Refuse(ErrorCode::OVERLOADED, "the server holds too many request bytes; retry later", false);
      return MaybeRead();
    }
    auto self = shared_from_this();
    const size_t n = std::min<size_t>(left, sizeof scratch_);
    asio::async_read(
        socket_, asio::buffer(scratch_, n),
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
    asio::async_write(
        socket_, asio::buffer(Front().data(), Front().size),
        WithMemory(&write_mem_, [this, self](const boost::system::error_code& ec, size_t) {
          ++write_gen_;
          write_timer_.cancel();
          if (ec || !open_) return Close();
          const bool was_blocked = WriteBlocked();
          queued_ -= Front().size;
          PopFront();
          if (was_blocked && !WriteBlocked()) MaybeRead();
          if (writes_count_ > 0) return WriteNext();
          if (closing_) Close();
        }));
  }

  FramedServer::Impl* srv_;
  tcp::socket socket_;
  asio::steady_timer timer_, write_timer_;
  const uint64_t id_;
  uint8_t header_[kFrameHeaderBytes] = {};
  size_t have_ = 0;
  PooledBuffer body_;
  BudgetLease body_lease_;
  char scratch_[16384];
  std::vector<OutFrame> writes_;  // ring: writes_count_ frames from writes_head_
  size_t writes_head_ = 0, writes_count_ = 0;
  size_t queued_ = 0;  // bytes in writes_
  HandlerMemory read_mem_, write_mem_, timer_mem_, write_timer_mem_;
  uint64_t frame_gen_ = 0, write_gen_ = 0;
  bool open_ = true, reading_ = false, paused_ = false, closing_ = false, read_eof_ = false;
};

}  // namespace

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
    auto c = std::make_shared<Connection>(this, std::move(socket), id);
    if (open.load() >= opts.max_connections) {
      ++open;  // Forget() takes it back when the refused connection closes
      conns.emplace(id, c);
      c->Send(handlers.error_frame(
          ErrorCode::OVERLOADED,
          "too many connections (" + std::to_string(opts.max_connections) + ")"));
      c->CloseAfterWrites();
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
  spdlog::info("{} listening on {}:{}", options.name, options.listen.host, s->port_);
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
