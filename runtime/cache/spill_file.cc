#include "runtime/cache/spill_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

namespace moerun {
namespace {

std::string Errno() { return std::strerror(errno); }

}  // namespace

Result<std::unique_ptr<SpillFile>> SpillFile::Create(const std::string& dir) {
  std::unique_ptr<SpillFile> f(new SpillFile());
  f->dir_ = dir;
  std::string path = dir + "/moerun-expert-spill-XXXXXX";
  std::vector<char> name(path.begin(), path.end());
  name.push_back('\0');
  f->fd_ = ::mkstemp(name.data());
  if (f->fd_ < 0) {
    return Status::IoError("expert cache: cannot make a spill file in " + dir + ": " + Errno());
  }
  ::unlink(name.data());
  return f;
}

SpillFile::~SpillFile() {
  if (fd_ >= 0) ::close(fd_);
}

Status SpillFile::WriteAt(const void* p, uint64_t n, uint64_t offset) const {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, c, n, static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0)
      return Status::IoError("expert cache: writing the spill file in " + dir_ + ": " + Errno());
    c += w;
    n -= static_cast<uint64_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return Status::Ok();
}

Status SpillFile::ReadAt(void* p, uint64_t n, uint64_t offset) const {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::pread(fd_, c, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return Status::IoError("expert cache: reading the spill file in " + dir_ + ": " +
                             (r == 0 ? std::string("short read") : Errno()));
    c += r;
    n -= static_cast<uint64_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

uint64_t SpillFile::Generation(int layer, int expert) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = entries_.find({layer, expert});
  return it == entries_.end() ? 0 : it->second.generation;
}

void SpillFile::Forget(int layer, int expert) {
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = entries_[{layer, expert}];
  ++e.generation;
  e.stored = false;  // (its bytes stay in the file, unused)
}

uint64_t SpillFile::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return end_;
}

Status SpillFile::Put(int layer, int expert, uint64_t generation, const ExpertWeights& w) {
  Entry e;
  const uint64_t b13 = w.w13.bytes(), b2 = w.w2.bytes();
  const uint64_t nbias = w.bias_gate.size() + w.bias_up.size() + w.bias_down.size();
  const uint64_t total = b13 + b2 + nbias * sizeof(float);
  uint64_t at = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = entries_.find({layer, expert});
    if (it != entries_.end() && (it->second.stored || it->second.generation != generation)) {
      return Status::Ok();  // stored already, or new weights since this load began
    }
    if (it == entries_.end() && generation != 0) return Status::Ok();
    at = end_;
    end_ += (total + 4095) / 4096 * 4096;  // page-aligned entries
  }
  e.hidden = w.hidden;
  e.inter = w.inter;
  e.pairs = w.pairs;
  e.w13 = Matrix{w.w13.dtype(), w.w13.n(), w.w13.k(), w.w13.nr(), at, b13};
  e.w2 = Matrix{w.w2.dtype(), w.w2.n(), w.w2.k(), w.w2.nr(), at + b13, b2};
  e.bias_offset = at + b13 + b2;
  e.bias_gate = w.bias_gate.size();
  e.bias_up = w.bias_up.size();
  e.bias_down = w.bias_down.size();
  MOERUN_RETURN_IF_ERROR(WriteAt(w.w13.data(), b13, e.w13.offset));
  MOERUN_RETURN_IF_ERROR(WriteAt(w.w2.data(), b2, e.w2.offset));
  uint64_t off = e.bias_offset;
  for (const std::vector<float>* v : {&w.bias_gate, &w.bias_up, &w.bias_down}) {
    MOERUN_RETURN_IF_ERROR(WriteAt(v->data(), v->size() * sizeof(float), off));
    off += v->size() * sizeof(float);
  }
  std::lock_guard<std::mutex> lock(mu_);
  Entry& slot = entries_[{layer, expert}];
  if (slot.generation != generation) return Status::Ok();
  e.generation = generation;
  e.stored = true;
  slot = e;
  return Status::Ok();
}

Result<ExpertWeights> SpillFile::Get(int layer, int expert, ExpertWeights reuse) const {
  Entry e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = entries_.find({layer, expert});
    if (it == entries_.end() || !it->second.stored) return Status::NotFound("not spilled");
    e = it->second;
  }
  auto same = [](const PackedMatrix& m, const Matrix& want) {
    return !m.empty() && m.dtype() == want.dtype && m.n() == want.n && m.k() == want.k &&
           m.nr() == want.nr && m.bytes() == want.bytes;
  };
  ExpertWeights w = std::move(reuse);
  w.hidden = e.hidden;
  w.inter = e.inter;
  w.pairs = e.pairs;
  if (!same(w.w13, e.w13)) w.w13 = PackedMatrix(e.w13.dtype, e.w13.n, e.w13.k, e.w13.nr);
  if (!same(w.w2, e.w2)) w.w2 = PackedMatrix(e.w2.dtype, e.w2.n, e.w2.k, e.w2.nr);
  if (w.w13.bytes() != e.w13.bytes || w.w2.bytes() != e.w2.bytes) {
    return Status::Internal("expert cache: a spilled expert's layout does not match");
  }
  MOERUN_RETURN_IF_ERROR(ReadAt(w.w13.mutable_data(), e.w13.bytes, e.w13.offset));
  MOERUN_RETURN_IF_ERROR(ReadAt(w.w2.mutable_data(), e.w2.bytes, e.w2.offset));
  w.bias_gate.resize(e.bias_gate);
  w.bias_up.resize(e.bias_up);
  w.bias_down.resize(e.bias_down);
  uint64_t off = e.bias_offset;
  for (std::vector<float>* v : {&w.bias_gate, &w.bias_up, &w.bias_down}) {
    MOERUN_RETURN_IF_ERROR(ReadAt(v->data(), v->size() * sizeof(float), off));
    off += v->size() * sizeof(float);
  }
  return w;
}

}  // namespace moerun
