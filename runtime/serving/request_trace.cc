#include "runtime/serving/request_trace.h"

#include <map>
#include <string>

namespace moerun {
namespace {

namespace pb = ::moerun::otlp::v1;

// An attribute of a span or a resource (both hold a repeated KeyValue `attributes`).
template <typename Owner>
void Attr(Owner* o, const char* key, int64_t v) {
  pb::KeyValue* kv = o->add_attributes();
  kv->set_key(key);
  kv->mutable_value()->set_int_value(v);
}
template <typename Owner>
void Attr(Owner* o, const char* key, const std::string& v) {
  pb::KeyValue* kv = o->add_attributes();
  kv->set_key(key);
  kv->mutable_value()->set_string_value(v);
}

pb::ScopeSpans* NewScope(pb::ExportTraceServiceRequest* out, const TraceSource& src, int rank,
                         const char* role) {
  pb::ResourceSpans* rs = out->add_resource_spans();
  pb::Resource* r = rs->mutable_resource();
  Attr(r, "service.name", src.service);
  Attr(r, "service.instance.id", "rank-" + std::to_string(rank));
  Attr(r, "moerun.rank", int64_t{rank});
  Attr(r, "moerun.role", std::string(role));
  if (rank == src.router_rank && !src.host.empty()) Attr(r, "host.name", src.host);
  pb::ScopeSpans* ss = rs->add_scope_spans();
  ss->mutable_scope()->set_name("moerun");
  return ss;
}

// A span of trace `t`; its id is returned (the parent of the next ones).
SpanId AddSpan(pb::ScopeSpans* ss, const RequestTrace& t, const SpanId* parent, const char* name,
               int64_t start_ns, int64_t end_ns,
               pb::Span::SpanKind kind = pb::Span::SPAN_KIND_INTERNAL, pb::Span** made = nullptr) {
  pb::Span* s = ss->add_spans();
  const SpanId id = NewSpanId();
  s->set_trace_id(t.ctx.trace_id.data(), t.ctx.trace_id.size());
  s->set_span_id(id.data(), id.size());
  if (parent != nullptr) s->set_parent_span_id(parent->data(), parent->size());
  s->set_name(name);
  s->set_kind(kind);
  s->set_start_time_unix_nano(static_cast<uint64_t>(start_ns));
  s->set_end_time_unix_nano(static_cast<uint64_t>(std::max(start_ns, end_ns)));
  s->set_flags(1u);  // sampled
  if (made != nullptr) *made = s;
  return id;
}

int64_t Ns(RequestTrace::TimePoint t) { return UnixNanos(t); }
bool Set(RequestTrace::TimePoint t) { return t != RequestTrace::TimePoint{}; }

}  // namespace

int64_t SpanCount(const RequestTrace& t) {
  int64_t n = 3 + Set(t.replaced_wait_from);  // request, queue, reply; the wait
  for (const MicrobatchTimes& m : t.microbatches) n += Set(m.end) ? 5 : 1;
  for (const RankTimes& r : t.ranks) n += 1 + (r.header_ns > 0 ? 3 : 0);
  return n;
}

void AppendSpans(const RequestTrace& t, const TraceSource& src,
                 pb::ExportTraceServiceRequest* out) {
  pb::ScopeSpans* router = NewScope(out, src, src.router_rank, "router");
  pb::Span* root_span = nullptr;
  const SpanId root =
      AddSpan(router, t, t.has_parent ? &t.ctx.parent_id : nullptr, "moerun.request",
              Ns(t.received), Ns(t.answered), pb::Span::SPAN_KIND_SERVER, &root_span);
  Attr(root_span, "moerun.request.id", static_cast<int64_t>(t.request_id));
  Attr(root_span, "moerun.layer", int64_t{t.layer});
  Attr(root_span, "moerun.tokens", t.tokens);
  Attr(root_span, "moerun.batch.tokens", t.batch_tokens);
  Attr(root_span, "moerun.batch.microbatches", static_cast<int64_t>(t.microbatches.size()));
  Attr(root_span, "moerun.trace.kept", t.why);
  if (t.code != 0) {
    root_span->mutable_status()->set_code(pb::Status::STATUS_CODE_ERROR);
    root_span->mutable_status()->set_message(t.error);
    Attr(root_span, "moerun.code", int64_t{t.code});
  }
  AddSpan(router, t, &root, "moerun.queue", Ns(t.received), Ns(t.batch_start));
  if (Set(t.replaced_wait_from)) {
    AddSpan(router, t, &root, "moerun.replaced_wait", Ns(t.replaced_wait_from),
            Ns(Set(t.replaced_wait_to) ? t.replaced_wait_to : t.batch_done));
  }

  std::vector<SpanId> mb_ids(t.microbatches.size());
  for (size_t i = 0; i < t.microbatches.size(); ++i) {
    const MicrobatchTimes& m = t.microbatches[i];
    const int64_t end = Set(m.end) ? Ns(m.end) : Ns(t.batch_done);
    pb::Span* s = nullptr;
    mb_ids[i] = AddSpan(router, t, &root, "moerun.microbatch", Ns(m.gate), end,
                        pb::Span::SPAN_KIND_INTERNAL, &s);
    Attr(s, "moerun.layer", int64_t{m.layer});
    Attr(s, "moerun.microbatch.seq", int64_t{m.seq});
    Attr(s, "moerun.tokens", m.tokens);
    Attr(s, "moerun.placement.version", static_cast<int64_t>(m.placement_version));
    if (!Set(m.end)) continue;  // failed before it was combined: its parts are not all known
    AddSpan(router, t, &mb_ids[i], "moerun.gate", Ns(m.gate), Ns(m.dispatch));
    AddSpan(router, t, &mb_ids[i], "moerun.dispatch", Ns(m.dispatch), Ns(m.sent));
    AddSpan(router, t, &mb_ids[i], "moerun.wait", Ns(m.wait), Ns(m.combine));
    AddSpan(router, t, &mb_ids[i], "moerun.combine", Ns(m.combine), Ns(m.end));
  }

  std::map<int, pb::ScopeSpans*> expert_scopes;  // made after the router's, one per rank
  for (const RankTimes& r : t.ranks) {
    if (r.microbatch < 0 || static_cast<size_t>(r.microbatch) >= mb_ids.size()) continue;
    pb::Span* s = nullptr;
    const SpanId call =
        AddSpan(router, t, &mb_ids[static_cast<size_t>(r.microbatch)], "moerun.expert_rank",
                Ns(r.sent), Ns(r.received), pb::Span::SPAN_KIND_CLIENT, &s);
    Attr(s, "moerun.rank", int64_t{r.rank});
    Attr(s, "moerun.rows", r.rows);
    Attr(s, "moerun.bytes", r.bytes);
    if (r.header_ns <= 0) continue;  // the rank reported no times
    pb::ScopeSpans*& scope = expert_scopes[r.rank];
    if (scope == nullptr) scope = NewScope(out, src, r.rank, "expert");
    pb::Span* e = nullptr;
    const SpanId served = AddSpan(scope, t, &call, "moerun.expert", r.header_ns, r.answer_ns,
                                  pb::Span::SPAN_KIND_SERVER, &e);
    Attr(e, "moerun.rank", int64_t{r.rank});
    Attr(e, "moerun.rows", r.rows);
    Attr(e, "moerun.clock_offset_ns", r.clock_offset_ns);
    AddSpan(scope, t, &served, "moerun.expert.receive", r.header_ns, r.compute_start_ns);
    pb::Span* c = nullptr;
    AddSpan(scope, t, &served, "moerun.expert.compute", r.compute_start_ns, r.answer_ns,
            pb::Span::SPAN_KIND_INTERNAL, &c);
    if (r.cache_wait_us > 0) Attr(c, "moerun.cache_wait_us", r.cache_wait_us);
  }
  AddSpan(router, t, &root, "moerun.reply", Ns(t.batch_done), Ns(t.answered));
}

}  // namespace moerun
