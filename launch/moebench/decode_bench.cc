#include "launch/moebench/decode_bench.h"

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/exit_code.h"
#include "base/log.h"
#include "launch/moebench/decode_chain.h"
#include "launch/moebench/decode_report.h"
#include "launch/moebench/decode_run.h"
#include "launch/moebench/decode_workload.h"
#include "runtime/model/model_spec.h"
#include "runtime/serving/serve_client.h"

namespace moerun::bench {
namespace {

using Clock = SteadyClock;
using std::chrono::milliseconds;

constexpr size_t kMaxExpectedBytes = size_t{4} << 30;  // --verify's answers held in memory
constexpr int kLonePasses = 2;                         // lone requests: every layer twice
constexpr int kMaxFailedStepsInARow = 3;

// Everything a run needs once the job and the model are known.
struct Setup {
  std::vector<std::string> targets;
  FailoverOptions client;
  DecodeWorkload w;
  std::vector<MicroBatch> microbatches;
  DecodeRunOptions run;
};

std::string LayerListText(const std::vector<int>& layers) {
  std::string s;
  for (size_t i = 0; i < layers.size(); ++i) {
    size_t j = i;
    while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) ++j;
    if (!s.empty()) s += ',';
    s += std::to_string(layers[i]);
    if (j > i) s += fmt::format("-{}", layers[j]);
    i = j;
  }
  return s;
}

// The hidden size and the candidate layers: the model's (--model/--preset; --layers must be MoE
// layers of it), or --hidden and --layers as given.
Status ResolveModel(const DecodeBenchFlags& f, Setup* s, bool* layers_given) {
  std::vector<int> listed;
  *layers_given = !f.layers.empty();
  if (*layers_given) {
    MOERUN_ASSIGN_OR_RETURN(listed, ParseLayerList(f.layers));
  }
  if (f.layer.model.empty() && f.layer.preset.empty()) {
    s->w.hidden = f.hidden;
    s->w.layers = listed;
    return Status::Ok();
  }
  MOERUN_ASSIGN_OR_RETURN(const ModelSpec spec, SpecFromFlags(f.layer));
  if (f.hidden != 0 && f.hidden != spec.hidden) {
    return Status::InvalidArgument("--hidden " + std::to_string(f.hidden) + " but the model's is " +
                                   std::to_string(spec.hidden));
  }
  s->w.hidden = spec.hidden;
  if (!*layers_given) {
    s->w.layers = spec.moe_layers;
    return Status::Ok();
  }
  for (int l : listed) {
    if (!spec.IsMoeLayer(l)) {
      return Status::InvalidArgument("--layers: layer " + std::to_string(l) +
                                     " is not an MoE layer of the model (its MoE layers: " +
                                     LayerListText(spec.moe_layers) + ")");
    }
  }
  s->w.layers = listed;
  return Status::Ok();
}

// One request per candidate layer, of the largest micro-batch's tokens: the layers the job
// serves (without --layers the others are left out; with it each must be served) and a request
// size it takes. The job's refusals are kInvalidArgument (exit 2), naming the layer and quoting
// the server.
Status ProbeLayers(bool layers_given, Setup* s) {
  FailoverClient client(s->targets, 0, s->client);
  const int64_t tokens = s->microbatches.front().count;
  v1::InferRequest request;
  v1::InferResponse response;
  std::vector<int> served;
  std::string first_refusal;
  uint64_t id = uint64_t{0xfffe} << 40;
  for (int layer : s->w.layers) {
    request.set_id(++id);
    request.set_layer(layer);
    request.set_deadline_ms(s->run.deadline_ms);
    SetRequestData(&request, s->w.starts[0].data(), tokens, s->w.hidden,
                   s->w.bf16 ? v1::BF16 : v1::F32);
    const Status st = client.Call(request, &response, Clock::now() + s->run.wait);
    if (!st.ok()) return st.WithContext("checking layer " + std::to_string(layer));
    if (response.code() == v1::OK) {
      served.push_back(layer);
      continue;
    }
    const std::string why =
        "the job at " + client.target() + " refuses layer " + std::to_string(layer) +
        " (a request of " + std::to_string(tokens) + " x " + std::to_string(s->w.hidden) +
        " values): " + ErrorCodeKind(response.code()) + ": " + response.message();
    if (response.code() != v1::INVALID_ARGUMENT) return Status::Unavailable(why);
    if (layers_given) return Status::InvalidArgument(why);
    if (first_refusal.empty()) first_refusal = why;
  }
  if (served.empty()) {
    return Status::InvalidArgument(
        "the job serves none of the model's MoE layers for these "
        "requests: " +
        first_refusal);
  }
  if (served.size() < s->w.layers.size()) {
    spdlog::info("the job serves {} of the model's {} MoE layers: {} (first refusal: {})",
                 served.size(), s->w.layers.size(), LayerListText(served), first_refusal);
  }
  s->w.layers = served;
  return Status::Ok();
}

// The steps: M threads (one per micro-batch) start each step together and the main thread times
// it; after the warm-up steps the lone requests run while the micro-batches wait.
void RunSteps(const DecodeBenchFlags& f, Setup* s, DecodeResult* r) {
  const int m = static_cast<int>(s->microbatches.size());
  std::vector<std::unique_ptr<MicroBatchRunner>> runners;
  for (int i = 0; i < m; ++i) {  // connected now: no step's time holds a connect (or handshake)
    auto client = std::make_unique<FailoverClient>(s->targets, static_cast<size_t>(i), s->client);
    if (Status st = client->Connect(); !st.ok()) {
      r->stopped = "micro-batch " + std::to_string(i) + ": " + st.ToString();
      return;
    }
    runners.push_back(std::make_unique<MicroBatchRunner>(
        s->w, s->run, i, s->microbatches[static_cast<size_t>(i)], std::move(client)));
  }
  struct Slot {
    int64_t step = 0;
    int p = 0;
    bool measured = false;
    bool stop = false;
  } slot;  // written by the main thread before a step's start; the barrier publishes it
  std::vector<char> ok(static_cast<size_t>(m), 0);
  std::barrier<> sync(m + 1);
  std::vector<std::thread> threads;
  for (int i = 0; i < m; ++i) {
    threads.emplace_back([&, i] {
      for (;;) {
        sync.arrive_and_wait();  // the step starts
        if (slot.stop) return;
        ok[static_cast<size_t>(i)] =
            runners[static_cast<size_t>(i)]->RunStep(slot.step, slot.p, slot.measured) ? 1 : 0;
        sync.arrive_and_wait();  // the step ends
      }
    });
  }
  const auto duration = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(f.duration_s > 0 ? f.duration_s : 10.0));
  Clock::time_point measure_start{}, measure_end{};
  int failed_in_a_row = 0;
  for (int64_t step = 0;; ++step) {
    const bool measured = step >= f.warmup_steps;
    if (step == f.warmup_steps) {
      FailoverClient lone(s->targets, 0, s->client);
      const Status connected = lone.Connect();  // the lone requests' times hold no connect
      Result<std::vector<double>> ms =
          connected.ok() ? LoneRoundTrips(s->w, s->run, &lone, kLonePasses) : connected;
      if (!ms.ok()) {
        r->stopped = ms.status().ToString();
        break;
      }
      r->lone_ms = std::move(*ms);
      measure_start = Clock::now();
      r->measure_start_unix_s =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
    }
    if (measured) {
      const int64_t done = step - f.warmup_steps;
      if (f.steps > 0 ? done >= f.steps : Clock::now() - measure_start >= duration) break;
    }
    slot.step = step;
    slot.p = static_cast<int>(step % static_cast<int64_t>(s->w.starts.size()));
    slot.measured = measured;
    const auto t0 = Clock::now();
    sync.arrive_and_wait();
    sync.arrive_and_wait();
    const auto t1 = Clock::now();
    bool all_ok = true;
    for (char c : ok) all_ok = all_ok && c != 0;
    if (!measured) {
      ++r->warmup_steps;
    } else if (all_ok) {
      ++r->steps;
      r->tokens += s->w.sequences;
      r->step_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    } else {
      ++r->failed_steps;
    }
    if (measured) measure_end = t1;
    for (const auto& runner : runners) {
      if (!runner->fatal().empty() && r->stopped.empty()) r->stopped = runner->fatal();
    }
    if (!r->stopped.empty()) break;
    failed_in_a_row = all_ok ? 0 : failed_in_a_row + 1;
    if (failed_in_a_row >= kMaxFailedStepsInARow) {
      r->stopped = std::to_string(failed_in_a_row) + " steps in a row failed";
      break;
    }
  }
  slot.stop = true;
  sync.arrive_and_wait();
  for (auto& t : threads) t.join();
  if (measure_end > measure_start) {
    r->wall_s = std::chrono::duration<double>(measure_end - measure_start).count();
  }
  for (const auto& runner : runners) {
    r->stats.Merge(runner->stats());
    r->failovers += runner->failovers();
    r->retried += runner->retried();
  }
}

}  // namespace

Status Validate(const DecodeBenchFlags& f) {
  const auto bad = [](const std::string& m) { return Status::InvalidArgument(m); };
  MOERUN_RETURN_IF_ERROR(ValidateClientFlags(f.client));
  if (f.sequences < 1 || f.sequences > (1 << 20)) return bad("--sequences must be in 1..1048576");
  if (f.pingpong < 1 || f.pingpong > 256) return bad("--pingpong must be in 1..256");
  if (f.pingpong > f.sequences) {
    return bad("--pingpong " + std::to_string(f.pingpong) + " is more micro-batches than the " +
               std::to_string(f.sequences) + " --sequences: each needs at least one sequence");
  }
  if (!f.layers.empty()) MOERUN_RETURN_IF_ERROR(ParseLayerList(f.layers).status());
  if (!std::isfinite(f.attention_us) || f.attention_us < 0 || f.attention_us > 1e7) {
    return bad("--attention-us must be in 0..10000000");
  }
  if (f.steps < 0 || f.steps > 1000000000) return bad("--steps must be in 0..1000000000");
  if (!std::isfinite(f.duration_s) || f.duration_s < 0 || f.duration_s > 86400) {
    return bad("--duration must be in (0, 86400] seconds");
  }
  if (f.steps > 0 && f.duration_s > 0) return bad("give --steps or --duration, not both");
  if (f.warmup_steps < 0 || f.warmup_steps > 100000) return bad("--warmup must be in 0..100000");
  if (f.dtype != "f32" && f.dtype != "bf16") {
    return bad("--dtype must be f32 or bf16, not '" + f.dtype + "'");
  }
  if (f.deadline_ms < 0 || f.deadline_ms > 86400000) {
    return bad("--deadline-ms must be in 0..86400000 (0: the server's default)");
  }
  if (f.hidden < 0 || f.hidden > (1 << 20)) return bad("--hidden must be in 1..1048576");
  if (f.inputs < 1 || f.inputs > 1024) return bad("--inputs must be in 1..1024");
  const bool model = !f.layer.model.empty() || !f.layer.preset.empty();
  if (!model) {
    if (f.verify) return bad("--verify needs the model: --model DIR or --preset NAME");
    if (f.hidden == 0 || f.layers.empty()) {
      return bad("without --model or --preset, give --hidden H and --layers LIST");
    }
  } else if (!f.layer.model.empty() && !f.layer.preset.empty()) {
    return bad("give one of --model DIR and --preset NAME");
  }
  return ValidateLayerFlags(f.layer);
}

int RunDecodeBench(const DecodeBenchFlags& f) {
  if (Status s = Validate(f); !s.ok()) return FailWith(s);
  if (Status s = ProbeTargets(f.client); !s.ok()) return FailWith(s);  // fail fast
  Setup s;
  s.targets = *ParseTargets(f.client.target);  // checked by Validate
  s.client = FailoverOptionsFor(f.client);
  Result<std::string> key = ReadServingKey(f.client);
  if (!key.ok()) return FailWith(key.status());
  s.client.client.key = *key;
  bool layers_given = false;
  if (Status st = ResolveModel(f, &s, &layers_given); !st.ok()) return FailWith(st);
  s.w.sequences = f.sequences;
  s.w.bf16 = f.dtype == "bf16";
  MakeStarts(f.inputs, f.seed_inputs, &s.w);
  s.microbatches = SplitSequences(f.sequences, f.pingpong);
  s.run.attention_us = f.attention_us;
  s.run.deadline_ms = static_cast<uint32_t>(f.deadline_ms);
  s.run.wait = f.deadline_ms > 0 ? milliseconds(f.deadline_ms + 5000) : milliseconds(60000);
  s.run.parts = f.parts;
  s.run.verify = f.verify;
  if (Status st = ProbeLayers(layers_given, &s); !st.ok()) return FailWith(st);
  if (f.verify) {
    if (Status st = ComputeExpected(f.layer, kMaxExpectedBytes, &s.w); !st.ok()) {
      return FailWith(st);
    }
  }
  std::string sizes;
  for (const MicroBatch& mb : s.microbatches) {
    sizes += fmt::format("{}{}", sizes.empty() ? "" : "+", mb.count);
  }
  spdlog::info(
      "decode {}: {} sequences in {} micro-batches ({}), layers {}, hidden {} ({}), attention "
      "{:.0f} us a layer (slept), {} + {} warm-up steps",
      f.client.target, f.sequences, f.pingpong, sizes, LayerListText(s.w.layers), s.w.hidden,
      f.dtype, f.attention_us,
      f.steps > 0 ? std::to_string(f.steps)
                  : fmt::format("{:.1f} s of", f.duration_s > 0 ? f.duration_s : 10.0),
      f.warmup_steps);
  DecodeResult r;
  RunSteps(f, &s, &r);
  const nlohmann::json report = DecodeReport(f, s.w, s.microbatches, &r);
  if (f.json) std::printf("%s\n", report.dump(2).c_str());
  PrintDecodeSummary(f, report, r);
  return DecodeExitCode(f, r);
}

}  // namespace moerun::bench
