// A client of several routers of one job (their serving addresses): requests go to one router;
// when its connection fails (refused, reset or closed: the router died or stopped) the next one
// takes over, and the request that was in flight is sent there once more. The MoE forward is
// idempotent, so a retried request's answer is the one it would have had. The server's own
// error replies (overloaded, deadline exceeded, ...) and the caller's deadline are never
// retried: they are returned as they are.
//
// One request in flight at a time (Call); not thread-safe (one per thread).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "runtime/serving/serve_client.h"

namespace moerun {

// "HOST:PORT[,HOST:PORT...]" -> the addresses, in order (each checked as HOST:PORT).
Result<std::vector<std::string>> ParseTargets(const std::string& list);

// Whether a request that failed with `s` never reached an answer because its connection broke
// (kUnavailable: refused, closed; kIoError: reset): what FailoverClient retries elsewhere.
bool ConnectionLost(const Status& s);

struct FailoverOptions {
  ClientOptions client;
  int retries = 1;  // times one request is sent again after its connection broke
};

class FailoverClient {
 public:
  // Starts with targets[first % size] (spread several clients over the routers).
  FailoverClient(std::vector<std::string> targets, size_t first = 0, FailoverOptions o = {});

  // Connects to the current target, else to the next ones in turn (each tried once); the first
  // that answers becomes current. Errors: the last target's, naming every one tried.
  Status Connect();
  bool connected() const { return conn_ != nullptr; }
  // Forgets the connection (after a deadline: a late answer must not be taken for the next
  // request's).
  void Drop() { conn_.reset(); }
  // Hands the connection over (null if not connected); the client is left unconnected.
  std::unique_ptr<ServeConnection> TakeConnection() { return std::move(conn_); }

  // Sends a request with `send` (on the connection given) and receives the answer, which must
  // carry `id`. Connects first if needed. On a lost connection: moves to the next target and
  // sends again, up to `retries` times.
  using SendFn = std::function<Status(ServeConnection*, Deadline)>;
  Status Call(const SendFn& send, uint64_t id, v1::InferResponse* response, Deadline deadline);
  Status Call(const v1::InferRequest& request, v1::InferResponse* response, Deadline deadline);

  const std::string& target() const { return targets_[current_]; }
  const std::vector<std::string>& targets() const { return targets_; }
  uint64_t failovers() const { return failovers_; }  // moves to another target
  uint64_t retried() const { return retried_; }      // requests sent again

 private:
  void Next();

  std::vector<std::string> targets_;
  size_t current_ = 0;
  FailoverOptions opts_;
  std::unique_ptr<ServeConnection> conn_;
  uint64_t failovers_ = 0;
  uint64_t retried_ = 0;
};

}  // namespace moerun
