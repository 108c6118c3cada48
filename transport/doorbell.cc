#include "transport/doorbell.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

namespace moerun {
namespace {

constexpr char kPrefix[] = "moerun-bell/";

std::string HostName() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "unknown";
  return host;
}

// The socket address of abstract name `name` (a leading NUL, then the name; no terminator).
socklen_t AbstractAddress(const std::string& name, sockaddr_un* addr) {
  std::memset(addr, 0, sizeof *addr);
  addr->sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof addr->sun_path - 1);
  std::memcpy(addr->sun_path + 1, name.data(), n);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

// The shared-memory name of a bell's asleep word: "/moerun-bell-<pid>-<random>" (the bell name's
// tail); empty for a name that is not a bell's.
std::string ShmName(const std::string& bell) {
  if (DoorbellHost(bell).empty()) return "";
  const size_t nonce = bell.rfind('/');
  const size_t pid = bell.rfind('/', nonce - 1);
  return "/moerun-bell-" + bell.substr(pid + 1, nonce - pid - 1) + "-" + bell.substr(nonce + 1);
}

// An asleep word's mapping: one cache line.
constexpr size_t kWordBytes = 64;

// Maps a bell's asleep word (creating it when `create`); null when it cannot.
std::atomic<uint32_t>* MapWord(const std::string& shm, bool create) {
  if (shm.empty()) return nullptr;
  const int fd = create ? ::shm_open(shm.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600)
                        : ::shm_open(shm.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  if (create && ::ftruncate(fd, kWordBytes) != 0) {
    ::close(fd);
    return nullptr;
  }
  void* p = ::mmap(nullptr, kWordBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  return p == MAP_FAILED ? nullptr : static_cast<std::atomic<uint32_t>*>(p);
}

}  // namespace

std::string DoorbellHost(const std::string& name) {
  const size_t p = sizeof kPrefix - 1;
  if (name.compare(0, p, kPrefix) != 0) return "";
  const size_t slash = name.find('/', p);
  if (slash == std::string::npos || slash == p) return "";
  return name.substr(p, slash - p);
}

Result<Doorbell> Doorbell::Open() {
  Doorbell b;
  b.host_ = HostName();
  if (b.host_.find('/') != std::string::npos) b.host_ = "host";
  b.fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (b.fd_ < 0) {
    return Status::Unavailable(std::string("doorbell: socket(AF_UNIX): ") + std::strerror(errno));
  }
  std::random_device rd;
  const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char tail[64];
  std::snprintf(tail, sizeof tail, "/%d/%016llx", static_cast<int>(::getpid()),
                static_cast<unsigned long long>(nonce));
  b.name_ =
      kPrefix + b.host_.substr(0, kNameBytes - 1 - (sizeof kPrefix - 1) - std::strlen(tail)) + tail;
  sockaddr_un addr;
  const socklen_t len = AbstractAddress(b.name_, &addr);
  if (::bind(b.fd_, reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    return Status::Unavailable("doorbell: bind(" + b.name_ + "): " + std::strerror(errno));
  }
  // The asleep word; without it (no /dev/shm) peers ring always.
  b.shm_name_ = ShmName(b.name_);
  b.asleep_ = MapWord(b.shm_name_, /*create=*/true);
  if (b.asleep_ == nullptr) b.shm_name_.clear();
  return b;
}

Doorbell::Doorbell(Doorbell&& o) noexcept { *this = std::move(o); }

Doorbell& Doorbell::operator=(Doorbell&& o) noexcept {
  if (this != &o) {
    Release();
    fd_ = o.fd_;
    o.fd_ = -1;
    asleep_ = o.asleep_;
    o.asleep_ = nullptr;
    shm_name_ = std::move(o.shm_name_);
    o.shm_name_.clear();
    peer_asleep_ = std::move(o.peer_asleep_);
    o.peer_asleep_.clear();
    awake_ = o.awake_;
    name_ = std::move(o.name_);
    host_ = std::move(o.host_);
    peers_ = std::move(o.peers_);
    rung_at_ = std::move(o.rung_at_);
    rings_ = o.rings_;
    failures_ = o.failures_;
  }
  return *this;
}

Doorbell::~Doorbell() { Release(); }

void Doorbell::Release() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  Unlink();
  if (asleep_ != nullptr) ::munmap(asleep_, kWordBytes);
  asleep_ = nullptr;
  UnmapPeerWords();
  peer_asleep_.clear();
}

void Doorbell::Unlink() {
  if (!shm_name_.empty()) ::shm_unlink(shm_name_.c_str());
  shm_name_.clear();
}

void Doorbell::UnmapPeerWords() {
  for (std::atomic<uint32_t>* w : peer_asleep_) {
    if (w != nullptr) ::munmap(w, kWordBytes);
  }
}

void Doorbell::SetPeers(const std::vector<std::string>& names) {
  UnmapPeerWords();
  peers_.assign(names.size(), std::string());
  rung_at_.assign(names.size(), std::chrono::steady_clock::time_point{});
  peer_asleep_.assign(names.size(), nullptr);
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == name_ || DoorbellHost(names[i]) != host_) continue;
    sockaddr_un addr;
    const socklen_t len = AbstractAddress(names[i], &addr);
    peers_[i].assign(reinterpret_cast<const char*>(&addr), len);
    peer_asleep_[i] = MapWord(ShmName(names[i]), /*create=*/false);
  }
}

int Doorbell::ringable() const {
  int n = 0;
  for (const std::string& p : peers_) n += !p.empty();
  return n;
}

void Doorbell::Ring(int peer, std::chrono::steady_clock::time_point now) {
  if (fd_ < 0 || peer < 0 || static_cast<size_t>(peer) >= peers_.size()) return;
  const std::string& a = peers_[static_cast<size_t>(peer)];
  if (a.empty()) return;
  if (std::atomic<uint32_t>* w = peer_asleep_[static_cast<size_t>(peer)]) {
    // The message is posted before the word is read (the caller's; this fence orders them).
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (w->load(std::memory_order_seq_cst) == 0) {
      ++awake_;
      return;
    }
  }
  auto& last = rung_at_[static_cast<size_t>(peer)];
  if (now - last < kCoalesce) return;
  last = now;
  const char one = 1;
  const ssize_t n =
      ::sendto(fd_, &one, 1, MSG_DONTWAIT | MSG_NOSIGNAL,
               reinterpret_cast<const sockaddr*>(a.data()), static_cast<socklen_t>(a.size()));
  ++rings_;
  if (n != 1) ++failures_;  // EAGAIN: rings are queued there already; else: no such bell
}

bool WaitReadable(int fd, std::chrono::microseconds max) {
  if (fd < 0) {
    ::usleep(static_cast<useconds_t>(max.count()));
    return false;
  }
  pollfd p{fd, POLLIN, 0};
  timespec ts;
  ts.tv_sec = static_cast<time_t>(max.count() / 1000000);
  ts.tv_nsec = static_cast<long>(max.count() % 1000000) * 1000;
  return ::ppoll(&p, 1, &ts, nullptr) > 0;
}

bool Doorbell::Wait(std::chrono::microseconds max, FunctionRef<bool()> recheck) {
  if (asleep_ != nullptr) {
    asleep_->store(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  const bool found = recheck();
  const bool rung = !found && WaitReadable(fd_, max);
  if (asleep_ != nullptr) asleep_->store(0, std::memory_order_seq_cst);
  if (!rung) return found;
  char buf[64];
  while (::recv(fd_, buf, sizeof buf, MSG_DONTWAIT) > 0) {
  }
  return true;
}

}  // namespace moerun
