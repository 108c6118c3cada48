// The client side of TLS for ServeConnection (runtime/serving/serve_client.h): a TLS session over a
// connected, non-blocking TCP socket, with OpenSSL kept inside tls_client.cc.
//
// The peer is always verified: its certificate chain against ClientTls::ca_file (or the system's
// default store), and its name (a host name: the certificate's DNS names; a numeric IPv4/IPv6
// address: its IP addresses). There is no insecure mode.
//
// Thread-safety: Read and Write may be called from two threads at once (one reader, one
// writer); every call into OpenSSL holds the session's mutex, only for that non-blocking call.
// Neither call ever waits: they say what the socket must become (readable, writable) and the
// caller polls the fd within its own deadline, without any lock held.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "base/status.h"

namespace moerun {

// TLS of a client connection (ClientOptions::tls).
struct ClientTls {
  bool enabled = false;
  std::string ca_file;      // PEM CA certificate(s) the server is verified with; empty: system
  std::string server_name;  // SNI and the name checked; empty: the host of the target
  std::string cert_file;    // client certificate (PEM chain) for mTLS; optional
  std::string key_file;     // its private key (PEM); with cert_file
};

class TlsSession {
 public:
  // A session on `fd` (connected, non-blocking; not owned: close it after destroying the
  // session), before its handshake. `host` is the target's host, checked when tls.server_name
  // is empty. Errors: kInvalidArgument for a CA, certificate or key file that cannot be loaded
  // ("tls ca_file /x: ..."), kInternal when OpenSSL cannot set up.
  static Result<std::unique_ptr<TlsSession>> Create(int fd, const ClientTls& tls,
                                                    const std::string& host);
  // Sends a close_notify when the connection is still sound (one non-blocking try).
  ~TlsSession();
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  // The outcome of one non-blocking Read or Write.
  enum class Io {
    kDone,       // *n bytes moved (> 0)
    kWantRead,   // poll the fd for POLLIN, then call again (a Write: with the same bytes)
    kWantWrite,  // poll the fd for POLLOUT, then call again
    kClosed,     // the peer ended the connection (close_notify or end of stream)
    kError,      // *error says why (the connection is unusable)
  };

  // One step of the handshake: kDone when it is complete (certificate and name verified),
  // kWantRead/kWantWrite: poll and call again; kClosed/kError with *error one line such as
  // "certificate verify failed (self-signed certificate)" or "the server closed the connection".
  Io Handshake(std::string* error);

  // Up to `n` bytes of plaintext. Data OpenSSL already holds is returned before kWantRead.
  Io Read(void* buf, size_t n, size_t* got, std::string* error);
  // Up to `n` bytes; after kWantRead/kWantWrite the next Write must pass the same bytes again
  // (at the same or another address; OpenSSL may have sent part of them already).
  Io Write(const void* buf, size_t n, size_t* sent, std::string* error);

  // "TLSv1.3 TLS_AES_256_GCM_SHA384" (logs, tests).
  std::string Describe() const;

 private:
  struct Impl;
  explicit TlsSession(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moerun
