#include "runtime/serving/failover_client.h"

#include <utility>

#include "base/log.h"
#include "runtime/serving/host_port.h"

namespace moerun {

Result<std::vector<std::string>> ParseTargets(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = list.find(',', start);
    const std::string one =
        list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (one.empty()) {
      return Status::InvalidArgument("'" + list +
                                     "': an empty address (targets are HOST:PORT[,HOST:PORT...])");
    }
    MOERUN_RETURN_IF_ERROR(ParseHostPort(one).status().WithContext("target '" + one + "'"));
    out.push_back(one);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (out.empty()) return Status::InvalidArgument("no target address");
  return out;
}

bool ConnectionLost(const Status& s) {
  return s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kIoError;
}

FailoverClient::FailoverClient(std::vector<std::string> targets, size_t first, FailoverOptions o)
    : targets_(std::move(targets)), opts_(o) {
  if (targets_.empty()) targets_.push_back("");  // Connect says what is wrong
  current_ = first % targets_.size();
}

void FailoverClient::Next() {
  if (targets_.size() < 2) return;
  const std::string& from = targets_[current_];
  current_ = (current_ + 1) % targets_.size();
  ++failovers_;
  spdlog::warn("router {} is unreachable: moving to {}", from, targets_[current_]);
}

Status FailoverClient::Connect() {
  conn_.reset();
  Status last;
  std::string tried;
  for (size_t i = 0; i < targets_.size(); ++i) {
    if (i > 0) Next();
    auto c = ServeConnection::Connect(targets_[current_], opts_.client);
    if (c.ok()) {
      conn_ = std::move(c).value();
      return Status::Ok();
    }
    last = c.status();
    tried += (tried.empty() ? "" : ", ") + targets_[current_];
  }
  if (targets_.size() == 1) return last;
  return Status(last.code(), "no router answers (tried " + tried + "): " + last.message());
}

Status FailoverClient::Call(const SendFn& send, uint64_t id, v1::InferResponse* response,
                            Deadline deadline) {
  for (int attempt = 0;; ++attempt) {
    if (!conn_) MOERUN_RETURN_IF_ERROR(Connect());
    Status s = send(conn_.get(), deadline);
    if (s.ok()) s = conn_->Receive(response, deadline);
    if (s.ok() && response->id() != id) {
      s = Status::Corrupt(conn_->target() + ": answer for id " + std::to_string(response->id()) +
                          " to request " + std::to_string(id));
    }
    if (s.ok()) return s;
    conn_.reset();  // out of step, broken or late: a new connection for what comes next
    if (!ConnectionLost(s) || attempt >= opts_.retries || SteadyClock::now() >= deadline) {
      return s;
    }
    spdlog::warn("request {}: the connection to {} broke ({}): sending it again", id, target(),
                 s.ToString());
    ++retried_;
    Next();
  }
}

Status FailoverClient::Call(const v1::InferRequest& request, v1::InferResponse* response,
                            Deadline deadline) {
  return Call([&](ServeConnection* c, Deadline d) { return c->SendRequest(request, d); },
              request.id(), response, deadline);
}

}  // namespace moerun
