#include "gradwire/client/recipes.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_join.h"

namespace gradwire::client {

std::optional<v1::ScalingRecipe> RecipeByName(absl::string_view name) {
  v1::ScalingRecipe recipe;
  if (!v1::ScalingRecipe_Parse(absl::AsciiStrToUpper(name), &recipe) ||
      recipe == v1::SCALING_RECIPE_UNSPECIFIED) {
    return std::nullopt;
  }
  // Only the two spellings: "block" and "BLOCK", not "Block".
  if (name != absl::AsciiStrToUpper(name) && name != absl::AsciiStrToLower(name)) {
    return std::nullopt;
  }
  return recipe;
}

std::string RecipeName(v1::ScalingRecipe recipe) {
  if (recipe == v1::SCALING_RECIPE_UNSPECIFIED) return "current";
  if (!v1::ScalingRecipe_IsValid(recipe)) return std::to_string(int(recipe));
  return absl::AsciiStrToLower(v1::ScalingRecipe_Name(recipe));
}

namespace {
constexpr absl::string_view kBlockHybrid = "block-hybrid";
}  // namespace

std::string RecipeName(const v1::Fp8Recipe& recipe) {
  if (recipe.scaling() == v1::BLOCK && recipe.format() == v1::HYBRID) {
    return std::string(kBlockHybrid);
  }
  return RecipeName(recipe.scaling());
}

std::optional<v1::Fp8Recipe> RecipeSpecByName(absl::string_view name) {
  v1::Fp8Recipe recipe;
  if (name == kBlockHybrid) {
    recipe.set_scaling(v1::BLOCK);
    recipe.set_format(v1::HYBRID);
    return recipe;
  }
  const std::optional<v1::ScalingRecipe> scaling = RecipeByName(name);
  if (!scaling) return std::nullopt;
  recipe.set_scaling(*scaling);
  return recipe;
}

std::vector<std::string> RecipeNames() {
  std::vector<std::string> out;
  const google::protobuf::EnumDescriptor* d = v1::ScalingRecipe_descriptor();
  for (int i = 0; i < d->value_count(); ++i) {
    const auto r = static_cast<v1::ScalingRecipe>(d->value(i)->number());
    if (r != v1::SCALING_RECIPE_UNSPECIFIED) out.push_back(RecipeName(r));
  }
  out.emplace_back(kBlockHybrid);
  return out;
}

std::string RecipeNamesJoined() { return absl::StrJoin(RecipeNames(), ", "); }

}  // namespace gradwire::client
