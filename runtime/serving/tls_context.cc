#include "runtime/serving/tls_context.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <boost/asio/ssl/context.hpp>
#include <cstdio>

#include "runtime/serving/control_auth.h"

namespace moerun {

namespace asio = boost::asio;

std::string TlsErrors() {
  std::string out;
  while (const unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    // "error:0A000086:SSL routines::certificate verify failed": keep the reason after the last ':'.
    std::string text = buf;
    const auto colon = text.rfind(':');
    if (colon != std::string::npos && colon + 1 < text.size()) text = text.substr(colon + 1);
    if (out.find(text) != std::string::npos) continue;
    if (!out.empty()) out += "; ";
    out += text;
  }
  return out.empty() ? "unknown TLS error" : out;
}

namespace {

// OpenSSL's reason: from its error queue, else from the code Asio took from it.
Status Refuse(const std::string& what, const std::string& path,
              const boost::system::error_code& ec) {
  std::string why = TlsErrors();
  if (why == "unknown TLS error" && ec) why = ec.message();
  return Status::InvalidArgument("TLS: " + what + " " + path + ": " + why);
}

Status Readable(const std::string& path, const std::string& what) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return Status::NotFound("TLS: " + what + " " + path + " cannot be opened");
  std::fclose(f);
  return Status::Ok();
}

// "CN=router.example" of the certificate the context holds ("" if it has none).
std::string SubjectOf(SSL_CTX* ctx) {
  X509* cert = SSL_CTX_get0_certificate(ctx);
  if (cert == nullptr) return "";
  char buf[256] = {};
  X509_NAME_oneline(X509_get_subject_name(cert), buf, sizeof buf - 1);
  return buf;
}

}  // namespace

TlsServerContext::~TlsServerContext() = default;

Result<std::shared_ptr<TlsServerContext>> TlsServerContext::Load(const TlsServerFiles& files) {
  if (files.cert_file.empty() || files.key_file.empty()) {
    return Status::InvalidArgument(
        "TLS needs both cert_file and key_file (got " +
        std::string(files.cert_file.empty() ? "no cert_file" : "no key_file") + ")");
  }
  MOERUN_RETURN_IF_ERROR(Readable(files.cert_file, "certificate file"));
  MOERUN_RETURN_IF_ERROR(CheckPrivateFile(files.key_file, "TLS key file"));
  MOERUN_RETURN_IF_ERROR(Readable(files.key_file, "key file"));
  ERR_clear_error();
  std::shared_ptr<TlsServerContext> t(new TlsServerContext());
  t->ctx_ = std::make_unique<asio::ssl::context>(asio::ssl::context::tls_server);
  asio::ssl::context& c = *t->ctx_;
  boost::system::error_code ec;
  c.set_options(asio::ssl::context::default_workarounds | asio::ssl::context::no_sslv2 |
                    asio::ssl::context::no_sslv3 | asio::ssl::context::no_tlsv1 |
                    asio::ssl::context::no_tlsv1_1 | asio::ssl::context::single_dh_use,
                ec);
  if (ec) return Status::Internal("TLS: cannot set the context's options: " + ec.message());
  SSL_CTX* raw = c.native_handle();
  SSL_CTX_set_min_proto_version(raw, TLS1_2_VERSION);
  // Connections are short-lived and many: no session cache to grow under a handshake flood.
  SSL_CTX_set_session_cache_mode(raw, SSL_SESS_CACHE_OFF);
  // An idle connection gives its record buffers back (silent connections cost little memory).
  SSL_CTX_set_mode(raw, SSL_MODE_RELEASE_BUFFERS);
  c.use_certificate_chain_file(files.cert_file, ec);
  if (ec) return Refuse("certificate file", files.cert_file, ec);
  c.use_private_key_file(files.key_file, asio::ssl::context::pem, ec);
  if ((ec && ec.message().find("mismatch") != std::string::npos) ||
      (!ec && SSL_CTX_check_private_key(raw) != 1)) {
    ERR_clear_error();
    return Status::InvalidArgument("TLS: key file " + files.key_file +
                                   " does not match the certificate in " + files.cert_file);
  }
  if (ec) return Refuse("key file", files.key_file, ec);
  t->description_ = "TLS (certificate " + SubjectOf(raw);
  if (!files.client_ca_file.empty()) {
    MOERUN_RETURN_IF_ERROR(Readable(files.client_ca_file, "client CA file"));
    c.load_verify_file(files.client_ca_file, ec);
    if (ec) return Refuse("client CA file", files.client_ca_file, ec);
    c.set_verify_mode(asio::ssl::verify_peer | asio::ssl::verify_fail_if_no_peer_cert, ec);
    if (ec) return Status::Internal("TLS: cannot require client certificates: " + ec.message());
    t->description_ += ", client certificates required";
  }
  t->description_ += ")";
  return t;
}

}  // namespace moerun
