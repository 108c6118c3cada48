// What moebench's clients of a serving endpoint share (`moebench serve`, `moebench decode`): the
// flags that say where the job is and how to reach it (routers, TLS, the serving key) and what
// it serves (--model/--preset and the preset's scaling, for --verify), the fixed pseudo-random
// inputs, how an answer that differs from the local layer is described, the counts of a run's
// answers and the exit code they make, and latency statistics in the JSON every moebench report
// uses. Functions are thread-safe; an AnswerCounts is one thread's (merged at the end).
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "launch/layer_flags.h"
#include "runtime/serving/failover_client.h"

namespace CLI {
class App;
}

namespace moerun::bench {

// moebench serve/decode --verify's exit code when the only failures are wrong answers.
inline constexpr int kExitAnswersDiffer = 3;

struct ClientFlags {
  std::string target;    // --target HOST:PORT[,HOST:PORT...] (failover)
  std::string key_file;  // --key-file: the serving key sent in every request (chmod 600)
  // TLS (a server with serving.tls): --tls-ca-file FILE, the CA the server's certificate is
  // verified with (implies TLS); --tls-server-name NAME, the name it must carry (default: the
  // host of each --target).
  std::string tls_ca_file;
  std::string tls_server_name;
};

// Adds --target (required), --key-file, --tls-ca-file and --tls-server-name to `cmd`.
void AddClientOptions(CLI::App* cmd, ClientFlags* f);
// Adds the flags of the local layer that --verify computes: --model, --preset (exclusive),
// --seed, --gate-skew, --experts, --intermediate, --weights-dtype (into f->dtype), --threads.
// `model_use` says what --model and --preset are for besides --verify ("": nothing).
void AddVerifyLayerOptions(CLI::App* cmd, LayerFlags* f, const std::string& model_use = "");

// The targets parse; --tls-server-name comes with --tls-ca-file. No I/O.
Status ValidateClientFlags(const ClientFlags& f);
// The client options the flags say (TLS; a 2 s connect timeout), without the key.
FailoverOptions FailoverOptionsFor(const ClientFlags& f);
// Connects once to the first target that answers, so that an unreachable job fails at once.
Status ProbeTargets(const ClientFlags& f);
// The serving key of --key-file ("" without one); the error names the flag.
Result<std::string> ReadServingKey(const ClientFlags& f);

// Sends the frame of request `id`: the frame header, the id (field 1), `body` and `extra` (more
// fields: a Protobuf message is the concatenation of its fields), in one gather write.
Status SendRequestFrame(ServeConnection* c, uint64_t id, std::string_view body,
                        std::string_view extra, Deadline deadline);

// Input p of `count` values, uniform in [-2, 2], from a counter-based hash of (seed, p): the same
// on every machine.
std::vector<float> MakeInput(uint64_t seed, int p, int64_t count);

// Where two answers' data (row-major [tokens][hidden] in elements of elem_bytes: 4 F32, 2 BF16)
// first differ: "token T, element E: got X, expected Y" (empty when they are equal).
std::string FirstDifference(const std::string& got, const std::string& want, size_t elem_bytes,
                            int64_t hidden);

// A run's answers: measured requests, the OK and verified ones, failures by kind ("mismatch": an
// answer that differs from the local layer; "io", "client_timeout", the server's codes...) with
// the first of each, and the warm-up's, left out of the statistics (their errors still fail the
// run).
struct AnswerCounts {
  int64_t requests = 0;
  int64_t ok = 0;
  int64_t verified = 0;
  std::map<std::string, int64_t> errors;
  std::map<std::string, std::string> first_error;
  int64_t warmup_requests = 0;
  int64_t warmup_errors = 0;
  int64_t warmup_mismatches = 0;  // of warmup_errors, the answers that differ
  std::string first_warmup_error;

  void Failed(bool measured, const std::string& kind, const std::string& why);
  void Answered(bool measured, bool verified_answer);
  void Merge(const AnswerCounts& o);
  int64_t error_count() const;
};

// requests, ok, errors (by kind), error_count, verified and warmup {requests, errors,
// mismatches}: the counts' part of a report.
nlohmann::json AnswerCountsJson(const AnswerCounts& c);

// The end of a run: each kind of failure with its count and first error on stderr ("serve: 3 io
// errors (first: ...)"), the warm-up's, then the exit code: kExitAnswersDiffer when, with
// --verify, every failure is an answer that differs; 1 when anything else failed (or
// `failed_otherwise`, or answers differ without --verify); else 0.
int ExitCodeOfAnswers(const std::string& bench, const AnswerCounts& c, bool verify,
                      bool failed_otherwise);

// The value at rank ceil(q · n) of `sorted` (0 for none).
double Percentile(const std::vector<double>& sorted, double q);
// p50, p90, p99, max, mean and count of `ms` (sorted in place).
nlohmann::json LatencyJson(std::vector<double>* ms);

}  // namespace moerun::bench
