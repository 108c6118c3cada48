// Control messages in flight that own their bytes (a header and a body, sent in order), and
// their completion: polled between other work, drained or withdrawn at the end.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace moerun {

struct OwnedSend {
  std::vector<char> header;
  std::string body;
  Request reqs[2];
};

class OwnedSends {
 public:
  // Posts header on `header_tag`, then body on `body_tag`, to `peer`.
  Status Send(Transport* t, int peer, int header_tag, int body_tag, std::vector<char> header,
              std::string body) {
    auto o = std::make_unique<OwnedSend>();
    o->header = std::move(header);
    o->body = std::move(body);
    MOERUN_ASSIGN_OR_RETURN(o->reqs[0],
                            t->Isend(peer, header_tag, o->header.data(), o->header.size()));
    MOERUN_ASSIGN_OR_RETURN(o->reqs[1], t->Isend(peer, body_tag, o->body.data(), o->body.size()));
    q_.push_back(std::move(o));
    return Status::Ok();
  }
  // Frees the sends that have completed, oldest first. A send that fails to a peer `gone` says
  // is dead is dropped (nobody will read it); other failures are returned.
  template <typename Gone>
  Status Poll(Transport* t, const Gone& gone) {
    while (!q_.empty()) {
      bool all = true;
      for (Request& r : q_.front()->reqs) {
        if (!r.valid()) continue;
        Result<bool> tested = t->Test(r);
        if (!tested.ok() && gone(r.peer)) {
          r = Request{};
          continue;
        }
        MOERUN_ASSIGN_OR_RETURN(const bool done, std::move(tested));
        if (done) {
          r = Request{};
        } else {
          all = false;
        }
      }
      if (!all) return Status::Ok();
      q_.pop_front();
    }
    return Status::Ok();
  }
  Status Poll(Transport* t) {
    return Poll(t, [](int) { return false; });
  }
  // Waits for the rest until `until`; what is still in flight then is withdrawn (its peer has
  // stopped listening).
  void Drain(Transport* t, Deadline until) {
    for (auto& o : q_) {
      for (Request& r : o->reqs) {
        if (r.valid() && !t->Wait(r, until, "control send").ok()) (void)t->Cancel(r);
        r = Request{};
      }
    }
    q_.clear();
  }

 private:
  std::deque<std::unique_ptr<OwnedSend>> q_;
};

}  // namespace moerun
