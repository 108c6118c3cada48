// TLS for the framed endpoints (serving and control): the server side's certificate, key and
// optional client CA, loaded once into an OpenSSL context that every accepted connection shares.
// The wire inside TLS is the same length-prefixed frames as without it (runtime/serving/frame.h).
//
// Policy: TLS 1.2 or newer; the key file must not be readable by group or others (the token
// files' rule, runtime/serving/control_auth.h); with client_ca_file, a client must present a
// certificate signed by that CA (mutual TLS). Errors name the file and OpenSSL's reason.
//
// Thread-safety: a loaded context is immutable and may be shared by connections on any thread.
#pragma once

#include <memory>
#include <string>

#include "base/status.h"

namespace boost::asio::ssl {
class context;
}

namespace moerun {

struct TlsServerFiles {
  std::string cert_file;       // PEM certificate chain (the server's first)
  std::string key_file;        // PEM private key, chmod 600
  std::string client_ca_file;  // optional: require client certificates signed by this CA
  bool enabled() const { return !cert_file.empty() || !key_file.empty(); }
};

class TlsServerContext {
 public:
  // Loads and checks the files (the key must match the certificate). kInvalidArgument for a
  // missing half (a key without a certificate), an unsafe key file mode, or files OpenSSL
  // refuses; kNotFound for a missing file.
  static Result<std::shared_ptr<TlsServerContext>> Load(const TlsServerFiles& files);
  ~TlsServerContext();

  boost::asio::ssl::context& native() { return *ctx_; }
  // "TLS (certificate CN=..., client certificates required)" for the endpoint's log line.
  const std::string& description() const { return description_; }

 private:
  TlsServerContext() = default;
  std::unique_ptr<boost::asio::ssl::context> ctx_;
  std::string description_;
};

// OpenSSL's reasons for the last failure on this thread, joined ("no such file; PEM lib"), and
// the error queue cleared.
std::string TlsErrors();

}  // namespace moerun
