// A small HTTP/1.x server (Boost.Beast) for /metrics, /healthz and similar read-only endpoints.
//
// GET and HEAD only (anything else: 405 with "Allow: GET, HEAD"); routes are exact paths, the
// query string is ignored; unknown paths get 404. Keep-alive on HTTP/1.1 (and 1.0 when asked).
// Requests carry no body (one gets 413, then the connection is closed); headers are limited to
// 8 KiB (431, then close); garbage gets 400, then close. A connection (new or kept alive) that
// sends no byte of a request within idle_timeout is closed, and one that does not deliver a
// whole request within read_timeout of its first byte too.
//
// Capacity: at most max_connections. A new connection past the cap closes the oldest connection
// that waits for a request (idle keep-alive, or a new one that sent nothing), else the oldest
// that is reading a request's header, to make room; only when every connection is busy answering
// is the new one closed at once. So floods of keep-alive or silent connections cannot keep a
// health probe out: a probe that sends its request at once is answered.
//
// Thread-safety: the server runs on its own thread; handlers are called there, one at a time (a
// slow handler delays every client). An exception from a handler becomes a 500 with its what().
// Stop and the destructor may be called from any thread except the server's own (a handler).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "base/status.h"
#include "runtime/serving/host_port.h"

namespace moerun {

struct HttpReply {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};
using HttpHandler = std::function<HttpReply()>;

struct HttpServerOptions {
  // A whole request from its first byte (and a whole reply write).
  std::chrono::milliseconds read_timeout{10000};
  // Waiting for a request's first byte, on a new or a kept-alive connection.
  std::chrono::milliseconds idle_timeout{10000};
  int max_connections = 512;
};

class HttpServer {
 public:
  // Binds and listens (SO_REUSEADDR) at `where` (port 0: any free port) and serves on its own
  // thread until Stop or destruction. Errors (bad address, port in use) name the address.
  static Result<std::unique_ptr<HttpServer>> Start(const HostPort& where,
                                                   std::map<std::string, HttpHandler> routes,
                                                   std::string log_name,
                                                   HttpServerOptions options = {});
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The bound port (useful with port 0).
  uint16_t port() const { return port_; }
  // Closes the listener and every connection, then joins the thread. Idempotent.
  void Stop();

  struct Impl;  // implementation detail (http_server.cc)

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);

  std::unique_ptr<Impl> impl_;
  uint16_t port_ = 0;
  std::mutex stop_mu_;
  bool stopped_ = false;
};

}  // namespace moerun
