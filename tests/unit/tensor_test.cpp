#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "mt/dtype.h"
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

// f16 (mt/dtype.h; int8 rows' scales, safetensors' F16): every finite f16 and infinity widens to
// the value its bits define (checked against ldexp) and narrows back to itself; between two
// neighbours, the midpoint rounds to the even one and anything off it to the nearer; beyond
// 65504 from the midpoint 65520 on is an infinity; NaN stays NaN.
TEST(DType, F16ConversionsAreExactAndRoundToNearestEven) {
  auto value = [](uint32_t h) {
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    const double mag = std::ldexp(static_cast<double>(e ? 1024 + m : m), (e ? int(e) : 1) - 25);
    return (h & 0x8000u) ? -mag : mag;
  };
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const bool nan = ((h >> 10) & 0x1fu) == 0x1fu && (h & 0x3ffu) != 0;
    const float f = mt::f16_to_f32(static_cast<uint16_t>(h));
    if (nan) {
      ASSERT_TRUE(std::isnan(f)) << h;
      ASSERT_TRUE(std::isnan(mt::f16_to_f32(mt::f32_to_f16(f)))) << h;
      continue;
    }
    if (((h >> 10) & 0x1fu) == 0x1fu) {
      ASSERT_TRUE(std::isinf(f) && (f < 0) == bool(h & 0x8000u)) << h;
    } else {
      ASSERT_EQ(static_cast<double>(f), value(h)) << h;
    }
    ASSERT_EQ(mt::f32_to_f16(f), h) << h;
  }
  for (uint32_t h = 0; h < 0x7bffu; ++h) {  // neighbours h, h + 1, both finite and >= 0
    const auto mid = static_cast<float>((value(h) + value(h + 1)) / 2);  // exact: 12 bits
    ASSERT_EQ(static_cast<double>(mid), (value(h) + value(h + 1)) / 2) << h;
    ASSERT_EQ(mt::f32_to_f16(mid), (h & 1u) ? h + 1 : h) << h;
    ASSERT_EQ(mt::f32_to_f16(std::nextafter(mid, 0.f)), h) << h;
    ASSERT_EQ(mt::f32_to_f16(std::nextafter(mid, 1e9f)), h + 1) << h;
    ASSERT_EQ(mt::f32_to_f16(-mid), ((h & 1u) ? h + 1 : h) | 0x8000u) << h;
  }
  EXPECT_EQ(mt::f32_to_f16(65504.f), 0x7bffu);
  EXPECT_EQ(mt::f32_to_f16(std::nextafter(65520.f, 0.f)), 0x7bffu);
  EXPECT_EQ(mt::f32_to_f16(65520.f), 0x7c00u);
  EXPECT_EQ(mt::f32_to_f16(-1e30f), 0xfc00u);
  EXPECT_EQ(mt::f32_to_f16(std::ldexp(1.f, -25)), 0u);  // half the smallest subnormal: even
  EXPECT_EQ(mt::f32_to_f16(std::nextafter(std::ldexp(1.f, -25), 1.f)), 1u);
}
