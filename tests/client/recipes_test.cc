// The recipes' names the CLI, gradwire-load and `gradwire info` use (gradwire/client/recipes.h),
// against the wire contract's enum.
#include "gradwire/client/recipes.h"

#include <gtest/gtest.h>

namespace gradwire::client {
namespace {

TEST(Recipes, NamesAreTheContractsValuesInLowerCase) {
  EXPECT_EQ(RecipeNames(), (std::vector<std::string>{"current", "delayed", "block", "mxfp8"}));
  EXPECT_EQ(RecipeNamesJoined(), "current, delayed, block, mxfp8");
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

TEST(Recipes, AnythingElseIsNoRecipe) {
  for (const char* bad : {"", "Block", "blocks", "mx", "SCALING_RECIPE_UNSPECIFIED", "3"}) {
    EXPECT_FALSE(RecipeByName(bad).has_value()) << bad;
  }
  EXPECT_EQ(RecipeName(v1::SCALING_RECIPE_UNSPECIFIED), "current");  // what the server reads
  EXPECT_EQ(RecipeName(static_cast<v1::ScalingRecipe>(42)), "42");
}

}  // namespace
}  // namespace gradwire::client
