// Files named by control requests, confined to the allowed directories
// (runtime/migration/file_allow.h): inside them a regular file resolves; outside them (by name,
// through "..", or through a symlink) the answer is one message that names the path and says why,
// the same whether the file exists or not and whatever it is, and never holds the file's content.
#include "runtime/migration/file_allow.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "launch/serve_config.h"
#include "tests/unit/test_util.h"

namespace moerun {
namespace {

using ::moerun::testing::TempDir;
using ::moerun::testing::WriteFile;

namespace fs = std::filesystem;

TEST(PathWithinTest, WholeComponents) {
  EXPECT_TRUE(PathWithin("/a/b", "/a/b"));
  EXPECT_TRUE(PathWithin("/a/b/c", "/a/b"));
  EXPECT_TRUE(PathWithin("/a/b/c", "/a/b/"));
  EXPECT_FALSE(PathWithin("/a/bc", "/a/b"));
  EXPECT_FALSE(PathWithin("/a", "/a/b"));
  EXPECT_TRUE(PathWithin("/etc/passwd", "/"));
  EXPECT_FALSE(PathWithin("/a/b/../../etc/passwd", "/a/b"));  // lexically normal first
  EXPECT_TRUE(PathWithin("/a/b/./c/../d", "/a/b"));
  EXPECT_FALSE(PathWithin("a/b", "a"));  // relative paths are never within
}

class FileAllowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::canonical(tmp_.path());
    allowed_ = root_ / "models";
    other_ = root_ / "other";
    fs::create_directories(allowed_ / "sub");
    fs::create_directories(other_);
    WriteFile((allowed_ / "w.safetensors").string(), "weights");
    WriteFile((other_ / "secret").string(), "SECRET-CONTENT");
  }

  Result<std::string> Resolve(const fs::path& p) {
    return ResolveAllowedFile(p.string(), {allowed_.string()}, "expert update file");
  }
  // The refusal of a path outside: invalid argument, the path and the reason, no content.
  void ExpectOutside(const fs::path& p) {
    SCOPED_TRACE(p.string());
    Result<std::string> r = Resolve(p);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    const std::string& m = r.status().message();
    EXPECT_NE(m.find(p.string()), std::string::npos) << m;
    EXPECT_NE(m.find("outside the allowed directories"), std::string::npos) << m;
    EXPECT_EQ(m.find("SECRET"), std::string::npos) << m;
    EXPECT_EQ(m.find("no such file"), std::string::npos) << m;
    EXPECT_EQ(m.find("not a regular file"), std::string::npos) << m;
  }

  TempDir tmp_;
  fs::path root_, allowed_, other_;
};

TEST_F(FileAllowTest, AFileInsideResolves) {
  Result<std::string> r = Resolve(allowed_ / "w.safetensors");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, fs::canonical(allowed_ / "w.safetensors").string());
  // A trailing slash on the allowed directory, and "." / ".." that stay inside, are fine.
  r = ResolveAllowedFile((allowed_ / "sub" / ".." / "w.safetensors").string(),
                         {allowed_.string() + "/"}, "f");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
}

TEST_F(FileAllowTest, OutsideIsRefusedAliveOrNot) {
  ExpectOutside("/etc/passwd");
  ExpectOutside("/etc");                                // a directory
  ExpectOutside("/no/such/file/anywhere");              // missing
  ExpectOutside(other_ / "secret");                     // a sibling of the allowed directory
  ExpectOutside(allowed_ / ".." / "other" / "secret");  // ".." out of it
  ExpectOutside(fs::path(allowed_.string() + "x") / "w.safetensors");  // a name sharing a prefix
  // The same message for a missing file and an existing one outside (only the path differs).
  const std::string a = Resolve(other_ / "secret").status().message();
  const std::string b = Resolve(other_ / "absent").status().message();
  EXPECT_EQ(a.substr(a.find(" is outside")), b.substr(b.find(" is outside")));
}

TEST_F(FileAllowTest, ASymlinkOutIsRefused) {
  fs::create_symlink(other_ / "secret", allowed_ / "link.safetensors");
  fs::create_directory_symlink(other_, allowed_ / "dirlink");
  for (const fs::path& p : {allowed_ / "link.safetensors", allowed_ / "dirlink" / "secret"}) {
    SCOPED_TRACE(p.string());
    Result<std::string> r = Resolve(p);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("outside the allowed directories"), std::string::npos)
        << r.status().message();
    EXPECT_EQ(r.status().message().find("SECRET"), std::string::npos);
  }
  // A symlink that stays inside is followed.
  fs::create_symlink(allowed_ / "w.safetensors", allowed_ / "sub" / "alias.safetensors");
  Result<std::string> r = Resolve(allowed_ / "sub" / "alias.safetensors");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, fs::canonical(allowed_ / "w.safetensors").string());
}

// A link out of the folder gets the same answer whether what it names outside exists or not;
// a dangling link that stays inside is a missing file.
TEST_F(FileAllowTest, ADanglingSymlinkOutIsRefusedAsAPresentOne) {
  fs::create_symlink(other_ / "secret", allowed_ / "present.safetensors");
  fs::create_symlink(other_ / "absent", allowed_ / "dangling.safetensors");
  fs::create_symlink("../../other/absent", allowed_ / "sub" / "relative.safetensors");
  fs::create_symlink(allowed_ / "dangling.safetensors", allowed_ / "chain.safetensors");
  const auto tail = [](const fs::path& p, const Status& s) {
    std::string m = s.message();
    return m.replace(m.find(p.string()), p.string().size(), "PATH");
  };
  const fs::path present = allowed_ / "present.safetensors";
  const std::string want = tail(present, Resolve(present).status());
  for (const fs::path& p :
       {allowed_ / "dangling.safetensors", allowed_ / "sub" / "relative.safetensors",
        allowed_ / "chain.safetensors"}) {
    SCOPED_TRACE(p.string());
    Result<std::string> r = Resolve(p);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(tail(p, r.status()), want);
  }
  fs::create_symlink(allowed_ / "absent", allowed_ / "inside.safetensors");
  Result<std::string> r = Resolve(allowed_ / "inside.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("no such file"), std::string::npos);
}

TEST_F(FileAllowTest, AnAllowedDirectoryThatIsASymlink) {
  // The config names a link to the real folder; paths through either name are inside.
  fs::create_directory_symlink(allowed_, root_ / "models-link");
  const std::vector<std::string> dirs = {(root_ / "models-link").string()};
  for (const fs::path& p : {root_ / "models-link" / "w.safetensors", allowed_ / "w.safetensors"}) {
    Result<std::string> r = ResolveAllowedFile(p.string(), dirs, "f");
    ASSERT_TRUE(r.ok()) << p << ": " << r.status().ToString();
  }
}

TEST_F(FileAllowTest, InsideMissingOrNotAFile) {
  Result<std::string> r = Resolve(allowed_ / "absent.safetensors");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("no such file"), std::string::npos);
  r = Resolve(allowed_ / "sub");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find("not a regular file"), std::string::npos);
}

TEST_F(FileAllowTest, NoAllowedDirectoryOrARelativePath) {
  Result<std::string> r = ResolveAllowedFile((allowed_ / "w.safetensors").string(), {}, "f");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("files.allow"), std::string::npos) << r.status().message();
  r = ResolveAllowedFile("w.safetensors", {allowed_.string()}, "f");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("absolute"), std::string::npos) << r.status().message();
  r = ResolveAllowedFile("", {allowed_.string()}, "f");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

// The serve config's key: files.allow, relative to the config's folder; by default the model's
// folder, none for a preset.
TEST(ServeFilesConfigTest, AllowedDirectories) {
  Result<ServeConfig> c = ParseServeConfig("model: m\n", "t.yaml", "/cfg");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->files_allow, std::vector<std::string>{"/cfg/m"});
  c = ParseServeConfig("preset: qwen3-30b-a3b\n", "t.yaml", "/cfg");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->files_allow.empty());
  c = ParseServeConfig("model: m\nfiles: {allow: [up, /abs/dir/, ../x]}\n", "t.yaml", "/cfg");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->files_allow, (std::vector<std::string>{"/cfg/up", "/abs/dir", "/x"}));
  c = ParseServeConfig("model: m\nfiles: {allow: []}\n", "t.yaml", "/cfg");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->files_allow.empty());
  for (const char* bad : {"files: {allow: dir}", "files: {allowed: [d]}", "files: {allow: [\"\"]}",
                          "files: {allow: [[a]]}"}) {
    c = ParseServeConfig(std::string("model: m\n") + bad + "\n", "t.yaml", "/cfg");
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("files"), std::string::npos) << c.status().message();
  }
}

}  // namespace
}  // namespace moerun
