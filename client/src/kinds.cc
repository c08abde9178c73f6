#include "gradwire/client/kinds.h"

#include "absl/strings/str_join.h"

namespace gradwire::client {

const v1::KindDescription* DescribeKind(v1::ModuleKind kind) {
  if (kind == v1::MODULE_KIND_UNSPECIFIED) return nullptr;
  const google::protobuf::EnumValueDescriptor* value =
      v1::ModuleKind_descriptor()->FindValueByNumber(int(kind));
  if (value == nullptr || !value->options().HasExtension(v1::kind_description)) return nullptr;
  return &value->options().GetExtension(v1::kind_description);
}

std::vector<v1::ModuleKind> ModuleKinds() {
  std::vector<v1::ModuleKind> kinds;
  const google::protobuf::EnumDescriptor* e = v1::ModuleKind_descriptor();
  for (int i = 0; i < e->value_count(); ++i) {
    const auto kind = v1::ModuleKind(e->value(i)->number());
    if (DescribeKind(kind) != nullptr) kinds.push_back(kind);
  }
  return kinds;
}

std::optional<v1::ModuleKind> KindByName(absl::string_view name) {
  for (v1::ModuleKind kind : ModuleKinds()) {
    if (name == DescribeKind(kind)->cli_name() || name == v1::ModuleKind_Name(kind)) return kind;
  }
  return std::nullopt;
}

bool KindReads(v1::ModuleKind kind, absl::string_view field) {
  const v1::KindDescription* d = DescribeKind(kind);
  if (d == nullptr) return false;
  for (const std::string& f : d->spec_fields()) {
    if (f == field) return true;
  }
  return false;
}

std::vector<std::pair<std::string, int64_t>> KindWidths(const v1::ModuleSpec& spec) {
  std::vector<std::pair<std::string, int64_t>> widths;
  const v1::KindDescription* d = DescribeKind(spec.kind());
  if (d == nullptr) return widths;
  const google::protobuf::Reflection* r = spec.GetReflection();
  for (const std::string& name : d->widths()) {
    const google::protobuf::FieldDescriptor* f = spec.GetDescriptor()->FindFieldByName(name);
    if (f == nullptr || f->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_INT64) continue;
    widths.emplace_back(name, r->GetInt64(spec, f));
  }
  return widths;
}

bool ExactWireTakesFp8(const v1::ModuleSpec& spec) {
  const v1::KindDescription* d = DescribeKind(spec.kind());
  const v1::ScalingRecipe scaling = spec.recipe().scaling();
  if (d == nullptr || !d->fp8_input()) return false;
  if (scaling == v1::BLOCK || scaling == v1::MXFP8) return true;
  return (scaling == v1::CURRENT || scaling == v1::SCALING_RECIPE_UNSPECIFIED) &&
         spec.recipe().margin() == 0;
}

ExactGradForm ExactWireGradForm(const v1::ModuleSpec& spec, bool row_order_bias_sums) {
  const v1::KindDescription* d = DescribeKind(spec.kind());
  if (d == nullptr || !d->fp8_grad_output()) return ExactGradForm::kNone;
  if (spec.bias() && !row_order_bias_sums) return ExactGradForm::kNone;
  switch (spec.recipe().scaling()) {
    case v1::BLOCK:
      return spec.recipe().format() == v1::HYBRID ? ExactGradForm::kE5M2 : ExactGradForm::kE4M3;
    case v1::MXFP8:
      return ExactGradForm::kE4M3;
    case v1::CURRENT:
    case v1::SCALING_RECIPE_UNSPECIFIED:
      return spec.recipe().margin() == 0 ? ExactGradForm::kE5M2 : ExactGradForm::kNone;
    default:
      return ExactGradForm::kNone;
  }
}

int64_t RecipeBlockLength(const v1::ModuleSpec& spec) {
  switch (spec.recipe().scaling()) {
    case v1::BLOCK:
      return 128;
    case v1::MXFP8:
      return 32;
    default:
      return 0;
  }
}

std::vector<std::string> KindCliNames() {
  std::vector<std::string> names;
  for (v1::ModuleKind kind : ModuleKinds()) names.push_back(DescribeKind(kind)->cli_name());
  return names;
}

std::string KindNames() { return absl::StrJoin(KindCliNames(), ", "); }

}  // namespace gradwire::client
