// The control endpoint's policy for wrong tokens (runtime/serving/control_auth.h): the back-off per
// address, the summarised log, the token file's mode check and its re-reading with a grace
// period for the old token.
#include "runtime/serving/control_auth.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <map>
#include <string>

#include "tests/unit/test_util.h"

namespace moerun {
namespace {

using ::moerun::testing::TempDir;
using ::moerun::testing::WriteFile;

using std::chrono::milliseconds;
using std::chrono::seconds;

AuthBackoffOptions SmallBackoff() {
  AuthBackoffOptions o;
  o.free_failures = 3;
  o.first_delay = milliseconds(100);
  o.max_delay = milliseconds(1000);
  o.max_waiting = 2;
  o.forget_after = seconds(60);
  o.max_addresses = 4;
  return o;
}

TEST(AuthBackoffTest, DelaysDoubleAfterTheFreeFailuresUpToTheCeiling) {
  AuthBackoff b(SmallBackoff());
  EXPECT_EQ(b.DelayFor(1), milliseconds(0));
  EXPECT_EQ(b.DelayFor(3), milliseconds(0));
  EXPECT_EQ(b.DelayFor(4), milliseconds(100));
  EXPECT_EQ(b.DelayFor(5), milliseconds(200));
  EXPECT_EQ(b.DelayFor(7), milliseconds(800));
  EXPECT_EQ(b.DelayFor(8), milliseconds(1000));
  EXPECT_EQ(b.DelayFor(1 << 20), milliseconds(1000));  // no overflow
}

TEST(AuthBackoffTest, AnAddressCoolsDownAfterItsFreeFailuresOthersDoNot) {
  AuthBackoff b(SmallBackoff());
  const auto t0 = AuthClock::now();
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(b.Admit("10.0.0.1", t0).refuse);
    b.OnFailure("10.0.0.1", t0);
  }
  EXPECT_FALSE(b.Admit("10.0.0.1", t0).refuse);  // 3 free failures: no cool-down yet
  b.OnFailure("10.0.0.1", t0);                   // the 4th: 100 ms
  AuthBackoff::Decision d = b.Admit("10.0.0.1", t0 + milliseconds(30));
  EXPECT_TRUE(d.refuse);
  EXPECT_FALSE(d.close);
  EXPECT_EQ(d.wait, milliseconds(70));
  // Another address, with any token, is admitted at once.
  EXPECT_FALSE(b.Admit("10.0.0.2", t0 + milliseconds(30)).refuse);
  // Held connections: at most max_waiting (2), then refused and closed.
  EXPECT_FALSE(b.Admit("10.0.0.1", t0 + milliseconds(30)).close);
  EXPECT_TRUE(b.Admit("10.0.0.1", t0 + milliseconds(30)).close);
  b.Released("10.0.0.1");
  EXPECT_FALSE(b.Admit("10.0.0.1", t0 + milliseconds(30)).close);
  b.Released("10.0.0.1");
  b.Released("10.0.0.1");
  // After the cool-down the next token is checked; a wrong one doubles it.
  EXPECT_FALSE(b.Admit("10.0.0.1", t0 + milliseconds(100)).refuse);
  b.OnFailure("10.0.0.1", t0 + milliseconds(100));
  EXPECT_EQ(b.Admit("10.0.0.1", t0 + milliseconds(100)).wait, milliseconds(200));
}

// At most one token per cool-down: a client that tries as fast as it is answered gets few
// tokens checked.
TEST(AuthBackoffTest, GuessesAreBounded) {
  AuthBackoff b(SmallBackoff());
  const auto t0 = AuthClock::now();
  int checked = 0;
  for (int ms = 0; ms < 10000; ++ms) {  // a try every millisecond for 10 s
    const auto t = t0 + milliseconds(ms);
    AuthBackoff::Decision d = b.Admit("a", t);
    if (d.refuse) {
      if (!d.close) b.Released("a");
      continue;
    }
    ++checked;
    b.OnFailure("a", t);
  }
  // 3 free, then cool-downs of 100, 200, 400, 800, 1000, ... ms: 3 + about 1 + 1 + 1 + 1 + 9.
  EXPECT_LE(checked, 20);
  EXPECT_GE(checked, 10);
}

TEST(AuthBackoffTest, AQuietAddressStartsAfresh) {
  AuthBackoff b(SmallBackoff());
  const auto t0 = AuthClock::now();
  for (int i = 0; i < 4; ++i) b.OnFailure("a", t0);
  b.OnFailure("a", t0 + seconds(59));
  EXPECT_EQ(b.Admit("a", t0 + seconds(59)).wait, milliseconds(200));
  b.OnFailure("a", t0 + seconds(59) + seconds(60));  // quiet 60 s: the 1st failure again
  EXPECT_FALSE(b.Admit("a", t0 + seconds(59) + seconds(60)).refuse);
}

TEST(AuthBackoffTest, BoundedAddresses) {
  AuthBackoff b(SmallBackoff());
  const auto t0 = AuthClock::now();
  for (int i = 0; i < 100; ++i) b.OnFailure("10.0.1." + std::to_string(i), t0 + milliseconds(i));
  EXPECT_LE(b.addresses(), 4u);
}

TEST(AuthFailureLogTest, OneLineThenOneSummaryPerInterval) {
  AuthFailureLog log(seconds(10));
  std::string first = log.Record("127.0.0.1", "a wrong token");
  EXPECT_NE(first.find("refused a request with a wrong token from 127.0.0.1"), std::string::npos)
      << first;
  int lines = 1;
  for (int i = 0; i < 1990; ++i) lines += log.Record("127.0.0.1", "a wrong token").empty() ? 0 : 1;
  for (int i = 0; i < 5; ++i) lines += log.Record("10.1.2.3", "no token").empty() ? 0 : 1;
  for (int i = 0; i < 3; ++i) lines += log.Record("::1", "a wrong token").empty() ? 0 : 1;
  EXPECT_EQ(lines, 1);
  EXPECT_EQ(log.TakeSummary(),
            "control: 1,998 requests with a wrong or no token from 3 addresses in the last 10 s "
            "(most: 127.0.0.1, 1,990)");
  EXPECT_TRUE(log.open());
  // A quiet interval ends the period; the next refusal gets its own line again.
  EXPECT_EQ(log.TakeSummary(), "");
  EXPECT_FALSE(log.open());
  EXPECT_NE(log.Record("10.1.2.3", "no token"), "");
}

TEST(AuthFailureLogTest, BoundedAddressesStillCounted) {
  AuthFailureLog log(seconds(10), 2);
  log.Record("x", "no token");
  for (int i = 0; i < 5; ++i) log.Record("a" + std::to_string(i), "no token");
  const std::string s = log.TakeSummary();
  EXPECT_NE(s.find("5 requests"), std::string::npos) << s;
  EXPECT_NE(s.find("from 5 addresses"), std::string::npos) << s;
}

TEST(AuthFailureLogTest, Thousands) {
  EXPECT_EQ(WithThousands(0), "0");
  EXPECT_EQ(WithThousands(999), "999");
  EXPECT_EQ(WithThousands(1000), "1,000");
  EXPECT_EQ(WithThousands(1234567), "1,234,567");
}

TEST(TokenFileTest, ModeMustBeOwnerOnly) {
  TempDir dir;
  const std::string path = dir.File("token");
  WriteFile(path, "  s3cret \n");
  for (mode_t mode : {0600, 0400, 0700}) {
    ::chmod(path.c_str(), mode);
    Result<std::string> t = ReadTokenFile(path);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    EXPECT_EQ(*t, "s3cret");
  }
  for (mode_t mode : {0640, 0644, 0604, 0660, 0620, 0440}) {
    ::chmod(path.c_str(), mode);
    Result<std::string> t = ReadTokenFile(path);
    ASSERT_FALSE(t.ok()) << std::oct << mode;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
    char m[8];
    std::snprintf(m, sizeof m, "%04o", static_cast<unsigned>(mode));
    EXPECT_NE(t.status().message().find(path), std::string::npos) << t.status().message();
    EXPECT_NE(t.status().message().find(m), std::string::npos) << t.status().message();
    EXPECT_EQ(t.status().message().find("s3cret"), std::string::npos);
  }
  EXPECT_FALSE(ReadTokenFile(dir.File("absent")).ok());
}

// A file system in memory for the watch: what stat and read return.
struct FakeFile {
  Result<FileStamp> stamp = FileStamp{1, 6, 7};
  Result<std::string> token = std::string("first");
  int reads = 0;
};

TokenFileWatch MakeWatch(FakeFile* f, seconds grace) {
  return TokenFileWatch(
      "/run/token", "first", grace,
      [f](const std::string&) {
        ++f->reads;
        return f->token;
      },
      [f](const std::string&) { return f->stamp; });
}

TEST(TokenFileWatchTest, ARotatedTokenTakesEffectAndTheOldOneHasAGracePeriod) {
  FakeFile f;
  TokenFileWatch w = MakeWatch(&f, seconds(60));
  const auto t0 = AuthClock::now();
  EXPECT_EQ(w.Poll(t0), "");
  EXPECT_EQ(f.reads, 0);  // unchanged: not read
  EXPECT_TRUE(w.Accepts("first", t0));
  EXPECT_FALSE(w.Accepts("second", t0));
  EXPECT_FALSE(w.Accepts("", t0));
  f.stamp = FileStamp{2, 7, 7};
  f.token = std::string("second");
  EXPECT_EQ(w.Poll(t0 + milliseconds(500)), "");  // looked at most once a second
  const std::string line = w.Poll(t0 + seconds(1));
  EXPECT_NE(line.find("changed"), std::string::npos) << line;
  EXPECT_NE(line.find("60 s"), std::string::npos) << line;
  EXPECT_EQ(line.find("second"), std::string::npos) << line;  // never the token
  EXPECT_TRUE(w.Accepts("second", t0 + seconds(1)));
  EXPECT_TRUE(w.Accepts("first", t0 + seconds(60)));
  EXPECT_FALSE(w.Accepts("first", t0 + seconds(61)));
  EXPECT_TRUE(w.Accepts("second", t0 + seconds(61)));
}

TEST(TokenFileWatchTest, ARefusedOrMissingFileKeepsTheCurrentToken) {
  FakeFile f;
  TokenFileWatch w = MakeWatch(&f, seconds(60));
  auto t = AuthClock::now();
  f.stamp = FileStamp{2, 6, 7};
  f.token = Status::InvalidArgument("token file /run/token has mode 0644: ...");
  std::string line = w.Poll(t);
  EXPECT_NE(line.find("mode 0644"), std::string::npos) << line;
  EXPECT_TRUE(w.Accepts("first", t));
  t += seconds(1);
  EXPECT_EQ(w.Poll(t), "");  // the same refused version: said once, not read again
  EXPECT_EQ(f.reads, 1);
  f.stamp = Status::NotFound("token file /run/token: No such file or directory");
  t += seconds(1);
  EXPECT_NE(w.Poll(t).find("stays in use"), std::string::npos);
  t += seconds(1);
  EXPECT_EQ(w.Poll(t), "");
  EXPECT_TRUE(w.Accepts("first", t));
  // Fixed: taken.
  f.stamp = FileStamp{3, 5, 8};
  f.token = std::string("third");
  t += seconds(1);
  EXPECT_NE(w.Poll(t).find("changed"), std::string::npos);
  EXPECT_TRUE(w.Accepts("third", t));
}

TEST(TokenFileWatchTest, ARealFileRewritten) {
  TempDir dir;
  const std::string path = dir.File("token");
  WriteFile(path, "one\n");
  ::chmod(path.c_str(), 0600);
  TokenFileWatch w(path, ReadTokenFile(path).value(), seconds(5));
  auto t = AuthClock::now();
  EXPECT_EQ(w.Poll(t), "");
  WriteFile(path, "twotwo\n");  // another size: a change whatever the clock's resolution
  t += seconds(1);
  EXPECT_NE(w.Poll(t), "");
  EXPECT_TRUE(w.Accepts("twotwo", t));
  EXPECT_TRUE(w.Accepts("one", t + seconds(4)));
  EXPECT_FALSE(w.Accepts("one", t + seconds(5)));
}

}  // namespace
}  // namespace moerun
