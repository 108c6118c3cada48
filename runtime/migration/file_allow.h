// Files a control request names (moectl expert update --from FILE) are read only from the
// directories the serve config allows (`files: {allow: [...]}`; by default the model's own
// folder, none for a preset). The path is resolved (symlinks and `..` followed, realpath) and
// refused when it, or what it resolves to, lies outside every allowed directory.
//
// What the errors say: the path and the reason, never the file's content. A path outside the
// allowed directories gets the same answer whether it exists or not and whatever it is, so the
// answer tells nothing about the file system outside them. Inside them, a missing file or one
// that is not a regular file is named as such. Thread-safe (no state).
#pragma once

#include <string>
#include <vector>

#include "base/status.h"

namespace moerun {

// Whether `path` is `dir` or lies below it, comparing whole components of two lexically normal
// absolute paths ("/a/bc" is not below "/a/b"; every path is below "/").
bool PathWithin(const std::string& path, const std::string& dir);

// The resolved (canonical) path of `path` when it is a regular file inside one of
// `allowed_dirs`; `what` names the file in errors ("expert update file"). `path` must be
// absolute. Errors are kInvalidArgument ("outside the allowed directories", no directory
// allowed, relative path) or kNotFound (inside them: no such file, not a regular file).
Result<std::string> ResolveAllowedFile(const std::string& path,
                                       const std::vector<std::string>& allowed_dirs,
                                       const std::string& what);

}  // namespace moerun
