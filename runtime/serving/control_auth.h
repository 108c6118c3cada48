// The control endpoint's answer to wrong tokens (runtime/serving/control_endpoint.h), as plain
// policy with no I/O so that it can be tested alone:
//   AuthBackoff      per peer address: after a few wrong (or missing) tokens the address cools
//                    down (doubling, up to a ceiling): its requests are refused unchecked until
//                    then and its connections held (at most a few; the others closed). An
//                    address quiet for a while starts afresh. A right token from another address
//                    is never delayed.
//   AuthFailureLog   the log of wrong tokens: one line for the first of a quiet period, then one
//                    summary per interval ("1,998 requests with a wrong token from 3 addresses
//                    in the last 10 s (most: 127.0.0.1, 1,990)") instead of a line per try.
//   TokenFileWatch   the token file, read again when it changes (mtime, size, inode; looked at
//                    at most once a second): the new token is used at once, the old one is
//                    still accepted for a grace period; a changed file that cannot be read, or
//                    that others may read, keeps the current token (with an error logged). The
//                    serving endpoint watches its key file with it too (scope "serving").
// Both classes keep at most a bounded number of addresses. Not thread-safe: the endpoint's I/O
// thread calls them.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "base/status.h"

namespace moerun {

// Reads a token file: its first line, surrounding whitespace removed; an error (naming the file
// and, for a mode, the mode) if the file is missing, unreadable, empty, or has any permission
// bit for its group or others (mode & 077: chmod 600). One exception, the Kubernetes Secret
// volume mounted with the pod's fsGroup: a file owned by root and readable by its group only
// (0440), read by a process that is not root and is in that group. moectl reads
// MOERUN_TOKEN_FILE with it too.
Result<std::string> ReadTokenFile(const std::string& path);

// The mode check of ReadTokenFile alone, for other secrets (a TLS private key): `what` names the
// file in the error ("TLS key file").
Status CheckPrivateFile(const std::string& path, const std::string& what);

// Equal strings in time that depends only on their lengths.
bool ConstantTimeEqual(std::string_view a, std::string_view b);

using AuthClock = std::chrono::steady_clock;

struct AuthBackoffOptions {
  int free_failures = 5;  // wrong tokens from an address before it cools down
  std::chrono::milliseconds first_delay{250};
  std::chrono::milliseconds max_delay{8000};
  int max_waiting = 8;  // connections of an address held until its cool-down ends; beyond: closed
  std::chrono::seconds forget_after{60};  // an address quiet this long starts afresh
  size_t max_addresses = 4096;
};

// Per peer address: after free_failures wrong tokens, each further one starts a cool-down
// (first_delay, doubling up to max_delay) during which every request of that address is refused
// without its token being looked at, so that the address can try at most one token per
// cool-down. A right token from another address is never delayed.
class AuthBackoff {
 public:
  struct Decision {
    bool refuse = false;                // refuse now, token unchecked (the address cools down)
    std::chrono::milliseconds wait{0};  // until the cool-down ends: hold the connection as long
    bool close = false;                 // too many held: close the connection after the refusal
  };

  explicit AuthBackoff(AuthBackoffOptions options = {}) : o_(options) {}

  // Before a request's token is checked. When it says hold (refuse, wait > 0, not close), call
  // Released(address) once the connection is let go.
  Decision Admit(const std::string& address, AuthClock::time_point now);
  // The request's token was wrong or missing.
  void OnFailure(const std::string& address, AuthClock::time_point now);
  void Released(const std::string& address);
  // The cool-down after the n-th consecutive failure of an address (n from 1; 0: none).
  std::chrono::milliseconds DelayFor(int failures) const;
  size_t addresses() const { return peers_.size(); }

 private:
  struct Peer {
    int failures = 0;
    int waiting = 0;
    AuthClock::time_point last;   // the last failure
    AuthClock::time_point until;  // end of the cool-down
  };
  void MakeRoom(AuthClock::time_point now);

  AuthBackoffOptions o_;
  std::unordered_map<std::string, Peer> peers_;
};

class AuthFailureLog {
 public:
  // `scope` starts each line ("control", "serving"); `credential` names what was wrong or
  // missing in the summary ("token", "key").
  explicit AuthFailureLog(std::chrono::seconds interval = std::chrono::seconds(10),
                          size_t max_addresses = 4096, std::string scope = "control",
                          std::string credential = "token")
      : interval_(interval),
        max_addresses_(max_addresses),
        scope_(std::move(scope)),
        credential_(std::move(credential)) {}

  // Counts a refusal from `address`; returns the line to log now (the first of a quiet period),
  // or "" when it goes into the interval's summary. `reason`: "a wrong token", "no token".
  std::string Record(const std::string& address, const std::string& reason);
  // At the end of an interval: the summary line of the refusals since the last one ("" if
  // none; then the period is quiet again and the next refusal gets its own line).
  std::string TakeSummary();
  // Whether an interval is open (the endpoint keeps its timer running while it is).
  bool open() const { return open_; }
  std::chrono::seconds interval() const { return interval_; }

 private:
  std::chrono::seconds interval_;
  size_t max_addresses_;
  std::string scope_, credential_;
  bool open_ = false;
  uint64_t total_ = 0;
  std::unordered_map<std::string, uint64_t> counts_;  // at most max_addresses_ named
  uint64_t unnamed_addresses_ = 0;                    // counted beyond that
};

// 1234567 -> "1,234,567".
std::string WithThousands(uint64_t n);

// What identifies a version of a file: changes when it is replaced or rewritten.
struct FileStamp {
  int64_t mtime_ns = 0;
  int64_t size = 0;
  uint64_t inode = 0;
  bool operator==(const FileStamp&) const = default;
};

class TokenFileWatch {
 public:
  using Reader = std::function<Result<std::string>(const std::string& path)>;
  using Stamper = std::function<Result<FileStamp>(const std::string& path)>;

  // `token`: read from `path` at start (stamped now). `reader`/`stamper`: ReadTokenFile and
  // stat by default (tests give their own). `scope` starts each log line ("control",
  // "serving"), `what` names the secret in it ("token", "key").
  TokenFileWatch(std::string path, std::string token, std::chrono::seconds grace,
                 Reader reader = {}, Stamper stamper = {}, std::string scope = "control",
                 std::string what = "token");

  // Looks at the file if a second has passed since the last look, and takes a changed one.
  // Returns a line to log when something happened ("" otherwise).
  std::string Poll(AuthClock::time_point now);
  // Whether `token` is the current one, or the previous one within its grace period
  // (constant time in the content).
  bool Accepts(std::string_view token, AuthClock::time_point now) const;
  const std::string& token() const { return token_; }

 private:
  std::string path_;
  std::string scope_, what_;
  std::string token_;
  std::string previous_;  // accepted until previous_until_
  AuthClock::time_point previous_until_{};
  std::chrono::seconds grace_;
  Reader reader_;
  Stamper stamper_;
  FileStamp stamp_;
  FileStamp refused_;  // a version already found unusable (logged once)
  bool stamped_ = false;
  AuthClock::time_point next_look_{};
};

// stat(2) of a path as a FileStamp (the error: "PATH: reason").
Result<FileStamp> StampFile(const std::string& path);

}  // namespace moerun
