// The recipes' names the CLI, gradwire-load and `gradwire info` use (gradwire/client/recipes.h),
// against the wire contract's enum.
#include "gradwire/client/recipes.h"

#include <gtest/gtest.h>

namespace gradwire::client {
namespace {

TEST(Recipes, NamesAreTheContractsValuesInLowerCase) {
  EXPECT_EQ(RecipeNames(),
            (std::vector<std::string>{"current", "delayed", "block", "mxfp8", "block-hybrid"}));
  EXPECT_EQ(RecipeNamesJoined(), "current, delayed, block, mxfp8, block-hybrid");
  const struct {
    const char* name;
    v1::ScalingRecipe value;
  } known[] = {{"current", v1::CURRENT},
               {"delayed", v1::DELAYED},
               {"block", v1::BLOCK},
               {"mxfp8", v1::MXFP8}};
  for (const auto& k : known) {
    EXPECT_EQ(RecipeByName(k.name), k.value) << k.name;
    EXPECT_EQ(RecipeName(k.value), k.name);
    EXPECT_EQ(RecipeByName(v1::ScalingRecipe_Name(k.value)), k.value);
  }
}

TEST(Recipes, BlockHybridIsBlockWithE5M2Gradients) {
  const std::optional<v1::Fp8Recipe> hybrid = RecipeSpecByName("block-hybrid");
  ASSERT_TRUE(hybrid.has_value());
  EXPECT_EQ(hybrid->scaling(), v1::BLOCK);
  EXPECT_EQ(hybrid->format(), v1::HYBRID);
  EXPECT_EQ(RecipeName(*hybrid), "block-hybrid");
  EXPECT_FALSE(RecipeByName("block-hybrid").has_value());  // not a ScalingRecipe value
  const std::optional<v1::Fp8Recipe> block = RecipeSpecByName("block");
  ASSERT_TRUE(block.has_value());
  EXPECT_EQ(block->scaling(), v1::BLOCK);
  EXPECT_EQ(block->format(), v1::FP8_FORMAT_UNSPECIFIED);
  v1::Fp8Recipe e4m3 = *block;
  e4m3.set_format(v1::E4M3_ONLY);
  EXPECT_EQ(RecipeName(e4m3), "block");
  for (const char* bad : {"", "Block-Hybrid", "hybrid", "mxfp8-hybrid"}) {
    EXPECT_FALSE(RecipeSpecByName(bad).has_value()) << bad;
  }
}

TEST(Recipes, AnythingElseIsNoRecipe) {
  for (const char* bad : {"", "Block", "blocks", "mx", "SCALING_RECIPE_UNSPECIFIED", "3"}) {
    EXPECT_FALSE(RecipeByName(bad).has_value()) << bad;
  }
  EXPECT_EQ(RecipeName(v1::SCALING_RECIPE_UNSPECIFIED), "current");  // what the server reads
  EXPECT_EQ(RecipeName(static_cast<v1::ScalingRecipe>(42)), "42");
}

}  // namespace
}  // namespace gradwire::client
