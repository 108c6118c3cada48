#include "transport/ucx/ucx_endpoints.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/log.h"
#include "transport/ucx/ucx_wire.h"

namespace moerun::ucx {

void UcxEndpoints::Assign(std::vector<std::vector<uint8_t>> addresses) {
  addresses_ = std::move(addresses);
  const size_t n = addresses_.size();
  failed_.assign(n, UCS_OK);
  eps_.assign(n, nullptr);
  native_put_.assign(n, 0);
  generation_.assign(n, 0);
  contexts_.reserve(n);
}

Status UcxEndpoints::Open(int peer) {
  const auto pi = static_cast<size_t>(peer);
  contexts_.push_back(std::make_unique<ErrorContext>(ErrorContext{this, peer, ++generation_[pi]}));
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(addresses_[pi].data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = OnError;
  ep.err_handler.arg = contexts_.back().get();
  const ucs_status_t s = ucp_ep_create(worker_, &ep, &eps_[pi]);
  if (s != UCS_OK) {
    eps_[pi] = nullptr;
    failed_[pi] = s;
    return Status::Unavailable("ucx: connecting to rank " + std::to_string(peer) + ": " +
                               UcsError(s));
  }
  failed_[pi] = UCS_OK;
  native_put_[pi] = EndpointHasRmaLane(eps_[pi]) ? 1 : 0;
  return Status::Ok();
}

void UcxEndpoints::Close(size_t p, bool force, Deadline deadline) {
  ucp_ep_h ep = eps_[p];
  if (ep == nullptr) return;
  eps_[p] = nullptr;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* req = ucp_ep_close_nbx(ep, &param);
  if (UCS_PTR_IS_PTR(req)) {
    while (ucp_request_check_status(req) == UCS_INPROGRESS && SteadyClock::now() < deadline) {
      ucp_worker_progress(worker_);
    }
    ucp_request_free(req);
  }
}

void UcxEndpoints::CloseAll(Deadline deadline) {
  for (size_t p = 0; p < eps_.size(); ++p) Close(p, failed_[p] != UCS_OK, deadline);
}

Status UcxEndpoints::Check(int peer, const char* what) const {
  if (peer < 0 || static_cast<size_t>(peer) >= failed_.size()) {
    return Status::InvalidArgument(std::string("ucx: ") + what + ": no rank " +
                                   std::to_string(peer));
  }
  const ucs_status_t f = failed_[static_cast<size_t>(peer)];
  if (f != UCS_OK) {
    return Status::Unavailable("ucx: rank " + std::to_string(peer) + " failed (" + UcsError(f) +
                               ")");
  }
  return Status::Ok();
}

void UcxEndpoints::OnError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* ctx = static_cast<ErrorContext*>(arg);
  ctx->self->OnPeerError(*ctx, status);
}

void UcxEndpoints::OnPeerError(const ErrorContext& ctx, ucs_status_t status) {
  const int peer = ctx.peer;
  if (peer < 0 || static_cast<size_t>(peer) >= failed_.size()) return;
  const auto pi = static_cast<size_t>(peer);
  if (ctx.generation != generation_[pi]) return;  // an endpoint a replacement closed
  if (failed_[pi] == UCS_OK) {
    failed_[pi] = status;
    spdlog::warn("ucx: rank {} failed: {}", peer, UcsError(status));
  }
}

bool EndpointHasRmaLane(ucp_ep_h ep) {
  // UCX has no query for it (ucp_ep_query names no lanes in 1.13): its own description of the
  // endpoint's lanes says, one line per lane, " rma#<priority>" on those puts may use.
  char* text = nullptr;
  size_t length = 0;
  FILE* out = open_memstream(&text, &length);
  if (out == nullptr) return false;
  ucp_ep_print_info(ep, out);
  std::fclose(out);
  const bool rma = text != nullptr && std::string(text, length).find(" rma#") != std::string::npos;
  std::free(text);
  return rma;
}

}  // namespace moerun::ucx
