#include "transport/ucx/ucx_worker.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "base/log.h"
#include "transport/doorbell.h"
#include "transport/ucx/ucx_environment.h"
#include "transport/ucx/ucx_transport.h"
#include "transport/ucx/ucx_wire.h"

namespace moerun::ucx {

Status UcxWorker::Open(bool loud) {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return Status::Unavailable("ucx: reading UCX's configuration: " + UcsError(s));
  const char* wake = std::getenv("MOERUN_UCX_WAKEUP");
  const bool wakeup = wake == nullptr || std::strcmp(wake, "off") != 0;
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_RMA | (wakeup ? UCP_FEATURE_WAKEUP : 0);
  params.mt_workers_shared = 0;
  s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (s != UCS_OK) return Status::Unavailable("ucx: ucp_init: " + UcsError(s));
  if (loud) {
    const Result<bool> cuda = ContextSupportsCuda(context_);
    if (cuda.ok()) {
      spdlog::info("{}", UcxCudaMemoryNote(*cuda));
    } else {
      spdlog::warn("{}", cuda.status().ToString());
    }
  }
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) return Status::Unavailable("ucx: ucp_worker_create: " + UcsError(s));
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  s = ucp_worker_get_address(worker_, &addr, &addr_len);
  if (s != UCS_OK) return Status::Unavailable("ucx: ucp_worker_get_address: " + UcsError(s));
  address_.assign(reinterpret_cast<uint8_t*>(addr), reinterpret_cast<uint8_t*>(addr) + addr_len);
  ucp_worker_release_address(worker_, addr);
  if (wakeup) {
    int fd = -1;
    s = ucp_worker_get_efd(worker_, &fd);
    if (s == UCS_OK) {
      efd_ = fd;
    } else if (loud) {
      spdlog::warn("ucx: no worker event fd ({}): idle ranks wake by their sleep's end",
                   UcsError(s));
    }
  }
  return Status::Ok();
}

void UcxWorker::Close() {
  efd_ = -1;  // the worker's own, closed with it
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
  worker_ = nullptr;
  context_ = nullptr;
}

void UcxWorker::Progress() {
  for (int i = 0; i < 64 && ucp_worker_progress(worker_) != 0; ++i) {
  }
}

bool UcxWorker::Wait(std::chrono::microseconds max) {
  const ucs_status_t armed = efd_ >= 0 ? ucp_worker_arm(worker_) : UCS_ERR_UNSUPPORTED;
  if (armed == UCS_ERR_BUSY) return true;  // events came since the last progress: progress them
  return WaitReadable(armed == UCS_OK ? efd_ : -1, max);  // not armed: a plain sleep
}

void UcxWorker::ProgressUntilIdle() {
  for (int i = 0, idle = 0; i < 100000 && idle < 64; ++i) {
    idle = ucp_worker_progress(worker_) != 0 ? 0 : idle + 1;
  }
}

void UcxWorker::DiscardUnexpected(ucp_tag_t tag, ucp_tag_t mask) {
  for (int i = 0; i < 100000; ++i) {
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg = ucp_tag_probe_nb(worker_, tag, mask, 1, &info);
    if (msg == nullptr) break;
    ucp_request_param_t param{};
    void* req = ucp_tag_msg_recv_nbx(worker_, discard_, std::min(info.length, sizeof discard_), msg,
                                     &param);
    if (UCS_PTR_IS_PTR(req)) {
      for (int k = 0; k < 100000 && ucp_request_check_status(req) == UCS_INPROGRESS; ++k) {
        ucp_worker_progress(worker_);
      }
      ucp_request_free(req);
    }
  }
}

}  // namespace moerun::ucx
