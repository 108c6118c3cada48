#include "runtime/migration/file_allow.h"

#include <sys/stat.h>

#include <climits>
#include <cstdlib>
#include <filesystem>

namespace moerun {

namespace fs = std::filesystem;

namespace {

// realpath(3): the path with every symlink, "." and ".." resolved; "" when it cannot be.
std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  if (::realpath(path.c_str(), buf) == nullptr) return {};
  return buf;
}

// Where `path` leads when realpath cannot say (its last link dangles, or a part is missing): each
// link of the last component followed by hand (at most 40), the existing part of every step
// resolved; "" when that fails.
std::string WhereItLeads(const std::string& path) {
  fs::path p(path);
  for (int links = 0; links <= 40; ++links) {
    std::error_code ec;
    const fs::path parent = fs::weakly_canonical(p.parent_path(), ec);
    if (ec) return {};
    p = parent / p.filename();
    if (!fs::is_symlink(fs::symlink_status(p, ec))) {
      const fs::path whole = fs::weakly_canonical(p, ec);
      return ec ? std::string() : whole.string();
    }
    const fs::path target = fs::read_symlink(p, ec);
    if (ec) return {};
    p = target.is_absolute() ? target : parent / target;
  }
  return {};
}

std::string JoinDirs(const std::vector<std::string>& dirs) {
  std::string out;
  for (const std::string& d : dirs) out += (out.empty() ? "" : ", ") + d;
  return out;
}

}  // namespace

bool PathWithin(const std::string& path, const std::string& dir) {
  const fs::path p = fs::path(path).lexically_normal();
  const fs::path d = fs::path(dir).lexically_normal();
  if (!p.is_absolute() || !d.is_absolute()) return false;
  auto pi = p.begin();
  for (auto di = d.begin(); di != d.end(); ++di) {
    if (di->empty()) continue;  // the trailing "" of "/a/b/"
    if (pi == p.end() || *pi != *di) return false;
    ++pi;
  }
  return true;
}

Result<std::string> ResolveAllowedFile(const std::string& path,
                                       const std::vector<std::string>& allowed_dirs,
                                       const std::string& what) {
  if (path.empty()) return Status::InvalidArgument("no " + what + " given");
  if (allowed_dirs.empty()) {
    return Status::InvalidArgument(what + " " + path +
                                   " refused: no directory allows such files (list them in the "
                                   "serve config's files.allow)");
  }
  if (!fs::path(path).is_absolute()) {
    return Status::InvalidArgument(what + " " + path + " must be an absolute path");
  }
  const std::string outside =
      what + " " + path + " is outside the allowed directories (" + JoinDirs(allowed_dirs) + ")";
  // The allowed directories as written and as resolved (one may be a symlink to another place).
  std::vector<std::string> resolved_dirs;
  bool within = false;
  for (const std::string& d : allowed_dirs) {
    const std::string r = RealPath(d);
    if (!r.empty()) resolved_dirs.push_back(r);
    within = within || PathWithin(path, d) || (!r.empty() && PathWithin(path, r));
  }
  // Decided on the name alone, before the file system is asked anything: the answer is the same
  // for every path outside, whether it exists or not.
  if (!within) return Status::InvalidArgument(outside);
  const std::string resolved = RealPath(path);
  if (resolved.empty()) {
    // Missing: still outside when a link on its way leads outside, with the same answer as when
    // the file there exists (the answer tells nothing of what lies outside).
    const std::string leads = WhereItLeads(path);
    bool leads_within = false;
    for (const std::string& r : resolved_dirs)
      leads_within = leads_within || (!leads.empty() && PathWithin(leads, r));
    if (!leads_within)
      return Status::InvalidArgument(outside + ": a link in it leads outside them");
    return Status::NotFound(what + " " + path + ": no such file, or it cannot be resolved");
  }
  bool resolved_within = false;
  for (const std::string& r : resolved_dirs)
    resolved_within = resolved_within || PathWithin(resolved, r);
  if (!resolved_within) {
    return Status::InvalidArgument(outside + ": a link in it leads outside them");
  }
  struct stat st {};
  if (::stat(resolved.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return Status::NotFound(what + " " + path + " is not a regular file");
  }
  return resolved;
}

}  // namespace moerun
