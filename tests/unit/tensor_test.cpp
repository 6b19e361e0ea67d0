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

// Issue 24, item 4: sizes are computed in one place, checked. base_emb_dim=9223372036854775807
// used to wrap to a small size, or reach the allocator as > 2^63 bytes, where its rounding loop
// never ended.
TEST(Tensor, SizesAreChecked) {
  const int64_t big = int64_t{1} << 62;
  EXPECT_EQ(shape_numel({2, 3, 4}), 24);
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(shape_numel({0, big, big}), 0);  // empty, whatever the others multiply to
  EXPECT_EQ(shape_bytes({big / 8}, DType::f32), size_t{1} << 61);
  for (const Shape& s : {Shape{big, 4}, Shape{int64_t{1} << 32, int64_t{1} << 32}, Shape{-1, 2}})
    EXPECT_THROW(shape_numel(s), Error) << shape_str(s);
  try {
    shape_bytes({big}, DType::f32);
    ADD_FAILURE() << "2^64 bytes computed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit in 64 bits"), std::string::npos) << e.what();
  }
}

TEST(Tensor, AbsurdAllocationsAreRefusedAndTheBackendGoesOn) {
  Backend& b = test::cpu();
  EXPECT_THROW(b.empty({int64_t{1} << 62, 4}, DType::f32), Error);  // wrapped to 0 bytes before
  try {
    b.empty({int64_t{1} << 61}, DType::u8);  // 2 EiB: fits the arithmetic, not any machine
    ADD_FAILURE() << "2^61 bytes were allocated";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("per_device_batch_size"), std::string::npos) << e.what();
  }
  Tensor t = test::from_vector(b, {2}, {1, 2});
  EXPECT_EQ(test::to_vector(t), (std::vector<float>{1, 2}));
}

}  // namespace mt
