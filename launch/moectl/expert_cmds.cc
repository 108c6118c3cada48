// moectl expert update/status/promote/rollback: new weights for one expert, loaded beside the
// old, with a canary share of its assignments until promote or rollback.
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <system_error>

#include "launch/moectl/client.h"
#include "launch/moectl/commands.h"
#include "launch/moectl/print.h"

namespace moerun::moectl {

namespace {

struct ExpertFlags {
  int layer = -1, expert = -1;  // --layer, --expert
  double canary_percent = 5;    // update --canary
  std::string file;             // update --from
  bool wait = false, json = false;
};

// The variant of (layer, expert) an answer holds: the last one with `file` if given, else the
// last one of (layer, expert); null if none.
const v1::ExpertVariant* FindVariant(const v1::ExpertResponse& r, int layer, int expert,
                                     const std::string& file) {
  const v1::ExpertVariant* any = nullptr;
  const v1::ExpertVariant* same_file = nullptr;
  for (const auto& v : r.variants()) {
    if (v.layer() != layer || v.expert() != expert) continue;
    any = &v;
    if (!file.empty() && v.file() == file) same_file = &v;
  }
  return same_file ? same_file : any;
}

// The answer printed, then the exit code: 1 if the update of `file` (or the last one of the
// expert) failed.
int FinishExpert(const v1::ExpertResponse& er, const ExpertFlags& f, const std::string& file) {
  if (f.json) {
    std::printf("%s\n", Json(er).c_str());
  } else {
    PrintExperts(er);
  }
  const v1::ExpertVariant* v = FindVariant(er, f.layer, f.expert, file);
  return v && v->state() == "failed" ? 1 : 0;
}

// update --from FILE: the file's absolute path (symlinks resolved), which the expert ranks open; ""
// after printing why it cannot be.
std::string WeightsPath(const std::string& path) {
  std::error_code ec;
  std::filesystem::path abs = std::filesystem::absolute(path, ec).lexically_normal();
  if (ec || !std::filesystem::exists(abs, ec)) {
    Fail(fmt::format("expert weights {}: no such file", path));
    return "";
  }
  if (!std::filesystem::is_regular_file(abs, ec)) {
    Fail(fmt::format("expert weights {} is not a file", abs.string()));
    return "";
  }
  // Symlinks resolved, as router 0 resolves it (the update's file in its answers is this path).
  std::filesystem::path real = std::filesystem::canonical(abs, ec);
  return ec ? abs.string() : real.string();
}

// update --wait: polls until the update of `file` is no longer loading, printing a line when
// its state changes.
int WaitForUpdate(ControlClient& client, const Waiter& w, const ExpertFlags& f,
                  const std::string& file, v1::ExpertResponse* er) {
  const v1::ExpertVariant* v = FindVariant(*er, f.layer, f.expert, file);
  if (v && v->state() == "loading" && !f.json) PrintExperts(*er);
  std::string state = v ? v->state() : "";
  v1::ControlRequest poll;
  v1::ExpertActionRequest* pa = poll.mutable_expert_action();
  pa->set_action("status");
  pa->set_layer(f.layer);
  pa->set_expert(f.expert);
  while (state == "loading") {
    w.Pause();
    v1::ControlResponse pr;
    if (int rc = client.Call(poll, &pr, /*retry=*/true); rc != 0) return rc;
    *er = pr.experts();
    v = FindVariant(*er, f.layer, f.expert, file);
    if (!v) {
      return Fail(fmt::format("the router no longer lists an update of layer {} expert {}", f.layer,
                              f.expert));
    }
    if (v->state() != state) {
      state = v->state();
      std::fprintf(w.out(), "[%6.1f s] layer %d expert %d: %s%s%s\n", w.Seconds(), f.layer,
                   f.expert, state.c_str(), v->error().empty() ? "" : ": ", v->error().c_str());
      std::fflush(w.out());
    }
  }
  return 0;
}

int RunUpdate(const Session& s, const ExpertFlags& f) {
  const std::string file = WeightsPath(f.file);
  if (file.empty()) return 1;
  v1::ControlRequest req;
  v1::ExpertUpdateRequest* ur = req.mutable_expert_update();
  ur->set_layer(f.layer);
  ur->set_expert(f.expert);
  ur->set_file(file);
  ur->set_canary_percent(f.canary_percent);
  std::unique_ptr<ControlClient> client = MakeClient(s);
  if (!client) return 2;
  v1::ControlResponse resp;
  if (int rc = client->Call(req, &resp, /*retry=*/false); rc != 0) return rc;
  const Waiter waiter(f.json);
  v1::ExpertResponse er = resp.experts();
  if (f.wait) {
    if (int rc = WaitForUpdate(*client, waiter, f, file, &er); rc != 0) return rc;
  }
  return FinishExpert(er, f, file);
}

// status (a report: a failed update is shown, not an error), promote or rollback.
int RunAction(const Session& s, const ExpertFlags& f, const std::string& action) {
  v1::ControlRequest req;
  v1::ExpertActionRequest* er = req.mutable_expert_action();
  er->set_action(action);
  er->set_layer(f.layer);
  er->set_expert(f.expert);
  v1::ControlResponse resp;
  const bool report = action == "status";
  if (int rc = Send(s, req, &resp, /*retry=*/report); rc != 0) return rc;
  const int rc = FinishExpert(resp.experts(), f, /*file=*/"");
  return report ? 0 : rc;
}

void AddUpdateCommand(CLI::App& expert, Session& s, const std::shared_ptr<ExpertFlags>& f) {
  CLI::App* update = expert.add_subcommand(
      "update", "Load new weights for (layer, expert) beside the old; a canary share uses them");
  update->add_option("--layer", f->layer, "Model layer")->required()->check(kNonNegative);
  update->add_option("--expert", f->expert, "Logical expert")->required()->check(kNonNegative);
  update
      ->add_option("--from", f->file,
                   "A .safetensors file, readable at this path on the expert ranks' hosts")
      ->required();
  update->add_option("--canary", f->canary_percent, "Percent of the expert's assignments (0..100)")
      ->default_val(5)
      ->check(CLI::Range(0.0, 100.0));
  update->add_flag("--wait", f->wait, "Wait until the new weights are loaded (or failed)");
  update->add_flag("--json", f->json, "Print the (final) answer as JSON");
  update->callback([&s, f] { s.rc = RunUpdate(s, *f); });
}

}  // namespace

void AddExpertCommands(CLI::App& app, Session& s) {
  auto f = std::make_shared<ExpertFlags>();  // lives as long as the callbacks
  CLI::App* expert = app.add_subcommand("expert", "New weights for one expert, with a canary");
  expert->require_subcommand(1);
  AddUpdateCommand(*expert, s, f);
  CLI::App* status =
      expert->add_subcommand("status", "Expert updates: state, canary share, rows served");
  status->add_option("--layer", f->layer, "Only this layer (default: every update)")
      ->check(CLI::Range(-1, std::numeric_limits<int>::max()));
  status->add_option("--expert", f->expert, "Only this expert (default: every update)")
      ->check(CLI::Range(-1, std::numeric_limits<int>::max()));
  status->add_flag("--json", f->json, "Print JSON");
  status->callback([&s, f] { s.rc = RunAction(s, *f, "status"); });
  CLI::App* promote = expert->add_subcommand("promote", "Serve every assignment with the update");
  CLI::App* rollback = expert->add_subcommand("rollback", "Drop the update, keep the old weights");
  for (CLI::App* sub : {promote, rollback}) {
    sub->add_option("--layer", f->layer, "Model layer")->required()->check(kNonNegative);
    sub->add_option("--expert", f->expert, "Logical expert")->required()->check(kNonNegative);
    sub->add_flag("--json", f->json, "Print JSON");
    const std::string action = sub->get_name();  // "promote" or "rollback"
    sub->callback([&s, f, action] { s.rc = RunAction(s, *f, action); });
  }
}

}  // namespace moerun::moectl
