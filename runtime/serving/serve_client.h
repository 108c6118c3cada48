// A blocking client of the serving and control protocols: one TCP connection to a router, frames
// as in frame.h (InferRequest/ControlRequest out, InferResponse/ControlResponse back). Used by
// `moebench serve`, moectl and the tests.
//
// Nothing blocks without a deadline: every wait is a poll() bounded by the caller's Deadline
// (only the name lookup of Connect is not: give numeric addresses where that matters). Several
// requests may be in flight on one connection; answers come back in any order, matched by id.
//
// TLS (ClientOptions::tls.enabled): the same frames inside TLS 1.2 or newer; Connect does the
// handshake (within connect_timeout), verifying the server's certificate and name always
// (runtime/serving/tls_client.h). Send, SendRaw, SendParts and Receive then go through TLS, with
// the same deadlines and the same thread-safety.
//
// Thread-safety: one thread may Send while another Receives (the two directions share no state
// but the TLS session, whose every call is under its own mutex);
// two Sends, or two Receives, at once are not allowed. Shutdown may be called from any thread and
// wakes a blocked Send or Receive; Close and the destructor only when no call is running.
// After a Send that failed part-way the outgoing stream is out of sync and every later Send fails;
// after a receive error other than a deadline or an unparsable message, every later Receive fails.
#pragma once

#include <sys/uio.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/clock.h"
#include "base/status.h"
#include "moerun/v1/serving.pb.h"
#include "runtime/serving/frame.h"
#include "runtime/serving/tls_client.h"

namespace moerun {

struct ClientOptions {
  std::chrono::milliseconds connect_timeout{5000};
  uint32_t max_frame_bytes = kDefaultMaxFrameBytes;  // of the frames it accepts
  // The serving key (the server's serving.key_file), sent in every InferRequest that SendRequest
  // and Call send without one of its own; empty: none.
  std::string key;
  // TLS to the server (tls.enabled); off: plain TCP.
  ClientTls tls;
};

class ServeConnection {
 public:
  // "HOST:PORT" or "[IPv6]:PORT". Tries every address the name resolves to, each within
  // connect_timeout. Errors name the target: kInvalidArgument (not HOST:PORT), kUnavailable
  // (unknown host, refused, unreachable; with TLS: "connect to HOST:PORT: TLS handshake failed:
  // certificate verify failed (self-signed certificate)", or the server closed the handshake),
  // kDeadlineExceeded (no answer in time, the handshake included).
  static Result<std::unique_ptr<ServeConnection>> Connect(const std::string& host_port,
                                                          ClientOptions o = {});
  ~ServeConnection();
  ServeConnection(const ServeConnection&) = delete;
  ServeConnection& operator=(const ServeConnection&) = delete;

  // One frame holding m.
  Status Send(const google::protobuf::MessageLite& m, Deadline deadline);
  // Arbitrary bytes, sent as they are (tests: bad frames, frames split across writes).
  Status SendRaw(const void* bytes, size_t n, Deadline deadline);
  // The concatenation of several buffers in one gather write (a frame built from parts).
  Status SendParts(std::span<const std::string_view> parts, Deadline deadline);

  // Reads one frame and parses it into *m (InferResponse or ControlResponse). Errors:
  // kDeadlineExceeded (nothing complete in time; a partial frame is kept for the next call),
  // kUnavailable "connection closed by the server", kCorrupt (a frame over max_frame_bytes, or
  // bytes that are not a valid message), kIoError.
  Status Receive(google::protobuf::MessageLite* m, Deadline deadline);
  // The same, without parsing: the frame's body.
  Status ReceiveFrame(std::string* body, Deadline deadline);

  // One frame holding the request, with the options' key added when the request has none (as
  // an extra field after its bytes, so the request is not copied).
  Status SendRequest(const v1::InferRequest& request, Deadline deadline);

  // SendRequest + Receive for one request in flight; the answer must carry the request's id.
  Status Call(const v1::InferRequest& request, v1::InferResponse* response, Deadline deadline);

  int fd() const { return fd_; }
  // Whether the connection speaks TLS; "TLSv1.3 TLS_AES_256_GCM_SHA384" (empty: plain TCP).
  bool tls() const { return tls_ != nullptr; }
  std::string TlsDescription() const { return tls_ ? tls_->Describe() : std::string(); }
  const std::string& target() const { return target_; }
  // Shuts both directions down (wakes a thread blocked in Send or Receive); the fd stays open.
  void Shutdown();
  void Close();

 private:
  ServeConnection(int fd, std::string target, ClientOptions o, std::unique_ptr<TlsSession> tls);
  Status SendIov(struct iovec* iov, int count, Deadline deadline);
  // One write of the iovs' first bytes: sendmsg, or one TLS write (small buffers gathered
  // into wbuf_ first). >= 0: bytes written; -1: wait for *events and try again with the same
  // iovs; -2: failed (*error set).
  ssize_t WriteSome(const struct iovec* iov, int count, short* events, Status* error);

  int fd_ = -1;
  std::string target_;
  ClientOptions opts_;
  Status send_error_;  // sticky: the outgoing stream is out of sync
  Status recv_error_;  // sticky: closed, reset or lost sync
  FrameDecoder decoder_;
  std::vector<char> rbuf_;
  std::unique_ptr<TlsSession> tls_;  // null: plain TCP
  std::vector<char> wbuf_;           // TLS: small buffers gathered into one record
};

// The bytes of InferRequest.key = `key` as a field: appended to a serialized request, they set
// its key (Protobuf: the last value of a field wins).
std::string EncodeKeyField(const std::string& key);

// Fills dtype, shape [tokens, hidden] and data (row-major, little-endian) from x. BF16 rounds to
// nearest even (NaN stays NaN); any dtype other than BF16 is written (and set) as F32.
void SetRequestData(v1::InferRequest* r, const float* x, int64_t tokens, int64_t hidden,
                    v1::DType dtype);
// The answer's data as floats. Errors: the server's error (code != OK, see StatusFromResponse), a
// dtype other than F32/BF16, or data whose size is not product(shape) x dtype size (kCorrupt).
Result<std::vector<float>> ResponseFloats(const v1::InferResponse& r);

// The server's ErrorCode as a Status (OK: Status::Ok()), "server: overloaded: <message>".
Status StatusFromResponse(v1::ErrorCode code, const std::string& message);
// "overloaded", "deadline_exceeded", ... (lowercase ErrorCode names; "code_N" if unknown).
std::string ErrorCodeKind(v1::ErrorCode code);

}  // namespace moerun
