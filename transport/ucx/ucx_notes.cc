#include "transport/ucx/ucx_notes.h"

#include <cstring>
#include <string>

namespace moerun::ucx {

void UcxNotes::Init(ucp_worker_h worker, uint32_t n) {
  worker_ = worker;
  for (uint32_t i = 0; i < n; ++i) notes_.push_back(std::make_unique<Note>());
  for (uint32_t i = n; i > 0; --i) free_.push_back(i - 1);
  busy_.reserve(n);
}

Status UcxNotes::Send(ucp_ep_h ep, int peer, ucp_tag_t tag, const void* msg, size_t len) {
  if (free_.empty()) {
    Sweep();
    if (free_.empty()) {
      const auto at = static_cast<uint32_t>(notes_.size());
      notes_.push_back(std::make_unique<Note>());
      free_.push_back(at);
    }
  }
  const uint32_t i = free_.back();
  Note& note = *notes_[i];
  std::memcpy(note.bytes, msg, len);
  ucp_request_param_t param{};
  void* req = ucp_tag_send_nbx(ep, note.bytes, len, tag, &param);
  if (UCS_PTR_IS_ERR(req)) {
    return Status::Unavailable("ucx: control message to rank " + std::to_string(peer) + ": " +
                               UcsError(UCS_PTR_STATUS(req)));
  }
  if (req == nullptr) return Status::Ok();  // sent already: the note is free again
  free_.pop_back();
  note.req = req;
  busy_.push_back(i);
  return Status::Ok();
}

void UcxNotes::Sweep() {
  for (size_t k = 0; k < busy_.size();) {
    Note& note = *notes_[busy_[k]];
    if (ucp_request_check_status(note.req) == UCS_INPROGRESS) {
      ++k;
      continue;
    }
    ucp_request_free(note.req);
    note.req = nullptr;
    free_.push_back(busy_[k]);
    busy_[k] = busy_.back();
    busy_.pop_back();
  }
}

void UcxNotes::Drain() {
  for (int i = 0; i < 1000 && !busy_.empty(); ++i) {
    ucp_worker_progress(worker_);
    Sweep();
  }
  for (uint32_t i : busy_) ucp_request_free(notes_[i]->req);
  busy_.clear();
}

}  // namespace moerun::ucx
