#include "base/status.h"

#include <gtest/gtest.h>

namespace moerun {
namespace {

Result<int> Half(int v) {
  if (v % 2 != 0) return Status::InvalidArgument(std::to_string(v) + " is odd");
  return v / 2;
}

Result<int> Quarter(int v) {
  MOERUN_ASSIGN_OR_RETURN(int h, Half(v));
  MOERUN_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(StatusTest, OkAndErrors) {
  EXPECT_TRUE(Status::Ok().ok());
  const Status s = Status::Corrupt("bad header").WithContext("model.safetensors");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kCorrupt);
  EXPECT_EQ(s.ToString(), "corrupt: model.safetensors: bad header");
}

TEST(StatusTest, ResultPropagates) {
  EXPECT_EQ(*Quarter(8), 2);
  const auto r = Quarter(6);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "3 is odd");
}

}  // namespace
}  // namespace moerun
