// Routing recorded from real inference, read as it was published: what the gate of each MoE layer
// chose, either only as per-expert counts over a window (DeepSeek-R1's published statistics,
// OLMoE's per-domain counts, a per-layer counts CSV) or token by token (a Qwen3 prefill batch as a
// .npy of top-k ids, Mixtral decode traces as JSON lines). ../shared/routing/README.md (and each
// set's SOURCE.txt in tests/data/routing/) says where each file comes from.
//
// The formats, told apart by the file's name and content (ReadRoutingTrace):
//   *.json with "logical_count": [[E floats] x L]  SGLang's expert-distribution dump; all-zero rows
//                                                  (the dense layers) are dropped, `layers` keeps
//                                                  the model's layer numbers.
//   *.json with "counts" and "layers"              OLMoE's converted per-domain expert counts
//                                                  ("kind": "expert_counts" or "..._top1").
//   *.csv, L lines of E integers                   per-layer counts of one batch.
//   *.npy, int16/int32/int64 (L, T, k), C order    top-k ids of T tokens in every layer.
//   *.jsonl, {"layer", "experts": [..], "token_idx"?, "problem_id"?, ...} per line
//                                                  token-level traces; one stream per problem_id
//                                                  (or one), tokens in token_idx order (or, with
//                                                  no token_idx, in the file's order).
// Anything else, or a file that breaks its format (ragged rows, ids out of range, negative
// counts, a truncated .npy), is an InvalidArgument naming the file and what is wrong; so are
// OLMoE's cross-layer pair files (expert_counts_crosslayer*: counts of (expert at layer i, expert
// at layer j) pairs, not per-expert counts). A file that cannot be read is a NotFound / IoError.
//
// The number of experts: the window formats state it (the row length). The token-level formats
// (.npy, .jsonl) do not: an expert no token chose leaves no trace, so max id + 1 is only a lower
// bound. RoutingTraceOptions::num_experts gives the model's count (ids must be below it); left
// 0, the reader takes max id + 1, which is right whenever every expert was chosen at least once
// (true of the sets in ../shared/routing/: Mixtral 8 of 8, Qwen3 128 of 128). Given for a window
// file, it must equal the file's count.
//
// Details of the formats as they are:
//   - SGLang's rows may have different totals from layer to layer (some published files do);
//     the counts are kept as they are, each layer judged on its own.
//   - OLMoE's files hold layers 0, 7, 15 only; top_k is 1 for the *_top1 kinds, else 0 (the file
//     counts top-k picks but does not say k).
//   - .npy: NPY format 1.0, 2.0 or 3.0, dtype '<i2', '<i4' or '<i8', fortran_order False, a 3-D
//     shape (layers, tokens, k); the data must be exactly the shape's size. Ids are >= 0 or -1
//     (missing). Layers are numbered 0.. (the file has every MoE layer).
//   - .jsonl: one stream per "problem_id" (in order of first appearance; without the field, one
//     stream), tokens by "token_idx" (0-based; a stream has max token_idx + 1 tokens); a record
//     without "token_idx" (a raw hook's output, such as the Mixtral set's routing_raw.jsonl:
//     a prefill batch's rows, then one row per decode step, in time order) is the next token of
//     its (stream, layer) in the file's order; layers the
//     sorted set of "layer" values. top_k = len("experts"), the same on every line. A (token,
//     layer) with no record is -1 (Mixtral's recorder drops rows whose gate weights are exactly
//     [0.5, 0.5], and numbers its tokens per (problem, layer), so after such a drop that layer's
//     later tokens are shifted by one against the other layers; nothing in the file can undo
//     that, and each layer is judged on its own). Two records of one (stream, token, layer) are
//     an error.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace moerun {

struct RoutingTrace {
  std::string source;       // the file it was read from
  int num_experts = 0;      // logical experts per layer
  int top_k = 0;            // experts per token; 0 where the file does not say (window counts)
  std::vector<int> layers;  // the model's layer number of each layer index

  // counts[l][e]: assignments of expert e in layer index l over the whole recording (also filled
  // for token-level traces, from their tokens).
  std::vector<std::vector<double>> counts;

  // Token level (empty for window counts): streams in time order (a prefill batch, or one
  // request's decode tokens). ids[l][t * top_k + k]: the k-th expert of token t in layer index l;
  // -1 where the recording lacks that (token, layer) record.
  struct Stream {
    std::string name;
    int64_t tokens = 0;
    std::vector<std::vector<int32_t>> ids;
  };
  std::vector<Stream> streams;

  bool token_level() const { return !streams.empty(); }
  int num_layers() const { return static_cast<int>(counts.size()); }
};

struct RoutingTraceOptions {
  int num_experts = 0;  // the model's expert count; 0: as the file says, or max id + 1
};

Result<RoutingTrace> ReadRoutingTrace(const std::string& path);
Result<RoutingTrace> ReadRoutingTrace(const std::string& path, const RoutingTraceOptions& options);

// counts[l][e] recomputed from the streams' ids (the -1 entries left out): what the reader fills
// for token-level traces, and what a part of a trace (replay_metrics.h) gets.
void CountFromStreams(RoutingTrace* trace);

}  // namespace moerun
