#include "launch/moebench/client_common.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "base/dtype.h"
#include "base/log.h"
#include "runtime/serving/control_auth.h"
#include "runtime/serving/frame.h"

namespace moerun::bench {
namespace {

uint64_t SplitMix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

float ElementAsFloat(const std::string& data, size_t elem, size_t i) {
  if (elem == 4) {
    float f;
    std::memcpy(&f, data.data() + 4 * i, 4);
    return f;
  }
  uint16_t v;
  std::memcpy(&v, data.data() + 2 * i, 2);
  return Bf16ToF32(v);
}

}  // namespace

void AddClientOptions(CLI::App* cmd, ClientFlags* f) {
  cmd->add_option("--target", f->target,
                  "HOST:PORT of a router; HOST:PORT,HOST:PORT,... several routers of one "
                  "job: a request whose router dies is sent once more to the next")
      ->required();
  cmd->add_option("--key-file", f->key_file,
                  "Serving key file (chmod 600), for a server with serving.key_file");
  cmd->add_option("--tls-ca-file", f->tls_ca_file,
                  "Speak TLS, verifying the server with this PEM CA file (serving.tls)");
  cmd->add_option("--tls-server-name", f->tls_server_name,
                  "Name the server's certificate must carry (default: the target's host)");
}

void AddVerifyLayerOptions(CLI::App* cmd, LayerFlags* f, const std::string& model_use) {
  const std::string use = model_use.empty() ? "--verify" : model_use + "; --verify";
  auto* model = cmd->add_option("--model", f->model, "Model folder (" + use + ")");
  auto* preset = cmd->add_option("--preset", f->preset, "Preset name (" + use + ")");
  model->excludes(preset);
  cmd->add_option("--seed", f->seed, "--verify: preset seed")->default_val(1);
  cmd->add_option("--gate-skew", f->gate_skew,
                  "--verify: preset routing skew (as the server's preset.gate_skew)")
      ->default_val(0.0);
  cmd->add_option("--experts", f->experts, "--verify: preset expert count");
  cmd->add_option("--intermediate", f->intermediate,
                  "--verify: preset expert intermediate size (as the server's "
                  "preset.intermediate; default: the model's)");
  cmd->add_option("--weights-dtype", f->dtype,
                  "--verify: preset weights f32, bf16, f16, fp8, mxfp4")
      ->default_val("f32");
  cmd->add_option("--threads", f->threads, "--verify: threads of the local layer");
}

Status ValidateClientFlags(const ClientFlags& f) {
  if (f.target.empty()) return Status::InvalidArgument("--target HOST:PORT is required");
  MOERUN_RETURN_IF_ERROR(ParseTargets(f.target).status());
  if (!f.tls_server_name.empty() && f.tls_ca_file.empty()) {
    return Status::InvalidArgument(
        "--tls-server-name needs --tls-ca-file (the CA the server is verified with)");
  }
  return Status::Ok();
}

FailoverOptions FailoverOptionsFor(const ClientFlags& f) {
  FailoverOptions o;
  o.client.connect_timeout = std::chrono::milliseconds(2000);
  o.client.tls.enabled = !f.tls_ca_file.empty();
  o.client.tls.ca_file = f.tls_ca_file;
  o.client.tls.server_name = f.tls_server_name;
  return o;
}

Status ProbeTargets(const ClientFlags& f) {
  MOERUN_ASSIGN_OR_RETURN(std::vector<std::string> targets, ParseTargets(f.target));
  FailoverOptions o = FailoverOptionsFor(f);
  o.client.connect_timeout = ClientOptions{}.connect_timeout;
  FailoverClient probe(std::move(targets), 0, o);
  return probe.Connect();
}

Result<std::string> ReadServingKey(const ClientFlags& f) {
  if (f.key_file.empty()) return std::string();
  return ReadTokenFile(f.key_file).WithContext("--key-file");
}

std::vector<float> MakeInput(uint64_t seed, int p, int64_t count) {
  std::vector<float> x(static_cast<size_t>(count));
  const uint64_t base = SplitMix(seed ^ (static_cast<uint64_t>(p) << 32));
  for (size_t i = 0; i < x.size(); ++i) {
    const uint64_t z = SplitMix(base + i);
    x[i] = static_cast<float>(z >> 40) / 16777216.0f * 4.0f - 2.0f;
  }
  return x;
}

std::string FirstDifference(const std::string& got, const std::string& want, size_t elem_bytes,
                            int64_t hidden) {
  const size_t n = std::min(got.size(), want.size()) / elem_bytes;
  size_t i = 0;
  while (i < n &&
         std::memcmp(got.data() + i * elem_bytes, want.data() + i * elem_bytes, elem_bytes) == 0) {
    ++i;
  }
  if (i == n) {
    if (got.size() == want.size()) return "";
    return fmt::format("{} bytes, expected {}", got.size(), want.size());
  }
  return fmt::format("token {}, element {}: got {}, expected {}", static_cast<int64_t>(i) / hidden,
                     static_cast<int64_t>(i) % hidden, ElementAsFloat(got, elem_bytes, i),
                     ElementAsFloat(want, elem_bytes, i));
}

void AnswerCounts::Failed(bool measured, const std::string& kind, const std::string& why) {
  if (!measured) {
    ++warmup_requests;
    if (kind == "mismatch") ++warmup_mismatches;
    if (warmup_errors++ == 0) first_warmup_error = kind + ": " + why;
    return;
  }
  ++requests;
  if (errors[kind]++ == 0) first_error[kind] = why;
}

void AnswerCounts::Answered(bool measured, bool verified_answer) {
  if (!measured) {
    ++warmup_requests;
    return;
  }
  ++requests;
  ++ok;
  if (verified_answer) ++verified;
}

void AnswerCounts::Merge(const AnswerCounts& o) {
  requests += o.requests;
  ok += o.ok;
  verified += o.verified;
  for (const auto& [k, n] : o.errors) errors[k] += n;
  for (const auto& [k, why] : o.first_error) first_error.emplace(k, why);
  warmup_requests += o.warmup_requests;
  if (warmup_errors == 0) first_warmup_error = o.first_warmup_error;
  warmup_errors += o.warmup_errors;
  warmup_mismatches += o.warmup_mismatches;
}

int64_t AnswerCounts::error_count() const {
  int64_t n = 0;
  for (const auto& [k, c] : errors) n += c;
  return n;
}

nlohmann::json AnswerCountsJson(const AnswerCounts& c) {
  return {{"requests", c.requests},
          {"ok", c.ok},
          {"errors", c.errors},
          {"error_count", c.error_count()},
          {"verified", c.verified},
          {"warmup",
           {{"requests", c.warmup_requests},
            {"errors", c.warmup_errors},
            {"mismatches", c.warmup_mismatches}}}};
}

int ExitCodeOfAnswers(const std::string& bench, const AnswerCounts& c, bool verify,
                      bool failed_otherwise) {
  // Wrong answers alone (every failure, warm-up included, an answer that differs from the local
  // layer) exit kExitAnswersDiffer, so that a test expecting them can tell them from a bench that
  // failed for another reason (a refused connection, a timeout), which exits 1.
  bool other_failure = failed_otherwise;
  int64_t mismatches = c.warmup_mismatches;
  for (const auto& [kind, n] : c.errors) {
    std::fprintf(stderr, "%s: %lld %s errors (first: %s)\n", bench.c_str(),
                 static_cast<long long>(n), kind.c_str(), c.first_error.at(kind).c_str());
    if (kind == "mismatch") {
      mismatches += n;
    } else {
      other_failure = true;
    }
  }
  if (c.warmup_errors > 0) {
    std::fprintf(stderr, "%s: %lld errors during the warm-up (first: %s)\n", bench.c_str(),
                 static_cast<long long>(c.warmup_errors), c.first_warmup_error.c_str());
    if (c.warmup_errors > c.warmup_mismatches) other_failure = true;
  }
  if (other_failure || (mismatches > 0 && !verify)) return 1;
  if (mismatches > 0) {
    std::fprintf(stderr, "%s: %lld answers differ from the local layer (exit %d)\n", bench.c_str(),
                 static_cast<long long>(mismatches), kExitAnswersDiffer);
    return kExitAnswersDiffer;
  }
  return 0;
}

double Percentile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size())));
  return sorted[std::min(sorted.size() - 1, rank == 0 ? 0 : rank - 1)];
}

nlohmann::json LatencyJson(std::vector<double>* ms) {
  std::sort(ms->begin(), ms->end());
  double mean = 0;
  for (double v : *ms) mean += v;
  if (!ms->empty()) mean /= static_cast<double>(ms->size());
  return {{"p50", Percentile(*ms, 0.50)},
          {"p90", Percentile(*ms, 0.90)},
          {"p99", Percentile(*ms, 0.99)},
          {"max", ms->empty() ? 0.0 : ms->back()},
          {"mean", mean},
          {"count", ms->size()}};
}

Status SendRequestFrame(ServeConnection* c, uint64_t id, std::string_view body,
                        std::string_view extra, Deadline deadline) {
  uint8_t prefix[kFrameHeaderBytes + 11];
  size_t n = kFrameHeaderBytes;
  prefix[n++] = 0x08;  // field 1 (id), varint
  uint64_t v = id;
  while (v >= 0x80) {
    prefix[n++] = static_cast<uint8_t>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  prefix[n++] = static_cast<uint8_t>(v);
  PutFrameLength(static_cast<uint32_t>(n - kFrameHeaderBytes + body.size() + extra.size()), prefix);
  const std::string_view parts[] = {std::string_view(reinterpret_cast<const char*>(prefix), n),
                                    body, extra};
  return c->SendParts(parts, deadline);
}

}  // namespace moerun::bench
