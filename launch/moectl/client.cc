#include "launch/moectl/client.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "base/clock.h"
#include "runtime/serving/control_endpoint.h"

namespace moerun::moectl {

namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(500);

}  // namespace

void AddConnectionOptions(CLI::App& app, Session& s) {
  app.add_option("--target", s.target,
                 "Router 0's control endpoint HOST:PORT, or a comma list tried in order (the "
                 "routers that take the control plane over when router 0 dies: control_listen's "
                 "port + rank)")
      ->default_val(s.target);
  app.add_option("--token-file", s.token_file, "File holding the control token")
      ->envname("MOERUN_TOKEN_FILE");
  app.add_option("--timeout-ms", s.timeout_ms, "Give up on one request after this long")
      ->default_val(10000);
  app.add_flag("--tls", s.tls,
               "Speak TLS to the control endpoint (the server's certificate is verified with the "
               "system's CA store unless --tls-ca-file)");
  app.add_option("--tls-ca-file", s.tls_options.ca_file,
                 "PEM CA certificate(s) the server's certificate is verified with (implies --tls)")
      ->envname("MOERUN_TLS_CA_FILE");
  app.add_option("--tls-server-name", s.tls_options.server_name,
                 "Name the server's certificate must carry, also sent as SNI (default: the host "
                 "of --target; implies --tls)");
  app.add_option("--tls-cert-file", s.tls_options.cert_file,
                 "Client certificate (PEM), for a server that requires one (implies --tls)");
  app.add_option("--tls-key-file", s.tls_options.key_file, "Private key (PEM) of --tls-cert-file");
}

int Fail(const std::string& message, int code) {
  std::fprintf(stderr, "moectl: %s\n", message.c_str());
  return code;
}

ControlClient::ControlClient(std::string target, std::string token, int timeout_ms, ClientTls tls)
    : target_(std::move(target)),
      token_(std::move(token)),
      timeout_ms_(timeout_ms),
      tls_(std::move(tls)) {
  std::string::size_type from = 0;
  while (true) {
    const std::string::size_type comma = target_.find(',', from);
    targets_.push_back(target_.substr(from, comma - from));
    if (comma == std::string::npos) break;
    from = comma + 1;
  }
}

int ControlClient::Call(const v1::ControlRequest& req, v1::ControlResponse* resp, bool retry) {
  Status s = Exchange(req, resp, retry);
  if (!s.ok()) return Fail(target_ + ": " + s.ToString());
  if (resp->code() != v1::OK) {
    return Fail(target_ + " refused: " + ErrorCodeKind(resp->code()) + ": " + resp->message());
  }
  return 0;
}

Status ControlClient::Exchange(v1::ControlRequest req, v1::ControlResponse* resp, bool retry) {
  if (!token_.empty()) req.set_token(token_);
  Status s = CallOnce(req, resp);
  if (!s.ok() && retry) {
    conn_.reset();
    s = CallOnce(req, resp);
  }
  if (!s.ok()) conn_.reset();
  return s;
}

Status ControlClient::CallOnce(const v1::ControlRequest& req, v1::ControlResponse* resp) {
  if (const size_t bytes = req.ByteSizeLong(); bytes > kControlMaxFrameBytes) {
    return Status::InvalidArgument(
        "the request is " + std::to_string(bytes) +
        " bytes, over the control endpoint's limit of " + std::to_string(kControlMaxFrameBytes) +
        " bytes (1 MiB) a frame: the server would refuse it (FRAME_TOO_LARGE)");
  }
  const auto deadline = DeadlineIn(std::chrono::milliseconds(timeout_ms_));
  if (!conn_) {
    ClientOptions co;
    co.connect_timeout = std::chrono::milliseconds(timeout_ms_);
    co.tls = tls_;
    // The endpoints in order, from the one that answered last: the first that connects.
    Status first = Status::Ok();
    for (size_t i = 0; i < targets_.size() && !conn_; ++i) {
      const size_t at = (current_ + i) % targets_.size();
      auto conn = ServeConnection::Connect(targets_[at], co);
      if (!conn.ok()) {
        if (first.ok()) first = conn.status();
        continue;
      }
      conn_ = std::move(conn).value();
      current_ = at;
    }
    if (!conn_) return first;
  }
  MOERUN_RETURN_IF_ERROR(conn_->Send(req, deadline));
  return conn_->Receive(resp, deadline);
}

std::unique_ptr<ControlClient> MakeClient(const Session& s) {
  ClientTls tls = s.tls_options;
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    Fail("--tls-cert-file and --tls-key-file go together", 2);
    return nullptr;
  }
  for (const auto& [flag, path] :
       {std::pair<const char*, const std::string&>{"--tls-ca-file", tls.ca_file},
        {"--tls-cert-file", tls.cert_file},
        {"--tls-key-file", tls.key_file}}) {
    if (!path.empty() && ::access(path.c_str(), R_OK) != 0) {
      Fail(std::string(flag) + " " + path + ": " + std::strerror(errno), 2);
      return nullptr;
    }
  }
  tls.enabled = s.tls || !tls.ca_file.empty() || !tls.server_name.empty() || !tls.cert_file.empty();
  std::string token;
  if (!s.token_file.empty()) {
    auto t = ReadTokenFile(s.token_file);
    if (!t.ok()) {
      Fail(t.status().ToString(), 2);
      return nullptr;
    }
    token = std::move(t).value();
  }
  return std::make_unique<ControlClient>(s.target, token, s.timeout_ms, std::move(tls));
}

int Send(const Session& s, const v1::ControlRequest& req, v1::ControlResponse* resp, bool retry) {
  std::unique_ptr<ControlClient> client = MakeClient(s);
  if (!client) return 2;
  return client->Call(req, resp, retry);
}

Waiter::Waiter(bool json)
    : started_(std::chrono::steady_clock::now()), out_(json ? stderr : stdout) {}

void Waiter::Pause() const { std::this_thread::sleep_for(kPollInterval); }

double Waiter::Seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
}

void Waiter::Line(const std::string& line) const {
  std::fprintf(out_, "%s\n", line.c_str());
  std::fflush(out_);
}

const CLI::Validator kNonNegative(
    [](std::string& text) -> std::string {
      char* end = nullptr;
      const double v = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0' || !(v >= 0)) return "must be a number >= 0, not " + text;
      return {};
    },
    "NUMBER >= 0");

}  // namespace moerun::moectl
