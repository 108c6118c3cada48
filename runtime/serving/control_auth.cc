#include "runtime/serving/control_auth.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

namespace moerun {

// --- the token file

namespace {

// A Kubernetes Secret volume with the pod's fsGroup: the kubelet's file (owned by root), readable
// by the group only (defaultMode 0440), and this process, not root, in that group. Nobody but the
// pod's own processes is in that group, so the token is not shared beyond them.
bool KubeletSecret(const struct stat& st) {
  if (st.st_uid != 0 || ::geteuid() == 0 || (st.st_mode & 077) != 040) return false;
  if (st.st_gid == ::getegid()) return true;
  gid_t groups[256];
  const int n = ::getgroups(256, groups);
  for (int i = 0; i < n; ++i) {
    if (groups[i] == st.st_gid) return true;
  }
  return false;
}

}  // namespace

Status CheckPrivateFile(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Status::NotFound(what + " " + path + ": " + std::strerror(errno));
  }
  if ((st.st_mode & 077) != 0 && !KubeletSecret(st)) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return Status::InvalidArgument(what + " " + path + " has mode " + mode +
                                   ": its group or others may read or write it; chmod 600 it");
  }
  return Status::Ok();
}

Result<std::string> ReadTokenFile(const std::string& path) {
  MOERUN_RETURN_IF_ERROR(CheckPrivateFile(path, "token file"));
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) {
    return Status::InvalidArgument("token file " + path + " is empty or unreadable");
  }
  const auto b = line.find_first_not_of(" \t\r\n");
  const auto e = line.find_last_not_of(" \t\r\n");
  if (b == std::string::npos) return Status::InvalidArgument("token file " + path + " is empty");
  return line.substr(b, e - b + 1);
}

bool ConstantTimeEqual(std::string_view a, std::string_view b) {
  // Compares every byte of the longer string whatever the content; lengths may leak.
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = static_cast<unsigned char>(diff | (x ^ y));
  }
  return diff == 0;
}

Result<FileStamp> StampFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return Status::NotFound(path + ": " + std::strerror(errno));
  }
  FileStamp s;
  s.mtime_ns = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
  s.size = st.st_size;
  s.inode = st.st_ino;
  return s;
}

TokenFileWatch::TokenFileWatch(std::string path, std::string token, std::chrono::seconds grace,
                               Reader reader, Stamper stamper, std::string scope, std::string what)
    : path_(std::move(path)),
      scope_(std::move(scope)),
      what_(std::move(what)),
      token_(std::move(token)),
      grace_(grace),
      reader_(reader ? std::move(reader) : Reader(ReadTokenFile)),
      stamper_(stamper ? std::move(stamper) : Stamper(StampFile)) {
  if (!path_.empty()) {
    Result<FileStamp> s = stamper_(path_);
    if (s.ok()) {
      stamp_ = *s;
      stamped_ = true;
    }
  }
}

std::string TokenFileWatch::Poll(AuthClock::time_point now) {
  if (path_.empty() || now < next_look_) return "";
  next_look_ = now + std::chrono::seconds(1);
  Result<FileStamp> s = stamper_(path_);
  if (!s.ok()) {
    // Gone (being replaced, or removed): keep the current token; say so once.
    if (stamped_ || !(refused_ == FileStamp{})) {
      stamped_ = false;
      refused_ = FileStamp{};
      return scope_ + ": " + what_ + " file " + s.status().message() + "; the current " + what_ +
             " stays in use";
    }
    return "";
  }
  if (stamped_ && *s == stamp_) return "";
  if (*s == refused_) return "";  // already found unusable
  Result<std::string> t = reader_(path_);
  if (!t.ok()) {
    refused_ = *s;
    return scope_ + ": the " + what_ + " file changed but is refused: " + t.status().message() +
           "; the current " + what_ + " stays in use";
  }
  stamp_ = *s;
  stamped_ = true;
  refused_ = FileStamp{};
  if (*t == token_) return "";
  previous_ = std::move(token_);
  previous_until_ = now + grace_;
  token_ = std::move(t).value();
  return scope_ + ": " + what_ + " file " + path_ + " changed: the new " + what_ +
         " is in use; the old one is accepted for " + std::to_string(grace_.count()) + " s more";
}

bool TokenFileWatch::Accepts(std::string_view token, AuthClock::time_point now) const {
  if (token.empty()) return false;
  const bool current = ConstantTimeEqual(token, token_);
  const bool old = !previous_.empty() && ConstantTimeEqual(token, previous_);
  return current || (old && now < previous_until_);
}

// --- back-off

std::chrono::milliseconds AuthBackoff::DelayFor(int failures) const {
  const int over = failures - o_.free_failures;
  if (over <= 0) return std::chrono::milliseconds(0);
  int64_t d = o_.first_delay.count();
  for (int i = 1; i < over && d < o_.max_delay.count(); ++i) d *= 2;
  return std::chrono::milliseconds(std::min<int64_t>(d, o_.max_delay.count()));
}

void AuthBackoff::MakeRoom(AuthClock::time_point now) {
  if (peers_.size() < o_.max_addresses) return;
  for (auto it = peers_.begin(); it != peers_.end();) {  // the forgotten ones first
    const bool quiet = it->second.waiting == 0 && now >= it->second.until &&
                       now - it->second.last >= o_.forget_after;
    it = quiet ? peers_.erase(it) : std::next(it);
  }
  while (peers_.size() >= o_.max_addresses) {  // then the quietest with no connection held
    auto oldest = peers_.end();
    for (auto it = peers_.begin(); it != peers_.end(); ++it) {
      if (it->second.waiting == 0 &&
          (oldest == peers_.end() || it->second.last < oldest->second.last)) {
        oldest = it;
      }
    }
    if (oldest == peers_.end()) break;
    peers_.erase(oldest);
  }
}

AuthBackoff::Decision AuthBackoff::Admit(const std::string& address, AuthClock::time_point now) {
  Decision d;
  auto it = peers_.find(address);
  if (it == peers_.end() || now >= it->second.until) return d;
  Peer& p = it->second;
  d.refuse = true;
  d.wait = std::chrono::ceil<std::chrono::milliseconds>(p.until - now);
  if (p.waiting >= o_.max_waiting) {
    d.close = true;
  } else {
    ++p.waiting;
  }
  return d;
}

void AuthBackoff::OnFailure(const std::string& address, AuthClock::time_point now) {
  auto it = peers_.find(address);
  if (it == peers_.end()) {
    MakeRoom(now);
    if (peers_.size() >= o_.max_addresses) return;  // every one held: this one goes uncounted
    it = peers_.emplace(address, Peer{}).first;
  } else if (now - it->second.last >= o_.forget_after) {
    it->second.failures = 0;
  }
  Peer& p = it->second;
  p.last = now;
  p.failures = std::min(p.failures + 1, 1 << 20);
  const std::chrono::milliseconds d = DelayFor(p.failures);
  if (d.count() > 0) p.until = now + d;
}

void AuthBackoff::Released(const std::string& address) {
  auto it = peers_.find(address);
  if (it != peers_.end() && it->second.waiting > 0) --it->second.waiting;
}

// --- the log

std::string WithThousands(uint64_t n) {
  std::string digits = std::to_string(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string AuthFailureLog::Record(const std::string& address, const std::string& reason) {
  if (!open_) {
    open_ = true;
    return scope_ + ": refused a request with " + reason + " from " + address +
           " (further refusals are summarised every " + std::to_string(interval_.count()) + " s)";
  }
  ++total_;
  auto it = counts_.find(address);
  if (it != counts_.end()) {
    ++it->second;
  } else if (counts_.size() < max_addresses_) {
    counts_.emplace(address, 1);
  } else {
    ++unnamed_addresses_;  // an upper bound of the addresses beyond the named ones
  }
  return "";
}

std::string AuthFailureLog::TakeSummary() {
  if (total_ == 0) {
    open_ = false;
    return "";
  }
  std::string top;
  uint64_t top_n = 0;
  for (const auto& [a, n] : counts_) {
    if (n > top_n || (n == top_n && a < top)) {
      top = a;
      top_n = n;
    }
  }
  const uint64_t addresses = counts_.size() + unnamed_addresses_;
  std::string line = scope_ + ": " + WithThousands(total_) + " request" + (total_ == 1 ? "" : "s") +
                     " with a wrong or no " + credential_ + " from " + WithThousands(addresses) +
                     " address" + (addresses == 1 ? "" : "es") + " in the last " +
                     std::to_string(interval_.count()) + " s (most: " + top + ", " +
                     WithThousands(top_n) + ")";
  total_ = 0;
  counts_.clear();
  unnamed_addresses_ = 0;
  return line;
}

}  // namespace moerun
