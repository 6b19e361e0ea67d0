#include <gtest/gtest.h>

#include "mt/error.h"
#include "test_support.h"

namespace mt {

TEST(Tensor, ViewsShareStorage) {
  Backend& b = test::cpu();
  Tensor t = test::from_vector(b, {2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor v = t.view({3, 2});
  EXPECT_EQ(v.data(), t.data());
  Tensor s = t.slice0(1, 2);
  EXPECT_EQ(test::to_vector(s), (std::vector<float>{4, 5, 6}));
  EXPECT_THROW(t.view({4}), Error);
}

}  // namespace mt
