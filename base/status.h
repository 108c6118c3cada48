// Status and Result<T>: how fallible calls report errors across module boundaries.
//
// Nothing in moerun throws across a module boundary; a call that can fail returns a Status (no
// value) or a Result<T> (a value or a Status). Both are cheap to move and safe to copy. They carry
// a code and a human-readable message that names what failed (a file, a tensor, a config key), so
// that a user reading it can fix the input without a debugger.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace moerun {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // bad input from the user: flags, configs, shapes
  kNotFound,         // a file, tensor or config key that should exist does not
  kCorrupt,          // a file or message that is malformed
  kUnsupported,      // valid but not implemented (yet): FP8, MXFP4, unknown family
  kIoError,          // the operating system refused (open, mmap, write)
  kResourceExhausted,
  kDeadlineExceeded,  // a peer or a request did not finish in time
  kUnavailable,       // a peer or service is gone or shutting down
  kInternal,
};

const char* StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) {
    return {StatusCode::kInvalidArgument, std::move(m)};
  }
  static Status NotFound(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
  static Status Corrupt(std::string m) { return {StatusCode::kCorrupt, std::move(m)}; }
  static Status Unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
  static Status IoError(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
  static Status ResourceExhausted(std::string m) {
    return {StatusCode::kResourceExhausted, std::move(m)};
  }
  static Status DeadlineExceeded(std::string m) {
    return {StatusCode::kDeadlineExceeded, std::move(m)};
  }
  static Status Unavailable(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "corrupt: model.safetensors: header length 9999 exceeds file size 120"
  std::string ToString() const;

  // Prepends context: Status::Corrupt("bad dtype").WithContext("model.safetensors")
  //   -> "model.safetensors: bad dtype".
  Status WithContext(const std::string& context) const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// A value or an error. Access the value only after checking ok().
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}  // NOLINT: implicit by design

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOkStatus;
    return ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  // The error with `context` prepended (Status::WithContext); a value passes through.
  Result WithContext(const std::string& context) && {
    if (ok()) return std::move(*this);
    return status().WithContext(context);
  }

 private:
  std::variant<T, Status> v_;
};

#define MOERUN_CONCAT_INNER_(a, b) a##b
#define MOERUN_CONCAT_(a, b) MOERUN_CONCAT_INNER_(a, b)

#define MOERUN_RETURN_IF_ERROR(expr)         \
  do {                                       \
    ::moerun::Status moerun_st_ = (expr);    \
    if (!moerun_st_.ok()) return moerun_st_; \
  } while (0)

#define MOERUN_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()

#define MOERUN_ASSIGN_OR_RETURN(lhs, expr) \
  MOERUN_ASSIGN_OR_RETURN_IMPL_(MOERUN_CONCAT_(moerun_res_, __LINE__), lhs, expr)

}  // namespace moerun
