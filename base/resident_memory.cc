#include "base/resident_memory.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace moerun {

// open/read into a stack buffer, not fopen: the probes read this on every pong, and the serving
// path's allocation test counts the C allocator too (fopen allocates its FILE).
Result<size_t> ResidentBytesFrom(const char* path) {
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return Status::IoError(std::string("cannot read resident memory from ") + path + ": " +
                           std::strerror(errno));
  }
  char text[128];
  ssize_t n = 0;
  do {
    n = ::read(fd, text, sizeof(text) - 1);
  } while (n < 0 && errno == EINTR);
  const int read_errno = errno;
  ::close(fd);
  if (n < 0) {
    return Status::IoError(std::string("cannot read resident memory from ") + path + ": " +
                           std::strerror(read_errno));
  }
  text[n] = '\0';
  // "SIZE RESIDENT SHARED ...", in pages.
  char* end = nullptr;
  std::strtoull(text, &end, 10);
  const char* rest = end;
  const unsigned long long resident = std::strtoull(rest, &end, 10);  // NOLINT(runtime/int)
  const long page = sysconf(_SC_PAGESIZE);                            // NOLINT(runtime/int)
  if (rest == text || end == rest || resident == 0 || page <= 0) {
    return Status::Corrupt(std::string(path) +
                           " does not hold a resident page count (want \"SIZE RESIDENT ...\")");
  }
  return static_cast<size_t>(resident) * static_cast<size_t>(page);
}

Result<size_t> ResidentBytes() { return ResidentBytesFrom("/proc/self/statm"); }

}  // namespace moerun
