#include "runtime/serving/tls_client.h"

#include <arpa/inet.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <utility>

namespace moerun {
namespace {

// A socket BIO of our own: OpenSSL's writes with write(2), which raises SIGPIPE on a connection
// the peer closed; this one sends with MSG_NOSIGNAL (as the plain client does). The fd is the
// BIO's data; the BIO does not own it.
int FdOf(BIO* b) { return static_cast<int>(reinterpret_cast<intptr_t>(BIO_get_data(b))); }

int BioWrite(BIO* b, const char* data, int len) {
  BIO_clear_retry_flags(b);
  for (;;) {
    const ssize_t n = ::send(FdOf(b), data, static_cast<size_t>(len), MSG_NOSIGNAL);
    if (n >= 0) return static_cast<int>(n);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) BIO_set_retry_write(b);
    return -1;
  }
}

int BioRead(BIO* b, char* out, int len) {
  BIO_clear_retry_flags(b);
  for (;;) {
    const ssize_t n = ::recv(FdOf(b), out, static_cast<size_t>(len), 0);
    if (n >= 0) return static_cast<int>(n);  // 0: end of stream
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) BIO_set_retry_read(b);
    return -1;
  }
}

long BioCtrl(BIO*, int cmd, long, void*) { return cmd == BIO_CTRL_FLUSH ? 1 : 0; }

int BioCreate(BIO* b) {
  BIO_set_data(b, nullptr);
  BIO_set_init(b, 1);
  return 1;
}

const BIO_METHOD* SocketMethod() {
  static BIO_METHOD* const method = [] {
    BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "moerun socket");
    if (m == nullptr) return m;
    BIO_meth_set_write(m, BioWrite);
    BIO_meth_set_read(m, BioRead);
    BIO_meth_set_ctrl(m, BioCtrl);
    BIO_meth_set_create(m, BioCreate);
    return m;
  }();
  return method;
}

// The first queued OpenSSL error's reason ("unexpected eof while reading"), or `fallback`.
std::string OpenSslReason(const std::string& fallback) {
  const unsigned long e = ERR_peek_last_error();
  if (e == 0) return fallback;
  const char* r = ERR_reason_error_string(e);
  return r != nullptr ? std::string(r) : fallback;
}

bool IsIpAddress(const std::string& s) {
  unsigned char buf[16];
  return inet_pton(AF_INET, s.c_str(), buf) == 1 || inet_pton(AF_INET6, s.c_str(), buf) == 1;
}

}  // namespace

struct TlsSession::Impl {
  SSL_CTX* ctx = nullptr;
  SSL* ssl = nullptr;
  std::mutex mu;        // every SSL_* call on ssl (one reader and one writer thread)
  bool broken = false;  // a fatal error: no more SSL calls but SSL_free
  bool handshaken = false;

  ~Impl() {
    if (ssl != nullptr) SSL_free(ssl);  // frees the BIO too
    if (ctx != nullptr) SSL_CTX_free(ctx);
  }

  // The result of an SSL call that did not succeed, as an Io (under mu, just after the call:
  // SSL_get_error reads this thread's error queue and errno).
  Io Fail(int rc, const char* what, std::string* error) {
    const int saved_errno = errno;
    switch (SSL_get_error(ssl, rc)) {
      case SSL_ERROR_WANT_READ:
        return Io::kWantRead;
      case SSL_ERROR_WANT_WRITE:
        return Io::kWantWrite;
      case SSL_ERROR_ZERO_RETURN:
        broken = true;
        return Io::kClosed;
      case SSL_ERROR_SYSCALL:
        broken = true;
        if (ERR_peek_error() == 0 &&
            (saved_errno == 0 || saved_errno == ECONNRESET || saved_errno == EPIPE)) {
          *error = saved_errno == 0 ? "the server closed the connection"
                                    : std::string("the server closed the connection (") +
                                          std::strerror(saved_errno) + ")";
          return Io::kClosed;
        }
        *error = std::string(what) + ": " +
                 OpenSslReason(saved_errno != 0 ? std::strerror(saved_errno) : "I/O error");
        return Io::kError;
      default:
        break;
    }
    broken = true;
    const unsigned long e = ERR_peek_last_error();
    if (ERR_GET_LIB(e) == ERR_LIB_SSL && ERR_GET_REASON(e) == SSL_R_UNEXPECTED_EOF_WHILE_READING) {
      *error = "the server closed the connection";
      return Io::kClosed;
    }
    const long verify = SSL_get_verify_result(ssl);
    if (!handshaken && verify != X509_V_OK) {
      *error =
          std::string("certificate verify failed (") + X509_verify_cert_error_string(verify) + ")";
    } else {
      *error = std::string(what) + ": " + OpenSslReason("TLS error");
    }
    return Io::kError;
  }
};

TlsSession::TlsSession(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TlsSession::~TlsSession() {
  if (impl_ && impl_->ssl != nullptr && impl_->handshaken && !impl_->broken) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ERR_clear_error();
    SSL_shutdown(impl_->ssl);  // non-blocking: sent now or not at all
    ERR_clear_error();
  }
}

Result<std::unique_ptr<TlsSession>> TlsSession::Create(int fd, const ClientTls& tls,
                                                       const std::string& host) {
  ERR_clear_error();
  auto impl = std::make_unique<Impl>();
  impl->ctx = SSL_CTX_new(TLS_client_method());
  if (impl->ctx == nullptr) return Status::Internal("TLS: " + OpenSslReason("SSL_CTX_new failed"));
  SSL_CTX* ctx = impl->ctx;
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, nullptr);
  for (const auto& [what, path] :
       {std::pair<const char*, const std::string&>{"ca_file", tls.ca_file},
        {"cert_file", tls.cert_file},
        {"key_file", tls.key_file}}) {
    if (!path.empty() && ::access(path.c_str(), R_OK) != 0) {
      return Status::InvalidArgument(std::string("tls ") + what + " " + path + ": " +
                                     std::strerror(errno));
    }
  }
  if (!tls.ca_file.empty()) {
    if (SSL_CTX_load_verify_locations(ctx, tls.ca_file.c_str(), nullptr) != 1) {
      return Status::InvalidArgument("tls ca_file " + tls.ca_file + ": " +
                                     OpenSslReason("cannot be loaded"));
    }
  } else if (SSL_CTX_set_default_verify_paths(ctx) != 1) {
    return Status::Internal("TLS: the system's CA store: " + OpenSslReason("cannot be loaded"));
  }
  if (tls.cert_file.empty() != tls.key_file.empty()) {
    return Status::InvalidArgument("tls: a client certificate needs both cert_file and key_file");
  }
  if (!tls.cert_file.empty()) {
    if (SSL_CTX_use_certificate_chain_file(ctx, tls.cert_file.c_str()) != 1) {
      return Status::InvalidArgument("tls cert_file " + tls.cert_file + ": " +
                                     OpenSslReason("cannot be loaded"));
    }
    if (SSL_CTX_use_PrivateKey_file(ctx, tls.key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(ctx) != 1) {
      return Status::InvalidArgument("tls key_file " + tls.key_file + ": " +
                                     OpenSslReason("cannot be loaded"));
    }
  }
  // Partial writes: a Write returns once a record is out, as send(2) does; the moving buffer:
  // a retried Write may pass its bytes from another address.
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);

  impl->ssl = SSL_new(ctx);
  const BIO_METHOD* method = SocketMethod();
  BIO* bio = method != nullptr ? BIO_new(method) : nullptr;
  if (impl->ssl == nullptr || bio == nullptr) {
    if (bio != nullptr) BIO_free(bio);
    return Status::Internal("TLS: " + OpenSslReason("cannot create a session"));
  }
  BIO_set_data(bio, reinterpret_cast<void*>(static_cast<intptr_t>(fd)));
  SSL_set_bio(impl->ssl, bio, bio);  // the SSL owns the BIO

  const std::string& name = tls.server_name.empty() ? host : tls.server_name;
  if (name.empty()) return Status::InvalidArgument("tls: no server name to verify");
  if (IsIpAddress(name)) {
    // An address: checked against the certificate's IP SANs; no SNI (RFC 6066: names only).
    if (X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(impl->ssl), name.c_str()) != 1) {
      return Status::InvalidArgument("tls: cannot check the address " + name);
    }
  } else {
    if (SSL_set_tlsext_host_name(impl->ssl, name.c_str()) != 1 ||
        SSL_set1_host(impl->ssl, name.c_str()) != 1) {
      return Status::InvalidArgument("tls: cannot check the server name '" + name + "'");
    }
  }
  return std::unique_ptr<TlsSession>(new TlsSession(std::move(impl)));
}

TlsSession::Io TlsSession::Handshake(std::string* error) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  ERR_clear_error();
  errno = 0;
  const int rc = SSL_connect(impl_->ssl);
  if (rc == 1) {
    impl_->handshaken = true;
    return Io::kDone;
  }
  return impl_->Fail(rc, "handshake", error);
}

TlsSession::Io TlsSession::Read(void* buf, size_t n, size_t* got, std::string* error) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->broken) {
    *error = "the connection is broken";
    return Io::kError;
  }
  ERR_clear_error();
  errno = 0;
  const int rc = SSL_read_ex(impl_->ssl, buf, n, got);
  if (rc == 1) return Io::kDone;
  *got = 0;
  return impl_->Fail(rc, "read", error);
}

TlsSession::Io TlsSession::Write(const void* buf, size_t n, size_t* sent, std::string* error) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->broken) {
    *error = "the connection is broken";
    return Io::kError;
  }
  ERR_clear_error();
  errno = 0;
  const int rc = SSL_write_ex(impl_->ssl, buf, n, sent);
  if (rc == 1) return Io::kDone;
  *sent = 0;
  return impl_->Fail(rc, "write", error);
}

std::string TlsSession::Describe() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return std::string(SSL_get_version(impl_->ssl)) + " " + SSL_get_cipher_name(impl_->ssl);
}

}  // namespace moerun
