#include "launch/local_device.h"

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <string_view>

namespace moerun {
namespace {

// A non-negative decimal integer and nothing else.
Result<int> ParseCount(std::string_view name, std::string_view text) {
  int v = -1;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || ptr != end || v < 0) {
    return Status::InvalidArgument(std::string(name) + "='" + std::string(text) +
                                   "' is not a non-negative integer");
  }
  return v;
}

// This node's task count from SLURM_TASKS_PER_NODE ("2(x3),1"): entry `node` of the expanded
// list (the first entry when node < 0).
Result<int> SlurmTasksOnNode(std::string_view text, int node) {
  const auto bad = [&](const std::string& why) {
    return Status::InvalidArgument("SLURM_TASKS_PER_NODE='" + std::string(text) + "': " + why);
  };
  int64_t first_node = 0;  // index of the first node the current field describes
  int found = -1;          // every field is checked, not only those up to this node's
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    if (comma == std::string_view::npos) comma = text.size();
    const std::string_view field = text.substr(pos, comma - pos);
    std::string_view count_text = field;
    int repeat = 1;
    if (const size_t paren = field.find('('); paren != std::string_view::npos) {
      count_text = field.substr(0, paren);
      const std::string_view rep = field.substr(paren);  // "(xM)"
      if (rep.size() < 4 || rep.substr(0, 2) != "(x" || rep.back() != ')') {
        return bad("field '" + std::string(field) + "' is not N or N(xM)");
      }
      Result<int> r = ParseCount("SLURM_TASKS_PER_NODE repeat", rep.substr(2, rep.size() - 3));
      if (!r.ok() || *r == 0) return bad("field '" + std::string(field) + "' is not N or N(xM)");
      repeat = *r;
    }
    Result<int> count = ParseCount("SLURM_TASKS_PER_NODE", count_text);
    if (!count.ok()) return bad("field '" + std::string(field) + "' is not N or N(xM)");
    if (found < 0 && (node < 0 || node < first_node + repeat)) found = *count;
    first_node += repeat;
    pos = comma + 1;
  }
  if (found < 0) return bad("no entry for node " + std::to_string(node) + " (SLURM_NODEID)");
  return found;
}

struct Launcher {
  const char* rank_var;
  const char* size_var;
};

}  // namespace

EnvLookup ProcessEnvironment() {
  return [](const char* name) -> const char* { return std::getenv(name); };
}

LocalDeviceChoice ChooseLocalDevice(const EnvLookup& env, int device_count, int explicit_device) {
  LocalDeviceChoice c;
  c.device_count = device_count;
  if (const char* v = env("CUDA_VISIBLE_DEVICES")) c.visible_devices = v;

  static constexpr Launcher kLaunchers[] = {
      {"OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {"SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
  };
  const Launcher* launcher = nullptr;
  const char* rank_text = nullptr;
  for (const Launcher& l : kLaunchers) {
    if ((rank_text = env(l.rank_var)) != nullptr) {
      launcher = &l;
      break;
    }
  }
  if (launcher == nullptr) {
    c.source = "no launcher variable: local rank 0 of 1";
    c.local_size_known = true;
  } else {
    Result<int> rank = ParseCount(launcher->rank_var, rank_text);
    if (!rank.ok()) {
      c.error = rank.status();
      return c;
    }
    c.local_rank = *rank;
    c.source = std::string(launcher->rank_var) + "=" + rank_text;
    Result<int> size = Status::NotFound("");
    if (const char* s = env(launcher->size_var)) {
      size = ParseCount(launcher->size_var, s);
      if (size.ok()) c.source += std::string(", ") + launcher->size_var + "=" + s;
    } else if (const char* tasks = env("SLURM_TASKS_PER_NODE");
               tasks != nullptr && std::string_view(launcher->rank_var) == "SLURM_LOCALID") {
      int node = -1;
      if (const char* id = env("SLURM_NODEID")) {
        Result<int> n = ParseCount("SLURM_NODEID", id);
        if (!n.ok()) {
          c.error = n.status();
          return c;
        }
        node = *n;
      }
      size = SlurmTasksOnNode(tasks, node);
      if (size.ok()) c.source += std::string(", SLURM_TASKS_PER_NODE=") + tasks;
    }
    if (size.ok()) {
      if (*size == 0 || c.local_rank >= *size) {
        c.error = Status::InvalidArgument("local rank " + std::to_string(c.local_rank) +
                                          " is not below the local size " + std::to_string(*size) +
                                          " (" + c.source + ")");
        return c;
      }
      c.local_size = *size;
      c.local_size_known = true;
    } else if (size.status().code() != StatusCode::kNotFound) {
      c.error = size.status();
      return c;
    } else {
      c.local_size = c.local_rank + 1;  // at least
    }
  }

  if (explicit_device < -1) {
    c.error = Status::InvalidArgument("device " + std::to_string(explicit_device) +
                                      " does not exist (-1 chooses from the local rank)");
    return c;
  }
  if (device_count <= 0) {
    c.error = Status::Unavailable("no CUDA device visible" +
                                  (c.visible_devices.empty()
                                       ? std::string()
                                       : " (CUDA_VISIBLE_DEVICES=" + c.visible_devices + ")"));
    return c;
  }
  const int n = device_count;
  if (explicit_device >= 0) {
    if (explicit_device >= n) {
      c.error = Status::InvalidArgument(
          "device " + std::to_string(explicit_device) + " does not exist: " + std::to_string(n) +
          " device(s) visible" +
          (c.visible_devices.empty() ? std::string()
                                     : " (CUDA_VISIBLE_DEVICES=" + c.visible_devices + ")"));
      return c;
    }
    c.device = explicit_device;
    c.source = "explicit device " + std::to_string(explicit_device) + "; " + c.source;
    // The other ranks' choices are unknown: the most loaded device if they spread evenly.
    c.ranks_sharing_device = (c.local_size + n - 1) / n;
  } else {
    c.device = c.local_rank % n;
    c.ranks_sharing_device = c.local_size / n + (c.device < c.local_size % n ? 1 : 0);
  }
  c.shared = c.ranks_sharing_device > 1;
  return c;
}

Status CheckOneGpuPerRank(const LocalDeviceChoice& c) {
  if (!c.ok()) {
    return Status::InvalidArgument("--transport nccl needs one GPU per rank: " + c.error.message());
  }
  // Every local rank decides alike: the job fails on all of them, not only on those that share.
  if (c.shared || c.device < 0 || c.local_size > c.device_count) {
    const std::string visible = c.visible_devices.empty()
                                    ? std::string()
                                    : " (CUDA_VISIBLE_DEVICES=" + c.visible_devices + ")";
    return Status::InvalidArgument(
        "--transport nccl needs one GPU per rank: " +
        (c.local_size_known ? std::to_string(c.local_size)
                            : "at least " + std::to_string(c.local_size)) +
        " ranks on this host but " + std::to_string(c.device_count) + " GPU(s) visible" + visible +
        ", and NCCL refuses two ranks on one GPU: start at most " + std::to_string(c.device_count) +
        " ranks per host, or use --transport mpi or ucx");
  }
  return Status::Ok();
}

std::string LocalDeviceChoice::Describe() const {
  if (!ok()) return "no device: " + error.ToString();
  std::string s =
      "GPU " + std::to_string(device) + " of " + std::to_string(device_count) + " visible";
  if (!visible_devices.empty()) s += " (CUDA_VISIBLE_DEVICES=" + visible_devices + ")";
  s += ", local rank " + std::to_string(local_rank) + " of " +
       (local_size_known ? std::to_string(local_size) : "at least " + std::to_string(local_size)) +
       " (" + source + ")";
  if (shared) {
    s += ", shared by " + std::to_string(ranks_sharing_device) +
         " local ranks: NCCL refuses two ranks on one GPU, so device data moves host-staged "
         "(mpi or ucx transport)";
  }
  return s;
}

}  // namespace moerun
