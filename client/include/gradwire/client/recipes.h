// FP8 scaling recipes by name: what the CLI's --recipe, gradwire-load's --recipe and `gradwire
// info` call the values of gradwire.v1.ScalingRecipe ("current", "delayed", "block", "mxfp8"),
// and "block-hybrid": BLOCK with E5M2 gradients (Fp8Recipe.format HYBRID).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "gradwire/v1/module.pb.h"

namespace gradwire::client {

// The recipe called `name`: its lowercase name ("mxfp8") or its enum name ("MXFP8"); nullopt for
// anything else (SCALING_RECIPE_UNSPECIFIED included).
std::optional<v1::ScalingRecipe> RecipeByName(absl::string_view name);
// The lowercase name of `recipe`; "current" for SCALING_RECIPE_UNSPECIFIED (a server names the
// recipe a module got, so only an older server, which took an unset recipe as CURRENT, returns
// it), the enum's number for a value this contract does not name.
std::string RecipeName(v1::ScalingRecipe recipe);
// The name of a spec's recipe: RecipeName of its scaling, "block-hybrid" for BLOCK with the
// HYBRID format.
std::string RecipeName(const v1::Fp8Recipe& recipe);
// The recipe (scaling and format; nothing else set) called `name`: a RecipeByName name, or
// "block-hybrid"; nullopt for anything else.
std::optional<v1::Fp8Recipe> RecipeSpecByName(absl::string_view name);
// Every name --recipe takes: the recipes' lowercase names in enum order, then "block-hybrid";
// and them joined by ", ".
std::vector<std::string> RecipeNames();
std::string RecipeNamesJoined();

}  // namespace gradwire::client
