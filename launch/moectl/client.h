// What every moectl command shares: the flags before the command and the exit code (Session), a
// client of router 0's control endpoint that sends the token of --token-file (over TLS with
// --tls or --tls-ca-file: the server's certificate and name always verified), the error message
// (Fail), the pace and the progress lines of --wait (Waiter), and the NUMBER >= 0 check.
#pragma once

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "moerun/v1/control.pb.h"
#include "runtime/serving/serve_client.h"

namespace moerun::moectl {

// The flags before the command, and the exit code its callback sets: 0 ok, 1 refused or failed
// (also: a file that cannot be read), 2 bad usage.
struct Session {
  std::string target = "127.0.0.1:5800";  // --target HOST:PORT[,HOST:PORT...]
  std::string token_file;                 // --token-file, or MOERUN_TOKEN_FILE
  int timeout_ms = 10000;                 // --timeout-ms: one request
  // --tls; --tls-ca-file (or MOERUN_TLS_CA_FILE), --tls-server-name, --tls-cert-file and
  // --tls-key-file (a client certificate, for a server with tls.client_ca_file) imply it.
  bool tls = false;
  ClientTls tls_options;  // enabled is set by MakeClient
  int rc = 0;
};

// --target, --token-file, --timeout-ms and the --tls flags on the top-level app.
void AddConnectionOptions(CLI::App& app, Session& s);

// Prints "moectl: MESSAGE" on stderr and returns `code`, the exit code.
int Fail(const std::string& message, int code = 1);

// One request, one answer, on a connection kept between calls (--wait polls on it). A call that
// fails on the wire is tried again once on a fresh connection when `retry` (read-only requests).
// `target` may be a comma list: a new connection goes to the first endpoint that accepts one,
// in order from the last that did (the router that took the control plane over from router 0).
class ControlClient {
 public:
  ControlClient(std::string target, std::string token, int timeout_ms, ClientTls tls = {});

  // 0 with the answer in *resp, or 1 after printing why (failed, or refused by the router).
  int Call(const v1::ControlRequest& req, v1::ControlResponse* resp, bool retry);

 private:
  Status Exchange(v1::ControlRequest req, v1::ControlResponse* resp, bool retry);
  Status CallOnce(const v1::ControlRequest& req, v1::ControlResponse* resp);

  std::string target_, token_;
  std::vector<std::string> targets_;  // target_ split at its commas
  size_t current_ = 0;                // the endpoint of the last connection
  int timeout_ms_;
  ClientTls tls_;
  std::unique_ptr<ServeConnection> conn_;
};

// The client of --target with the token of --token-file, read now, and the --tls flags; null
// after printing why (the exit code is then 2).
std::unique_ptr<ControlClient> MakeClient(const Session& s);

// One request on a client of its own: 0 with the answer in *resp, or the exit code after
// printing why (2: the token file, 1: the request failed or was refused).
int Send(const Session& s, const v1::ControlRequest& req, v1::ControlResponse* resp, bool retry);

// --wait: a pause between polls, the seconds since the first answer, and where progress lines
// go (stdout, or stderr when stdout is JSON).
class Waiter {
 public:
  explicit Waiter(bool json);

  void Pause() const;
  double Seconds() const;
  std::FILE* out() const { return out_; }
  void Line(const std::string& line) const;  // printed and flushed

 private:
  std::chrono::steady_clock::time_point started_;
  std::FILE* out_;
};

// CLI11's NonNegativeNumber prints DBL_MAX in its message: this says what is wanted.
extern const CLI::Validator kNonNegative;

}  // namespace moerun::moectl
