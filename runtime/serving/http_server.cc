#include "runtime/serving/http_server.h"

#include <spdlog/spdlog.h>

#include "base/peer_log.h"

#include <algorithm>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <exception>
#include <optional>
#include <thread>
#include <unordered_set>
#include <utility>

namespace moerun {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

constexpr uint32_t kHeaderLimit = 8 * 1024;
constexpr size_t kBufferLimit = 16 * 1024;         // the read buffer: a header plus pipelined bytes
constexpr size_t kLingerDiscardLimit = 64 * 1024;  // bytes read and dropped before a close
constexpr std::chrono::milliseconds kLingerTimeout{1000};
constexpr std::chrono::milliseconds kAcceptRetry{50};

bool IsHttpError(const beast::error_code& ec) {
  return ec.category() == beast::error_code(http::error::bad_method).category();
}

class Session;

}  // namespace

struct HttpServer::Impl {
  std::map<std::string, HttpHandler> routes;
  std::string log_name;
  HttpServerOptions options;
  std::string where;                      // "host:port", for log lines
  std::unordered_set<Session*> sessions;  // before ioc: sessions die with ioc's pending handlers
  int open = 0;                           // sessions not closed yet
  uint64_t next_seq = 0;                  // the age of a session
  asio::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  asio::steady_timer accept_retry{ioc};
  std::thread thread;

  void DoAccept();
  void OnAccept(const beast::error_code& ec, tcp::socket socket);
  bool MakeRoom();
  void CloseAll();
};

namespace {

// One connection: read a request header, answer, repeat while keep-alive; then close.
class Session : public std::enable_shared_from_this<Session> {
 public:
  // What a session is doing, for choosing one to close when the server is full.
  enum class Phase { kWaiting, kHeader, kBusy };

  Session(HttpServer::Impl* server, tcp::socket socket)
      : server_(server),
        stream_(std::move(socket)),
        buffer_(kBufferLimit),
        seq_(server->next_seq++) {
    server_->sessions.insert(this);
    ++server_->open;
  }
  ~Session() {
    server_->sessions.erase(this);
    if (!closed_) --server_->open;
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  void Start() { DoRead(); }
  void Close() {
    if (!closed_) {
      closed_ = true;
      --server_->open;
    }
    stream_.close();
  }
  bool closed() const { return closed_; }
  Phase phase() const { return phase_; }
  uint64_t seq() const { return seq_; }

 private:
  // Waits (idle_timeout) for a request's first byte, unless pipelined bytes are already here.
  void DoRead() {
    if (buffer_.size() > 0) return DoReadHeader();
    phase_ = Phase::kWaiting;
    stream_.expires_after(server_->options.idle_timeout);
    stream_.async_read_some(buffer_.prepare(kBufferLimit),
                            [self = shared_from_this()](beast::error_code ec, size_t n) {
                              if (ec) return self->Close();  // the peer's close, or idle
                              self->buffer_.commit(n);
                              self->DoReadHeader();
                            });
  }

  void DoReadHeader() {
    phase_ = Phase::kHeader;
    parser_.emplace();
    parser_->header_limit(kHeaderLimit);
    stream_.expires_after(server_->options.read_timeout);
    http::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->OnRead(ec); });
  }

  void OnRead(const beast::error_code& ec) {
    phase_ = Phase::kBusy;
    if (ec) {
      if (!IsHttpError(ec) || ec == http::error::end_of_stream ||
          ec == http::error::partial_message) {
        Close();  // a socket error, the peer's close, or the read timeout
        return;
      }
      if (ec == http::error::header_limit || ec == http::error::buffer_overflow) {
        Reply(11, false, false, 431, "request header too large\n");
      } else {
        Reply(11, false, false, 400, "bad request: " + ec.message() + "\n");
      }
      return;
    }
    const auto& req = parser_->get();
    unsigned version = req.version();
    bool head = req.method() == http::verb::head;
    if (!parser_->is_done()) {  // a Content-Length above 0 or a chunked body
      Reply(version, false, head, 413, "a request body is not accepted\n");
      return;
    }
    bool keep_alive = req.keep_alive();
    if (req.method() != http::verb::get && !head) {
      Reply(version, keep_alive, false, 405, "method not allowed; use GET or HEAD\n",
            "text/plain; charset=utf-8", true);
      return;
    }
    beast::string_view target = req.target();
    std::string path(target.substr(0, std::min(target.find('?'), target.find('#'))));
    auto it = server_->routes.find(path);
    if (it == server_->routes.end()) {
      Reply(version, keep_alive, head, 404, "not found: " + path + "\n");
      return;
    }
    HttpReply reply = Invoke(it->second, path);
    Reply(version, keep_alive, head, reply.status, std::move(reply.body),
          std::move(reply.content_type));
  }

  HttpReply Invoke(const HttpHandler& handler, const std::string& path) {
    HttpReply reply;
    try {
      reply = handler();
    } catch (const std::exception& e) {
      PeerLog(PeerEvent::kHttpRequest, spdlog::level::warn, "{}: handler for {} threw: {}",
              server_->log_name, path, e.what());
      return {500, "text/plain; charset=utf-8", std::string(e.what()) + "\n"};
    } catch (...) {
      PeerLog(PeerEvent::kHttpRequest, spdlog::level::warn,
              "{}: handler for {} threw a non-standard exception", server_->log_name, path);
      return {500, "text/plain; charset=utf-8", "unknown exception\n"};
    }
    if (reply.status < 100 || reply.status > 999 ||
        reply.content_type.find_first_of("\r\n") != std::string::npos) {
      PeerLog(PeerEvent::kHttpRequest, spdlog::level::warn,
              "{}: handler for {} returned status {} or a bad content type", server_->log_name,
              path, reply.status);
      return {500, "text/plain; charset=utf-8", "handler returned an invalid reply\n"};
    }
    return reply;
  }

  void Reply(unsigned version, bool keep_alive, bool head, int status, std::string body,
             std::string content_type = "text/plain; charset=utf-8", bool allow = false) {
    res_.emplace();
    res_->version(version == 10 ? 10 : 11);
    res_->result(static_cast<unsigned>(status));
    res_->set(http::field::server, "moerun");
    res_->set(http::field::content_type, content_type);
    if (allow) res_->set(http::field::allow, "GET, HEAD");
    res_->keep_alive(keep_alive);
    size_t size = body.size();
    if (!head) res_->body() = std::move(body);
    res_->content_length(size);  // HEAD: the length a GET would get, and no body
    stream_.expires_after(server_->options.read_timeout);
    http::async_write(stream_, *res_,
                      [self = shared_from_this(), keep_alive](beast::error_code ec, size_t) {
                        self->OnWrite(ec, keep_alive);
                      });
  }

  void OnWrite(const beast::error_code& ec, bool keep_alive) {
    res_.reset();
    if (ec) {
      Close();
      return;
    }
    if (keep_alive) {
      DoRead();
      return;
    }
    // Lingering close: stop sending, then read and drop what the client still sends (bounded in
    // bytes and time), so that closing does not reset the connection before it read the reply.
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    buffer_.consume(buffer_.size());
    stream_.expires_after(
        std::min<std::chrono::milliseconds>(kLingerTimeout, server_->options.read_timeout));
    DoLinger();
  }

  void DoLinger() {
    stream_.async_read_some(asio::buffer(discard_),
                            [self = shared_from_this()](beast::error_code ec, size_t n) {
                              self->discarded_ += n;
                              if (ec || self->discarded_ > kLingerDiscardLimit) {
                                self->Close();
                              } else {
                                self->DoLinger();
                              }
                            });
  }

  HttpServer::Impl* server_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::empty_body>> parser_;
  std::optional<http::response<http::string_body>> res_;
  char discard_[1024];
  size_t discarded_ = 0;
  const uint64_t seq_;
  Phase phase_ = Phase::kWaiting;
  bool closed_ = false;
};

}  // namespace

void HttpServer::Impl::DoAccept() {
  acceptor.async_accept(
      [this](const beast::error_code& ec, tcp::socket socket) { OnAccept(ec, std::move(socket)); });
}

void HttpServer::Impl::OnAccept(const beast::error_code& ec, tcp::socket socket) {
  if (!acceptor.is_open() || ec == asio::error::operation_aborted) return;
  if (ec) {
    // Out of file descriptors and the like: wait a little instead of spinning.
    PeerLog(PeerEvent::kAcceptFailed, spdlog::level::warn, "{}: accept on {} failed: {}", log_name,
            where, ec.message());
    accept_retry.expires_after(kAcceptRetry);
    accept_retry.async_wait([this](const beast::error_code& wait_ec) {
      if (!wait_ec && acceptor.is_open()) DoAccept();
    });
    return;
  }
  if (open >= options.max_connections && !MakeRoom()) {
    beast::error_code ignored;
    socket.close(ignored);
  } else {
    std::make_shared<Session>(this, std::move(socket))->Start();
  }
  DoAccept();
}

bool HttpServer::Impl::MakeRoom() {
  // The oldest session waiting for a request; else the oldest reading one's header.
  for (Session::Phase phase : {Session::Phase::kWaiting, Session::Phase::kHeader}) {
    Session* oldest = nullptr;
    for (Session* s : sessions) {
      if (!s->closed() && s->phase() == phase && (!oldest || s->seq() < oldest->seq())) oldest = s;
    }
    if (oldest != nullptr) {
      oldest->Close();
      return true;
    }
  }
  return false;
}

void HttpServer::Impl::CloseAll() {
  beast::error_code ignored;
  acceptor.close(ignored);
  accept_retry.cancel();
  for (Session* s : sessions) s->Close();
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(); }

Result<std::unique_ptr<HttpServer>> HttpServer::Start(const HostPort& where,
                                                      std::map<std::string, HttpHandler> routes,
                                                      std::string log_name,
                                                      HttpServerOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->routes = std::move(routes);
  impl->log_name = std::move(log_name);
  impl->options = options;
  if (impl->options.read_timeout.count() <= 0 || impl->options.idle_timeout.count() <= 0 ||
      impl->options.max_connections <= 0) {
    return Status::InvalidArgument(
        "http server " + impl->log_name +
        ": read_timeout, idle_timeout and max_connections must be positive");
  }
  std::string address = FormatHostPort(where);

  beast::error_code ec;
  tcp::resolver resolver(impl->ioc);
  auto endpoints = resolver.resolve(where.host, std::to_string(where.port),
                                    tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || endpoints.empty()) {
    return Status::InvalidArgument("cannot listen on " + address + ": cannot resolve host \"" +
                                   where.host + "\": " + (ec ? ec.message() : "no address"));
  }
  tcp::endpoint endpoint = endpoints.begin()->endpoint();
  tcp::acceptor& acceptor = impl->acceptor;
  auto fail = [&](const char* what) {
    return Status::IoError("cannot listen on " + address + ": " + what + ": " + ec.message());
  };
  if (acceptor.open(endpoint.protocol(), ec)) return fail("socket");
  if (acceptor.set_option(asio::socket_base::reuse_address(true), ec)) return fail("SO_REUSEADDR");
  if (acceptor.bind(endpoint, ec)) return fail("bind");
  if (acceptor.listen(asio::socket_base::max_listen_connections, ec)) return fail("listen");
  tcp::endpoint bound = acceptor.local_endpoint(ec);
  if (ec) return fail("getsockname");

  impl->where = FormatHostPort({where.host, bound.port()});
  spdlog::info("{} listening on http://{}", impl->log_name, impl->where);
  impl->DoAccept();
  Impl* raw = impl.get();
  raw->thread = std::thread([raw] {
    for (;;) {
      try {
        raw->ioc.run();
        return;
      } catch (const std::exception& e) {  // handlers catch their own; this is a last resort
        spdlog::error("{}: http server loop: {}", raw->log_name, e.what());
      }
    }
  });
  std::unique_ptr<HttpServer> server(new HttpServer(std::move(impl)));
  server->port_ = bound.port();
  return server;
}

void HttpServer::Stop() {
  std::lock_guard lock(stop_mu_);
  if (stopped_) return;
  stopped_ = true;
  if (!impl_->thread.joinable()) return;
  Impl* raw = impl_.get();
  asio::post(raw->ioc, [raw] {
    raw->CloseAll();
    raw->ioc.stop();  // pending handlers (and their sessions) are destroyed with the io_context
  });
  raw->thread.join();
}

}  // namespace moerun
