#include "runtime/serving/framed_server.h"

#include <boost/asio.hpp>
#include <boost/asio/ssl.hpp>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "base/log.h"
#include "base/peer_log.h"
#include "runtime/serving/frame.h"
#include "runtime/serving/framed_connection.h"
#include "runtime/serving/framed_server_impl.h"
#include "runtime/serving/tls_context.h"

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

using framed::Clock;
using framed::Connection;

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

void FramedServer::Impl::NoteFrameTimeout(const std::string& peer) {
  PeerLog(PeerEvent::kSlowFrame, spdlog::level::warn,
          "{}: a connection from {} did not complete a frame within {} ms; closed", opts.name, peer,
          opts.frame_timeout.count());
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
      PeerLog(PeerEvent::kConnectionCap, spdlog::level::debug,
              "{}: closing connection {} from {} to make room for a new one", opts.name, id,
              c->peer_address());
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
      PeerLog(PeerEvent::kAcceptFailed, spdlog::level::warn, "{}: accept failed: {}", opts.name,
              ec.message());
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
  const std::string where = FormatHostPort(options.listen);
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
  spdlog::info("{} listening on {}{}", options.name,
               FormatHostPort({options.listen.host, s->port_}),
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
