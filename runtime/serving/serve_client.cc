#include "runtime/serving/serve_client.h"

#include "runtime/serving/host_port.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstring>
#include <limits>

#include "base/dtype.h"

namespace moerun {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little-endian; this client writes host floats as they are");

constexpr size_t kReadChunk = 256 << 10;
// TLS: buffers smaller than this are gathered into one write (one record, not one per buffer).
constexpr size_t kTlsGather = 16 << 10;
// TLS: a write that needs to read first (a renegotiation) waits at most this long at a time,
// since a thread in Receive may be the one that reads what it waits for.
constexpr auto kTlsWriteWantsRead = std::chrono::milliseconds(10);

std::string Errno(int e) { return std::strerror(e); }

// A connect target: ParseHostPort's rules, and somewhere to go (":PORT" and port 0 are for
// listening only).
Status SplitHostPort(const std::string& text, std::string* host, std::string* port) {
  MOERUN_ASSIGN_OR_RETURN(const HostPort hp, ParseHostPort(text));
  if (text.front() == ':') {
    return Status::InvalidArgument("invalid address \"" + text + "\": empty host");
  }
  if (hp.port == 0) {
    return Status::InvalidArgument("invalid address \"" + text + "\": port out of range 1..65535");
  }
  *host = hp.host;
  *port = std::to_string(hp.port);
  return Status::Ok();
}

// Milliseconds poll() may wait before the deadline (rounded up); -1 when it has passed.
int PollTimeoutMs(Deadline deadline) {
  const auto now = SteadyClock::now();
  if (deadline <= now) return -1;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now).count();
  return static_cast<int>(std::min<int64_t>(left, INT_MAX));
}

// Waits for `events` on fd. Ok: ready (or an error/hangup condition the next call reports).
Status WaitFd(int fd, short events, Deadline deadline, const char* what) {
  for (;;) {
    const int timeout = PollTimeoutMs(deadline);
    if (timeout < 0) return Status::DeadlineExceeded(std::string(what) + ": deadline exceeded");
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, timeout);
    if (r > 0) return Status::Ok();
    if (r < 0 && errno != EINTR)
      return Status::IoError(std::string(what) + ": poll: " + Errno(errno));
  }
}

std::string FormatAddr(const sockaddr* sa, socklen_t len) {
  char host[NI_MAXHOST], serv[NI_MAXSERV];
  if (getnameinfo(sa, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV) !=
      0) {
    return "?";
  }
  std::string out;
  const bool v6 = sa->sa_family == AF_INET6;
  if (v6) out.push_back('[');
  out.append(host);
  if (v6) out.push_back(']');
  out.push_back(':');
  out.append(serv);
  return out;
}

// One non-blocking connect to one address within the deadline. Returns the fd or an error.
Result<int> ConnectOne(const addrinfo* ai, Deadline deadline) {
  const int fd =
      ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
  if (fd < 0) return Status::IoError("socket: " + Errno(errno));
  int rc;
  do {
    rc = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
  } while (rc != 0 && errno == EINTR);
  if (rc != 0 && errno != EINPROGRESS) {
    const int e = errno;
    ::close(fd);
    return Status::Unavailable(Errno(e));
  }
  if (rc != 0) {
    const Status st = WaitFd(fd, POLLOUT, deadline, "connect");
    if (!st.ok()) {
      ::close(fd);
      return st;
    }
    int err = 0;
    socklen_t len = sizeof err;
    if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    if (err != 0) {
      ::close(fd);
      return Status::Unavailable(Errno(err));
    }
  }
  const int one = 1;
  if (::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0) {
    const int e = errno;
    ::close(fd);
    return Status::IoError("setsockopt(TCP_NODELAY): " + Errno(e));
  }
  return fd;
}

// The TLS handshake on a connected fd within connect_timeout. Errors name the target.
Result<std::unique_ptr<TlsSession>> StartTls(int fd, const ClientOptions& o,
                                             const std::string& host, const std::string& target) {
  const std::string where = "connect to " + target;
  auto session = TlsSession::Create(fd, o.tls, host);
  if (!session.ok()) return session.status().WithContext(where);
  const Deadline deadline = DeadlineIn(o.connect_timeout);
  for (;;) {
    std::string why;
    const TlsSession::Io io = (*session)->Handshake(&why);
    if (io == TlsSession::Io::kDone) return session;
    if (io == TlsSession::Io::kClosed || io == TlsSession::Io::kError) {
      return Status::Unavailable(where + ": TLS handshake failed: " + why);
    }
    const short events = io == TlsSession::Io::kWantRead ? POLLIN : POLLOUT;
    const Status st = WaitFd(fd, events, deadline, "TLS handshake");
    if (st.code() == StatusCode::kDeadlineExceeded) {
      return Status::DeadlineExceeded(where + ": TLS handshake failed: no answer within " +
                                      std::to_string(o.connect_timeout.count()) + " ms");
    }
    if (!st.ok()) return st.WithContext(where);
  }
}

}  // namespace

Result<std::unique_ptr<ServeConnection>> ServeConnection::Connect(const std::string& host_port,
                                                                  ClientOptions o) {
  std::string host, port;
  MOERUN_RETURN_IF_ERROR(SplitHostPort(host_port, &host, &port));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const int gai = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (gai != 0) {
    const std::string why = gai == EAI_SYSTEM ? Errno(errno) : gai_strerror(gai);
    return Status::Unavailable("connect to " + host_port + ": cannot resolve \"" + host +
                               "\": " + why);
  }
  Status last = Status::Unavailable("no address");
  for (const addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    auto fd = ConnectOne(ai, DeadlineIn(o.connect_timeout));
    if (fd.ok()) {
      ::freeaddrinfo(res);
      std::unique_ptr<TlsSession> tls;
      if (o.tls.enabled) {
        // The server answered: a failed handshake is its answer (no other address is tried).
        auto session = StartTls(*fd, o, host, host_port);
        if (!session.ok()) {
          ::close(*fd);
          return session.status();
        }
        tls = std::move(session).value();
      }
      return std::unique_ptr<ServeConnection>(
          new ServeConnection(*fd, host_port, std::move(o), std::move(tls)));
    }
    std::string msg = fd.status().message();
    if (fd.status().code() == StatusCode::kDeadlineExceeded) {
      msg = "no answer within " + std::to_string(o.connect_timeout.count()) + " ms";
    }
    last = Status(fd.status().code(), "connect to " + host_port + " (" +
                                          FormatAddr(ai->ai_addr, ai->ai_addrlen) + "): " + msg);
  }
  ::freeaddrinfo(res);
  return last;
}

ServeConnection::ServeConnection(int fd, std::string target, ClientOptions o,
                                 std::unique_ptr<TlsSession> tls)
    : fd_(fd),
      target_(std::move(target)),
      opts_(std::move(o)),
      decoder_(opts_.max_frame_bytes),
      tls_(std::move(tls)) {}

ServeConnection::~ServeConnection() { Close(); }

void ServeConnection::Shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void ServeConnection::Close() {
  tls_.reset();  // its close_notify needs the fd
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

ssize_t ServeConnection::WriteSome(const struct iovec* iov, int count, short* events,
                                   Status* error) {
  if (!tls_) {
    msghdr msg{};
    msg.msg_iov = const_cast<struct iovec*>(iov);
    msg.msg_iovlen = static_cast<size_t>(std::min(count, IOV_MAX));
    for (;;) {
      const ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
      if (n >= 0) return n;
      const int e = errno;
      if (e == EINTR) continue;
      if (e == EAGAIN || e == EWOULDBLOCK) {
        *events = POLLOUT;
        return -1;
      }
      *error = (e == EPIPE || e == ECONNRESET)
                   ? Status::Unavailable(target_ + ": connection closed by the server")
                   : Status::IoError(target_ + ": send: " + Errno(e));
      return -2;
    }
  }
  // TLS: one buffer as it is, or several small ones gathered into wbuf_ (the same bytes again
  // after a retry, as OpenSSL requires: the iovs do not move until something is written).
  const void* bytes = iov[0].iov_base;
  size_t n = iov[0].iov_len;
  if (n < kTlsGather && count > 1) {
    wbuf_.resize(kTlsGather);
    n = 0;
    for (int i = 0; i < count && n < kTlsGather; ++i) {
      const size_t take = std::min(iov[i].iov_len, kTlsGather - n);
      std::memcpy(wbuf_.data() + n, iov[i].iov_base, take);
      n += take;
    }
    bytes = wbuf_.data();
  }
  size_t sent = 0;
  std::string why;
  switch (tls_->Write(bytes, n, &sent, &why)) {
    case TlsSession::Io::kDone:
      return static_cast<ssize_t>(sent);
    case TlsSession::Io::kWantRead:
      *events = POLLIN;
      return -1;
    case TlsSession::Io::kWantWrite:
      *events = POLLOUT;
      return -1;
    case TlsSession::Io::kClosed:
      *error = Status::Unavailable(target_ + ": connection closed by the server");
      return -2;
    case TlsSession::Io::kError:
      break;
  }
  *error = Status::IoError(target_ + ": TLS " + why);
  return -2;
}

Status ServeConnection::SendIov(struct iovec* iov, int count, Deadline deadline) {
  if (!send_error_.ok()) return send_error_;
  if (fd_ < 0) return Status::Unavailable(target_ + ": connection closed");
  // TLS: once a write was tried, its bytes may be partly out (OpenSSL holds the rest).
  bool started = false;
  while (count > 0) {
    short events = 0;
    Status error;
    const ssize_t n = WriteSome(iov, count, &events, &error);
    if (n == -2) {
      send_error_ = error;
      return send_error_;
    }
    if (n == -1) {
      started = started || tls_ != nullptr;
      // A TLS write that must read first polls in short steps: a Receive may read it.
      const bool step = events == POLLIN;
      const Deadline until = step ? std::min(deadline, DeadlineIn(kTlsWriteWantsRead)) : deadline;
      Status st = WaitFd(fd_, events, until, "send");
      if (step && st.code() == StatusCode::kDeadlineExceeded && SteadyClock::now() < deadline) {
        continue;
      }
      if (!st.ok()) {
        st = st.WithContext(target_);
        // A frame cut in the middle leaves the stream out of sync for good.
        if (started) send_error_ = Status(st.code(), st.message() + " (part of a frame sent)");
        return st;
      }
      continue;
    }
    started = started || n > 0;
    size_t left = static_cast<size_t>(n);
    while (count > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
  return Status::Ok();
}

Status ServeConnection::SendRaw(const void* bytes, size_t n, Deadline deadline) {
  iovec iov{const_cast<void*>(bytes), n};
  return SendIov(&iov, n == 0 ? 0 : 1, deadline);
}

Status ServeConnection::SendParts(std::span<const std::string_view> parts, Deadline deadline) {
  std::vector<iovec> iov;
  iov.reserve(parts.size());
  for (std::string_view p : parts) {
    if (!p.empty()) iov.push_back({const_cast<char*>(p.data()), p.size()});
  }
  return SendIov(iov.data(), static_cast<int>(iov.size()), deadline);
}

Status ServeConnection::Send(const google::protobuf::MessageLite& m, Deadline deadline) {
  MOERUN_ASSIGN_OR_RETURN(const std::string frame, EncodeFrame(m));
  return SendRaw(frame.data(), frame.size(), deadline);
}

Status ServeConnection::ReceiveFrame(std::string* body, Deadline deadline) {
  if (!recv_error_.ok()) return recv_error_;
  if (fd_ < 0) return Status::Unavailable(target_ + ": connection closed");
  for (;;) {
    auto next = decoder_.Next(body);
    if (!next.ok()) {
      recv_error_ =
          Status::Corrupt(target_ + ": bad frame from the server: " + next.status().message());
      return recv_error_;
    }
    if (*next) return Status::Ok();
    // Read no more than the decoder may hold: one header + one maximal frame.
    const size_t room =
        kFrameHeaderBytes + static_cast<size_t>(decoder_.max_frame_bytes()) - decoder_.buffered();
    const size_t want = std::min(kReadChunk, std::max<size_t>(room, 1));
    if (rbuf_.size() < want) rbuf_.resize(kReadChunk);
    const auto closed = [&](const std::string& why) {
      const size_t partial = decoder_.buffered();
      recv_error_ =
          Status::Unavailable(target_ + ": connection closed by the server" +
                              (partial > 0 ? " in the middle of a frame (" +
                                                 std::to_string(partial) + " bytes of it received)"
                                           : std::string()) +
                              why);
      return recv_error_;
    };
    if (tls_) {
      // OpenSSL's buffered bytes come first: the fd is polled only when it wants more.
      size_t got = 0;
      std::string why;
      const TlsSession::Io io = tls_->Read(rbuf_.data(), want, &got, &why);
      if (io == TlsSession::Io::kDone) {
        decoder_.Feed(rbuf_.data(), got);
        continue;
      }
      if (io == TlsSession::Io::kClosed) return closed("");
      if (io == TlsSession::Io::kError) {
        recv_error_ = Status::IoError(target_ + ": TLS " + why);
        return recv_error_;
      }
      const short events = io == TlsSession::Io::kWantWrite ? POLLOUT : POLLIN;
      Status st = WaitFd(fd_, events, deadline, "receive");
      if (!st.ok()) return st.WithContext(target_);
      continue;
    }
    const ssize_t n = ::recv(fd_, rbuf_.data(), want, 0);
    if (n > 0) {
      decoder_.Feed(rbuf_.data(), static_cast<size_t>(n));
      continue;
    }
    if (n == 0) return closed("");
    const int e = errno;
    if (e == EINTR) continue;
    if (e == EAGAIN || e == EWOULDBLOCK) {
      Status st = WaitFd(fd_, POLLIN, deadline, "receive");
      if (!st.ok()) return st.WithContext(target_);
      continue;
    }
    if (e == ECONNRESET) return closed(" (reset)");
    recv_error_ = Status::IoError(target_ + ": recv: " + Errno(e));
    return recv_error_;
  }
}

Status ServeConnection::Receive(google::protobuf::MessageLite* m, Deadline deadline) {
  std::string body;
  MOERUN_RETURN_IF_ERROR(ReceiveFrame(&body, deadline));
  if (!m->ParseFromString(body)) {
    return Status::Corrupt(target_ + ": a frame of " + std::to_string(body.size()) +
                           " bytes is not a valid " + m->GetTypeName());
  }
  return Status::Ok();
}

std::string EncodeKeyField(const std::string& key) {
  std::string f;
  f.push_back(static_cast<char>(7 << 3 | 2));  // field 7, length-delimited
  uint64_t n = key.size();
  while (n >= 0x80) {
    f.push_back(static_cast<char>((n & 0x7f) | 0x80));
    n >>= 7;
  }
  f.push_back(static_cast<char>(n));
  return f + key;
}

Status ServeConnection::SendRequest(const v1::InferRequest& request, Deadline deadline) {
  if (opts_.key.empty() || !request.key().empty()) return Send(request, deadline);
  const std::string body = request.SerializeAsString();
  const std::string key = EncodeKeyField(opts_.key);
  const size_t n = body.size() + key.size();
  if (n > std::numeric_limits<uint32_t>::max()) {
    return Status::InvalidArgument(target_ + ": a request of " + std::to_string(n) +
                                   " bytes does not fit in one frame (at most 4 GiB - 1)");
  }
  uint8_t header[kFrameHeaderBytes];
  PutFrameLength(static_cast<uint32_t>(n), header);
  const std::string_view parts[] = {
      std::string_view(reinterpret_cast<const char*>(header), kFrameHeaderBytes), body, key};
  return SendParts(parts, deadline);
}

Status ServeConnection::Call(const v1::InferRequest& request, v1::InferResponse* response,
                             Deadline deadline) {
  MOERUN_RETURN_IF_ERROR(SendRequest(request, deadline));
  MOERUN_RETURN_IF_ERROR(Receive(response, deadline));
  if (response->id() != request.id()) {
    return Status::Corrupt(target_ + ": answer for id " + std::to_string(response->id()) +
                           " to request " + std::to_string(request.id()));
  }
  return Status::Ok();
}

void SetRequestData(v1::InferRequest* r, const float* x, int64_t tokens, int64_t hidden,
                    v1::DType dtype) {
  const bool bf16 = dtype == v1::BF16;
  r->set_dtype(bf16 ? v1::BF16 : v1::F32);
  r->clear_shape();
  r->add_shape(tokens);
  r->add_shape(hidden);
  const size_t n = tokens > 0 && hidden > 0 ? static_cast<size_t>(tokens * hidden) : 0;
  std::string* data = r->mutable_data();
  if (!bf16) {
    data->resize(n * 4);
    if (n > 0) std::memcpy(data->data(), x, n * 4);
    return;
  }
  data->resize(n * 2);
  char* out = data->data();
  for (size_t i = 0; i < n; ++i) {
    const uint16_t v = F32ToBf16(x[i]);
    std::memcpy(out + 2 * i, &v, 2);
  }
}

Result<std::vector<float>> ResponseFloats(const v1::InferResponse& r) {
  MOERUN_RETURN_IF_ERROR(StatusFromResponse(r.code(), r.message()));
  size_t elem;
  if (r.dtype() == v1::F32) {
    elem = 4;
  } else if (r.dtype() == v1::BF16) {
    elem = 2;
  } else {
    return Status::Corrupt("response " + std::to_string(r.id()) + ": dtype " +
                           std::to_string(static_cast<int>(r.dtype())) + " is not F32 or BF16");
  }
  if (r.shape_size() == 0) {
    return Status::Corrupt("response " + std::to_string(r.id()) + ": no shape");
  }
  uint64_t numel = 1;
  std::string dims;
  for (int64_t d : r.shape()) {
    dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    if (d < 0) return Status::Corrupt("response " + std::to_string(r.id()) + ": negative dim");
    if (d != 0 && numel > std::numeric_limits<uint64_t>::max() / 4 / static_cast<uint64_t>(d)) {
      return Status::Corrupt("response " + std::to_string(r.id()) + ": shape too large");
    }
    numel *= static_cast<uint64_t>(d);
  }
  if (numel * elem != r.data().size()) {
    return Status::Corrupt("response " + std::to_string(r.id()) + ": data of " +
                           std::to_string(r.data().size()) + " bytes, but shape [" + dims +
                           "] of " + (elem == 4 ? "F32" : "BF16") + " needs " +
                           std::to_string(numel * elem));
  }
  std::vector<float> out(static_cast<size_t>(numel));
  const char* p = r.data().data();
  if (elem == 4) {
    if (numel > 0) std::memcpy(out.data(), p, out.size() * 4);
  } else {
    for (size_t i = 0; i < out.size(); ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      out[i] = Bf16ToF32(v);
    }
  }
  return out;
}

std::string ErrorCodeKind(v1::ErrorCode code) {
  std::string name = v1::ErrorCode_IsValid(code) ? v1::ErrorCode_Name(code) : std::string();
  if (name.empty()) return "code_" + std::to_string(static_cast<int>(code));
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

Status StatusFromResponse(v1::ErrorCode code, const std::string& message) {
  StatusCode sc;
  switch (code) {
    case v1::OK:
      return Status::Ok();
    case v1::INVALID_ARGUMENT:
    case v1::FRAME_TOO_LARGE:
    case v1::UNAUTHENTICATED:
      sc = StatusCode::kInvalidArgument;
      break;
    case v1::DEADLINE_EXCEEDED:
    case v1::FRAME_TIMEOUT:
      sc = StatusCode::kDeadlineExceeded;
      break;
    case v1::OVERLOADED:
      sc = StatusCode::kResourceExhausted;
      break;
    case v1::UNAVAILABLE:
      sc = StatusCode::kUnavailable;
      break;
    case v1::MALFORMED_FRAME:
      sc = StatusCode::kCorrupt;
      break;
    default:
      sc = StatusCode::kInternal;
      break;
  }
  return Status(sc, "server: " + ErrorCodeKind(code) + (message.empty() ? "" : ": " + message));
}

}  // namespace moerun
