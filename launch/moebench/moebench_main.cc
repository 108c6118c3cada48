// moebench: benchmarks that compare moerun against a baseline measured in the same run and
// print JSON. Subcommands: layer (one MoE layer vs the reference loop and OpenBLAS sgemm; on CUDA
// vs its floor and torch._grouped_mm), transport (dispatch + combine vs MPI_Alltoallv), serve
// (load on a router's serving endpoint), decode (a model's decode, one MoE layer at a time, against
// a serving job), replay (placements judged on recorded routing),
// cache-replay (the expert cache over recorded routing, against Belady's optimum), and sgemm (the
// baseline's child process). Bad flags exit with 2.
#include <CLI/CLI.hpp>
#include <sstream>

#include "base/log.h"
#include "launch/cli_options.h"
#include "launch/job_launch.h"
#include "launch/layer_flags.h"
#include "launch/moebench/cache_replay.h"
#include "launch/moebench/calibrate.h"
#include "launch/moebench/decode_bench.h"
#include "launch/moebench/layer_bench.h"
#include "launch/moebench/model_cmd.h"
#include "launch/moebench/replay_bench.h"
#include "launch/moebench/serve_bench.h"
#include "launch/moebench/sgemm_baseline.h"
#include "launch/moebench/transport_bench.h"

int main(int argc, char** argv) {
  try {
    moerun::InitLogging(moerun::RankFromEnvironment(), "bench");
    CLI::App app("moebench: moerun benchmarks (JSON, against a baseline in the same run)");
    app.require_subcommand(1);
    moerun::LogOptions log;
    moerun::AddLogOptions(app, &log);
    moerun::UseOneLineErrors(app, "moebench");

    moerun::bench::LayerBenchFlags lf;
    std::string tokens = "1,16,128,1024";
    CLI::App* layer = app.add_subcommand("layer", "Time one MoE layer against its baselines");
    auto* model = layer->add_option("--model", lf.layer.model, "Hugging Face model folder");
    auto* preset = layer->add_option("--preset", lf.layer.preset,
                                     "mixtral-8x7b, qwen3-30b-a3b, deepseek-v3, gpt-oss-20b, "
                                     "step-3.5-flash");
    model->excludes(preset);
    layer->add_option("--seed", lf.layer.seed, "Preset seed")->default_val(1);
    layer->add_option("--gate-skew", lf.layer.gate_skew, "Preset routing skew (Zipf exponent)")
        ->default_val(0.0);
    layer->add_option("--experts", lf.layer.experts,
                      "Preset expert count (default: fit 4 GB; --device cuda: all)");
    layer->add_option("--intermediate", lf.layer.intermediate,
                      "Preset expert intermediate size, scaled down (a multiple of 32; default: "
                      "the model's)");
    layer
        ->add_option("--dtype", lf.layer.dtype,
                     "Preset weights: f32, bf16, f16, fp8, mxfp4; a comma-separated list "
                     "(f32,bf16,fp8) times each in one run, on the same experts")
        ->default_val("f32");
    layer->add_option("--layer", lf.layer.layer, "Decoder layer (default: first MoE layer)");
    auto* tokens_opt =
        layer->add_option("--tokens", tokens, "Comma-separated token counts")->default_val(tokens);
    layer->add_option("--device", lf.device, "cpu or cuda")->default_val("cpu");
    layer->add_option("--math", lf.math, "--device cuda: tensor-core (bf16/f16) or exact (fp32)")
        ->default_val(lf.math);
    layer->add_option("--device-index", lf.device_index,
                      "--device cuda: GPU ordinal (default: local rank modulo the GPUs, or 0)");
    auto* anchors = layer->add_flag(
        "--anchors", lf.anchors,
        "--device cuda: the three shapes of ANCHORS.md (mixtral-8x7b, qwen3-30b-a3b, deepseek-v3, "
        "all experts, bf16) at 1,16,128,1024,8192 tokens (--tokens overrides)");
    anchors->excludes(model)->excludes(preset);
    bool torch_on = false, torch_off = false;
    auto* torch_flag = layer->add_flag(
        "--torch", torch_on,
        "--device cuda: time torch._grouped_mm in the same run (default: when importable)");
    layer->add_flag("--no-torch", torch_off, "--device cuda: skip the torch baseline")
        ->excludes(torch_flag);
    layer->add_option("--torch-script", lf.torch_script,
                      "The torch baseline (default: bench/torch_grouped.py of this source tree)");
    layer->add_option("--torch-python", lf.torch_python, "Python for the torch baseline")
        ->default_val(lf.torch_python);
    layer->add_option("--floor-gbps", lf.floor_gbps, "--device cuda floor: copy bandwidth, GB/s")
        ->default_val(lf.floor_gbps);
    layer
        ->add_option("--floor-tflops", lf.floor_tflops,
                     "--device cuda floor: dense matmul rate, TFLOP/s")
        ->default_val(lf.floor_tflops);
    layer->add_option("--threads", lf.layer.threads, "Threads (default: all cores)");
    layer->add_option("--isa", lf.layer.isa, "scalar, avx2, avx512 (default: best)");
    layer->add_option("--min-time", lf.min_seconds, "Seconds per measurement")->default_val(1.0);
    layer->add_option("--reference-tokens", lf.reference_tokens, "Tokens the reference loop times")
        ->default_val(2);
    layer->add_flag("--no-sgemm{false}", lf.sgemm, "Skip the OpenBLAS baseline");
    layer->add_flag("--json", lf.json, "Print the JSON report on stdout");
    layer->add_option("--plot", lf.plot,
                      "Also draw the time per token and x_floor over --tokens: an SVG FILE");

    moerun::bench::TransportBenchFlags tf;
    CLI::App* transport = app.add_subcommand(
        "transport", "Dispatch + combine against MPI_Alltoallv, and layer overlap (under mpirun)");
    transport->add_option("--tokens", tf.tokens, "Tokens per batch");
    transport->add_option("--bytes-per-peer", tf.bytes_per_peer,
                          "Or: choose the tokens so each expert rank gets about this many bytes");
    transport->add_option("--hidden", tf.hidden, "Hidden size")->default_val(7168);
    transport->add_option("--topk", tf.topk, "Experts per token")->default_val(8);
    transport->add_option("--experts", tf.experts, "Experts")->default_val(256);
    transport->add_option("--inter", tf.inter, "Expert intermediate size for the layer timing");
    transport->add_option("--shared-inter", tf.shared_inter,
                          "A shared expert of this size on the router (layer timing)");
    transport->add_option("--overlap-microbatch", tf.microbatch_tokens,
                          "Microbatch tokens of the overlapped layer timing (default: T/4)");
    transport->add_option("--iters", tf.iters, "Timed rounds")->default_val(20);
    transport->add_option("--seed", tf.seed, "Routing and weight seed")->default_val(1);
    transport->add_flag("--no-layer{false}", tf.layer, "Skip the whole-layer timing");
    transport->add_flag("--json", tf.json, "Print the JSON report on rank 0's stdout");
    moerun::AddLaunchFlags(transport, &tf.launch);
    // As for serve below: what the flags alone say is wrong fails the parse (one line, exit 2).
    layer->callback([&lf] {
      if (const moerun::Status s = moerun::ValidateLayerFlags(lf.layer); !s.ok()) {
        throw CLI::ValidationError(s.message());
      }
    });
    transport->callback([&tf] {
      if (const moerun::Status s = moerun::ValidateLaunchFlags(tf.launch); !s.ok()) {
        throw CLI::ValidationError(s.message());
      }
    });

    moerun::bench::ServeBenchFlags sf;
    CLI::App* serve = app.add_subcommand(
        "serve", "Load a router's serving endpoint (closed or open loop), optionally verified");
    moerun::bench::AddClientOptions(serve, &sf.client);
    serve->add_option("--concurrency", sf.concurrency, "Connections")->default_val(1);
    serve->add_option("--duration", sf.duration_s, "Measured seconds")->default_val(10);
    serve->add_option("--tokens-per-request", sf.tokens_per_request, "Tokens per request")
        ->default_val(1);
    serve->add_option("--rate", sf.rate, "Open loop: requests/s in total (default: closed loop)");
    serve->add_option("--layer", sf.layer.layer, "Model layer (default: the server's)");
    serve->add_option("--dtype", sf.dtype, "Request data: f32 or bf16")->default_val("f32");
    serve->add_option("--deadline-ms", sf.deadline_ms, "Deadline sent in each request")
        ->default_val(0);
    serve->add_option("--warmup", sf.warmup_s, "Seconds left out of the statistics")
        ->default_val(1.0);
    serve->add_option("--hidden", sf.hidden, "Hidden size (required without --verify)");
    serve->add_option("--inputs", sf.inputs, "Distinct request inputs")->default_val(64);
    serve->add_option("--seed-inputs", sf.seed_inputs, "Seed of the inputs")->default_val(1);
    serve->add_flag("--verify", sf.verify,
                    "Check every answer bitwise against the local layer (exit 3 when the only "
                    "failures are answers that differ from it)");
    moerun::bench::AddVerifyLayerOptions(serve, &sf.layer);
    serve
        ->add_option("--trace-share", sf.trace_share,
                     "Share of the requests sent with a new sampled W3C traceparent (a router "
                     "with tracing on exports their spans)")
        ->check(CLI::Range(0.0, 1.0));
    serve->add_option("--trace-log", sf.trace_log,
                      "With --trace-share, closed loop: write each traced request's "
                      "\"TRACEPARENT ROUND_TRIP_US CODE\" to this file");
    serve->add_flag("--json", sf.json, "Print the JSON report on stdout");
    serve->add_flag("--floor", sf.floor,
                    "After the run, as long again: the round trip's floor measured beside it "
                    "(client and transport ping-pongs, the layer in process) and x_floor; "
                    "needs --verify and --concurrency 1");
    serve->add_option("--plot", sf.plot,
                      "Also draw latency and throughput per second of the run: an SVG FILE");
    // The flags' combinations are checked while parsing, so that a bad one ends as any bad
    // command line does (one line, exit 2) before anything connects.
    serve->callback([&sf] {
      if (const moerun::Status s = moerun::bench::Validate(sf); !s.ok()) {
        throw CLI::ValidationError(s.message());
      }
    });

    moerun::bench::DecodeBenchFlags df;
    CLI::App* decode = app.add_subcommand(
        "decode",
        "A model's decode against a serving job: S sequences through every MoE layer in turn, "
        "the hidden state flowing, attention emulated by sleeping, ping-pong micro-batches");
    moerun::bench::AddClientOptions(decode, &df.client);
    decode
        ->add_option("--sequences", df.sequences,
                     "S: sequences decoded together (one token "
                     "each per layer)")
        ->default_val(1);
    decode
        ->add_option("--pingpong", df.pingpong,
                     "M: micro-batches of S/M sequences whose layers interleave, each on its "
                     "own connection")
        ->default_val(1);
    decode->add_option("--layers", df.layers,
                       "Layers, ascending, e.g. 3,5-9 (default: every MoE layer the job serves)");
    decode
        ->add_option("--attention-us", df.attention_us,
                     "One layer's attention time for all S sequences, emulated by sleeping (not "
                     "spinning: the cores stay the job's); a micro-batch sleeps its share")
        ->default_val(0.0);
    decode->add_option("--steps", df.steps, "Measured decode steps (instead of --duration)");
    decode->add_option("--duration", df.duration_s, "Measured seconds (default 10)");
    decode->add_option("--warmup", df.warmup_steps, "Decode steps left out of the statistics")
        ->default_val(1);
    decode->add_option("--dtype", df.dtype, "Request data: f32 or bf16")->default_val("f32");
    decode
        ->add_option("--deadline-ms", df.deadline_ms,
                     "Deadline sent in each request; the client waits 5 s more (default: the "
                     "server's deadline, and 60 s)")
        ->default_val(0);
    decode->add_option("--hidden", df.hidden, "Hidden size (without --model/--preset)");
    decode->add_option("--inputs", df.inputs, "Distinct start states, cycled over the steps")
        ->default_val(4);
    decode->add_option("--seed-inputs", df.seed_inputs, "Seed of the start states")->default_val(1);
    decode->add_flag("--verify", df.verify,
                     "Check every answer bitwise against the same layers computed in process "
                     "(exit 3 when the only failures are answers that differ)");
    decode->add_flag("--parts", df.parts,
                     "Ask for each answer's server timing and report each part's p50");
    moerun::bench::AddVerifyLayerOptions(decode, &df.layer, "its MoE layers and hidden size");
    decode->add_flag("--json", df.json, "Print the JSON report on stdout");
    decode->callback([&df] {
      if (const moerun::Status s = moerun::bench::Validate(df); !s.ok()) {
        throw CLI::ValidationError(s.message());
      }
    });

    moerun::bench::CacheReplayFlags cf;
    CLI::App* cache_replay = app.add_subcommand(
        "cache-replay",
        "The expert cache's policies over recorded token-level routing, against Belady's optimum");
    cache_replay
        ->add_option("--trace", cf.traces,
                     "Token-level routing: a .npy batch or .jsonl decode traces (repeatable)")
        ->required();
    cache_replay->add_option("--ranks", cf.ranks, "Expert ranks (linear placement), a list")
        ->delimiter(',');
    cache_replay
        ->add_option("--budget", cf.budgets,
                     "Cache budgets: fractions of a rank's hosted experts over all layers, a list")
        ->delimiter(',');
    cache_replay->add_option("--batch", cf.batches, "Tokens a batch (of one stream), a list")
        ->delimiter(',');
    cache_replay
        ->add_option("--policies", cf.policies,
                     "Eviction policies: adaptive, cycle, lfu, lru, a list")
        ->delimiter(',');
    cache_replay
        ->add_option("--lookahead", cf.lookahead,
                     "0: a step's Need after the previous Done; 1: before it (the next header)")
        ->delimiter(',');
    cache_replay
        ->add_option("--half-life", cf.half_lives,
                     "lfu/cycle half-lives in microbatches, a list (default: the cache's)")
        ->delimiter(',');
    cache_replay->add_flag("--json", cf.json, "Print the JSON report on stdout");
    cache_replay->callback([&cf] {
      if (const moerun::Status s = moerun::bench::Validate(cf); !s.ok()) {
        throw CLI::ValidationError(s.message());
      }
    });

    moerun::bench::ReplayBenchFlags rf;
    CLI::App* replay = app.add_subcommand(
        "replay", "Placements judged on recorded routing: window and per-batch balance, nodes");
    replay
        ->add_option("--trace", rf.traces,
                     "Recorded routing: .json (SGLang, OLMoE), .csv, .npy, .jsonl (repeatable)")
        ->required();
    replay->add_option("--ranks", rf.ranks, "Expert ranks, a list")->default_val(rf.ranks);
    replay->add_option("--redundant", rf.redundant,
                       "Redundant slots: one value, or one per --ranks value (default: = ranks)");
    replay->add_option("--nodes", rf.nodes, "Nodes the expert ranks span")->default_val(1);
    replay->add_option("--routers-per-node", rf.routers_per_node, "Routers on each node")
        ->default_val(1);
    replay->add_option("--groups", rf.groups, "Expert groups (EPLB hierarchical)")->default_val(1);
    replay->add_option("--batch", rf.batch, "Tokens per batch, a list")->default_val(rf.batch);
    replay->add_option("--policies", rf.policies, "Planner policies, a list")
        ->default_val(rf.policies);
    replay
        ->add_option("--plan-fraction", rf.plan_fraction,
                     "Plan on this first part of a token-level trace, judge on the rest (0: all)")
        ->default_val(0.0);
    replay->add_option("--split", rf.split, "How --plan-fraction cuts: tokens or streams")
        ->default_val(rf.split);
    replay->add_option("--experts", rf.experts,
                       "The model's expert count for .npy/.jsonl (default: max id + 1)");
    replay->add_option("--timing-runs", rf.timing_runs, "Planner runs (the median is reported)")
        ->default_val(3);
    replay
        ->add_option("--node-slack", rf.node_slack,
                     "node-aware: how far above the mean node load a node may go (a fraction)")
        ->default_val(rf.node_slack);
    replay
        ->add_option("--local-share", rf.local_share,
                     "node-local: the share of the redundant slots that become copies on other "
                     "nodes")
        ->default_val(rf.local_share);
    replay
        ->add_option("--copy-prior", rf.copy_prior,
                     "node-local: plan copies on the loads + this x their mean (0: the window's "
                     "hot experts; large: copies spread evenly, for unseen traffic)")
        ->default_val(rf.copy_prior);
    replay
        ->add_option("--spill", rf.spill,
                     "Routers prefer copies on their own node while that rank's load is within "
                     "its node's mean + S x the mean with every row kept on the node (the "
                     "runtime's dispatch.spill; negative: no preference)")
        ->default_val(rf.spill);
    replay
        ->add_option("--activated-batch", rf.activated_batch,
                     "Plan on the expected experts used per batch of this many tokens instead of "
                     "tokens (0: tokens)")
        ->default_val(0);
    replay
        ->add_option("--expert-bytes", rf.expert_bytes,
                     "Bytes of one expert: each plan's rebalance cost in bytes (from the job's "
                     "round-robin start, and to the plan on the judged part with --plan-fraction)")
        ->check(CLI::NonNegativeNumber);
    replay->add_flag("--json", rf.json, "Print the JSON report on stdout");
    replay->callback([&rf] {
      if (const moerun::Status s = moerun::bench::Validate(rf); !s.ok()) {
        throw CLI::ValidationError(s.message());
      }
    });

    moerun::bench::CalibrateFlags calf;
    CLI::App* calibrate = app.add_subcommand(
        "calibrate",
        "Measure this machine for `moebench model`: kernels, gate, combine (alone); the "
        "transport (under mpirun, or --transport inproc --ranks N)");
    calibrate->add_option("--out", calf.out,
                          "Write the profile here (merged into an existing one)");
    calibrate->add_flag("--quick", calf.quick, "Fewer points, shorter timings");
    calibrate->add_option("--preset", calf.preset, "Shape the kernels are timed on")
        ->default_val(calf.preset);
    calibrate->add_option("--experts", calf.experts, "Experts timed per pass")
        ->default_val(calf.experts);
    calibrate->add_option("--dtypes", calf.dtypes, "Weight types, a list")
        ->default_val(calf.dtypes);
    calibrate->add_option("--threads", calf.threads, "Kernel threads (default: all cores)");
    moerun::AddLaunchFlags(calibrate, &calf.launch);
    calibrate->callback([&calf] {
      if (const moerun::Status s = moerun::ValidateLaunchFlags(calf.launch); !s.ok()) {
        throw CLI::ValidationError(s.message());
      }
    });

    moerun::bench::ModelFlags mf;
    CLI::App* model_cmd = app.add_subcommand(
        "model", "Predict a layer's time by part, tokens/s, p50/p99 and memory per rank");
    model_cmd->add_option("--profile", mf.profile, "A profile of moebench calibrate");
    model_cmd->add_option("--device-gbps", mf.device_gbps, "Figures: device memory GB/s");
    model_cmd->add_option("--device-tflops", mf.device_tflops,
                          "Figures: device dense TFLOP/s for the weight type");
    model_cmd->add_option("--link-gbps", mf.link_gbps, "Figures: GB/s per rank within a node");
    model_cmd->add_option("--link-us", mf.link_us, "Figures: latency per message within a node");
    model_cmd->add_option("--net-gbps", mf.net_gbps, "Figures: GB/s per rank across nodes");
    model_cmd->add_option("--net-us", mf.net_us, "Figures: latency per message across nodes");
    model_cmd->add_option("--kernel-us", mf.kernel_us, "Figures: overhead per kernel pass")
        ->default_val(mf.kernel_us);
    model_cmd->add_option("--nodes", mf.nodes, "Figures: nodes")->default_val(1);
    model_cmd->add_option("--ranks-per-node", mf.ranks_per_node, "Figures: devices per node");
    auto* mm = model_cmd->add_option("--model", mf.model, "Model folder (config.json)");
    auto* mp = model_cmd->add_option("--preset", mf.preset, "Preset name");
    mm->excludes(mp);
    model_cmd->add_option("--experts", mf.experts, "Preset expert count (default: the full model)");
    model_cmd->add_option("--dtype", mf.dtype, "Weight type: f32, bf16, fp8, mxfp4")
        ->default_val(mf.dtype);
    model_cmd->add_option("--hidden", mf.hidden, "Override: hidden size");
    model_cmd->add_option("--inter", mf.inter, "Override: expert intermediate size");
    model_cmd->add_option("--shared-inter", mf.shared_inter,
                          "Override: shared expert size (0: none)");
    model_cmd->add_option("--top-k", mf.top_k, "Override: experts per token");
    model_cmd->add_option("--moe-layers", mf.moe_layers, "Override: MoE layers of the model");
    model_cmd
        ->add_option("--activation-bytes", mf.activation_bytes,
                     "Bytes per value of the rows sent and held (moerun: 4, F32)")
        ->default_val(mf.activation_bytes);
    model_cmd->add_option("--tokens", mf.tokens, "Tokens per batch")->default_val(mf.tokens);
    model_cmd->add_option("--microbatch-tokens", mf.microbatch_tokens, "Per router (0: off)")
        ->default_val(0);
    model_cmd->add_option("--routers", mf.routers, "Router ranks (profile)")->default_val(1);
    model_cmd->add_option("--ranks", mf.ranks, "Ranks, routers included (profile)");
    model_cmd->add_option("--transport", mf.transport, "The profile's transport entry")
        ->default_val(mf.transport);
    model_cmd->add_option("--placement", mf.placement, "linear, round_robin or a placement file")
        ->default_val(mf.placement);
    auto* loads = model_cmd->add_option("--loads", mf.loads, "Loads per expert: a file of numbers");
    model_cmd
        ->add_option("--gate-skew", mf.gate_skew, "Preset routing skew (sampled from its gate)")
        ->excludes(loads);
    model_cmd->add_option("--threads", mf.threads, "Kernel threads per rank (profile)");
    model_cmd->add_option("--rate", mf.rate, "Served: requests/s (0: no serving prediction)");
    model_cmd->add_option("--tokens-per-request", mf.tokens_per_request, "Served: tokens each")
        ->default_val(1);
    model_cmd->add_option("--max-batch-tokens", mf.max_batch_tokens, "Served: the batcher's")
        ->default_val(mf.max_batch_tokens);
    model_cmd->add_option("--max-wait-us", mf.max_wait_us, "Served: the batcher's")
        ->default_val(mf.max_wait_us);
    model_cmd
        ->add_option("--request-overhead-us", mf.request_overhead_us,
                     "Served: client and network time per request")
        ->default_val(0);

    std::string shapes;
    int threads = 0;
    double min_time = 1.0;
    CLI::App* sgemm = app.add_subcommand("sgemm", "OpenBLAS sgemm baseline (child process)");
    sgemm->add_option("--shapes", shapes, "MxNxK;MxNxK...")->required();
    sgemm->add_option("--threads", threads);
    sgemm->add_option("--min-time", min_time);

    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return moerun::ExitForParseError(app, e);  // prints the help or the one-line error
    }
    moerun::ApplyLogOptions(log, moerun::RankFromEnvironment(), "bench");
    if (layer->parsed()) {
      lf.torch = torch_on ? 1 : (torch_off ? 0 : -1);
      lf.tokens_given = tokens_opt->count() > 0;
      lf.tokens.clear();
      std::stringstream ss(tokens);
      std::string item;
      while (std::getline(ss, item, ',')) {
        try {
          size_t used = 0;
          const long long v = std::stoll(item, &used);
          if (used != item.size()) throw std::invalid_argument(item);
          lf.tokens.push_back(v);
        } catch (const std::exception&) {
          return moerun::ExitForParseError(
              app, CLI::ValidationError("--tokens: '" + item + "' is not a number"));
        }
      }
      return moerun::bench::RunLayerBench(lf);
    }
    if (transport->parsed()) return moerun::bench::RunTransportBench(tf);
    if (calibrate->parsed()) return moerun::bench::RunCalibrate(calf);
    if (model_cmd->parsed()) return moerun::bench::RunModel(mf);
    if (serve->parsed()) return moerun::bench::RunServeBench(sf);
    if (decode->parsed()) return moerun::bench::RunDecodeBench(df);
    if (replay->parsed()) return moerun::bench::RunReplayBench(rf);
    if (cache_replay->parsed()) return moerun::bench::RunCacheReplay(cf);
    if (sgemm->parsed()) {
      auto s = moerun::bench::ShapesFromArg(shapes);
      if (!s.ok()) {
        spdlog::error("{}", s.status().ToString());
        return 2;
      }
      return moerun::bench::RunSgemmChild(*s, threads, min_time);
    }
    return 2;
  } catch (const std::bad_alloc&) {
    spdlog::error("out of memory");
    return 1;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 1;
  }
}
