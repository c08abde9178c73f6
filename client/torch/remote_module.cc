#include "gradwire/torch/remote_module.h"

#include <torch/autograd.h>

#include <cstring>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gradwire/client/kinds.h"

namespace gradwire::torch_client {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kContextKey = "gradwire_context";

client::HostTensor ToHost(const torch::Tensor& t) {
  const torch::Tensor c = t.detach().to(torch::kCPU, torch::kFloat).contiguous();
  client::HostTensor out;
  out.shape.assign(c.sizes().begin(), c.sizes().end());
  const float* data = c.data_ptr<float>();
  out.data.assign(data, data + c.numel());
  return out;
}

torch::Tensor ToTorch(const client::HostTensor& t) {
  torch::Tensor out = torch::empty(t.shape, torch::kFloat);
  TORCH_CHECK(size_t(out.numel()) == t.data.size(), "gradwire: response tensor of shape ",
              out.sizes(), " has ", t.data.size(), " elements");
  if (!t.data.empty()) {
    std::memcpy(out.data_ptr<float>(), t.data.data(), t.data.size() * sizeof(float));
  }
  return out;
}

NamedTensors ToNamed(const client::NamedTensors& named) {
  NamedTensors out;
  out.reserve(named.tensors.size());
  for (const auto& [name, tensor] : named.tensors) out.insert(name, ToTorch(tensor));
  return out;
}

template <typename T>
T ValueOrThrow(absl::StatusOr<T> result, const std::string& what) {
  if (!result.ok()) throw RemoteError(what, result.status());
  return *std::move(result);
}

// One training forward's context on the server. The autograd node owns it (through a capsule in
// ctx->saved_data), so the context lives exactly as long as the graph that can still use it: a
// graph dropped without backward releases it here rather than leaving it to the server.
class ServerContext : public torch::CustomClassHolder {
 public:
  ServerContext(std::shared_ptr<client::Client> client, std::string module_id,
                std::string context_id)
      : client_(std::move(client)),
        module_id_(std::move(module_id)),
        context_id_(std::move(context_id)) {}

  ~ServerContext() override {
    if (consumed_ || context_id_.empty()) return;
    // NOT_FOUND: the module (and with it the context) was deleted first, which is fine.
    const absl::Status status = client_->ReleaseContext(context_id_);
    if (!status.ok() && status.code() != absl::StatusCode::kNotFound) {
      try {
        TORCH_WARN("gradwire: could not release context ", context_id_, " of module ", module_id_,
                   ": ", status.ToString());
      } catch (...) {
        // A warning handler that throws must not escape a destructor run by autograd.
      }
    }
  }

  client::Client& client() { return *client_; }
  const std::string& module_id() const { return module_id_; }
  const std::string& context_id() const { return context_id_; }
  bool consumed() const { return consumed_; }
  // Autograd serialises backward calls on one node (CppNode holds a mutex around backward), so
  // this flag needs no lock of its own.
  void MarkConsumed() { consumed_ = true; }

 private:
  std::shared_ptr<client::Client> client_;
  std::string module_id_;
  std::string context_id_;
  bool consumed_ = false;
};

class RemoteFunction : public torch::autograd::Function<RemoteFunction> {
 public:
  // input: float32, CPU, contiguous. anchor only connects the module's weights to the graph.
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& input,
                               const torch::Tensor& /*anchor*/,
                               const std::shared_ptr<client::Client>& client,
                               const std::string& module_id) {
    client::ForwardResult result =
        ValueOrThrow(client->Forward(module_id, ToHost(input), /*training=*/true),
                     absl::StrCat("module ", module_id));
    // Owned before anything else can throw, so the context cannot leak.
    auto context = c10::make_intrusive<ServerContext>(client, module_id, result.context_id);
    ctx->saved_data[kContextKey] = c10::IValue::make_capsule(std::move(context));
    return ToTorch(result.output);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const c10::intrusive_ptr<torch::CustomClassHolder> capsule =
        ctx->saved_data.at(kContextKey).toCapsule();
    auto* context = static_cast<ServerContext*>(capsule.get());
    TORCH_CHECK(!context->consumed(), "gradwire: backward through module ", context->module_id(),
                " a second time: the first backward freed its server context ",
                context->context_id(), " (retain_graph is not supported by RemoteModule)");
    client::BackwardOptions options;
    // The first layer of a model gets an input that needs no gradient; the server then skips
    // computing grad_input altogether.
    options.skip_grad_input = !ctx->needs_input_grad(0);
    client::HostTensor grad_input = ValueOrThrow(
        context->client().Backward(context->context_id(), ToHost(grad_outputs.at(0)), options),
        absl::StrCat("module ", context->module_id()));
    context->MarkConsumed();
    return {options.skip_grad_input ? torch::Tensor() : ToTorch(grad_input), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

RemoteError::RemoteError(const std::string& what_failed, const absl::Status& status)
    : std::runtime_error(absl::StrCat("gradwire ", what_failed, ": ",
                                      absl::StatusCodeToString(status.code()), ": ",
                                      status.message())),
      code_(status.code()) {}

RemoteModuleImpl::RemoteModuleImpl(std::shared_ptr<client::Client> client,
                                   const v1::ModuleSpec& spec, RemoteModuleOptions options)
    : client_(std::move(client)), keep_on_server_(options.keep_on_server) {
  TORCH_CHECK(client_ != nullptr, "gradwire: RemoteModule needs a client");
  // Before the module exists: nothing may throw between creating it and owning it.
  weight_anchor_ = torch::empty({0}, torch::kFloat).requires_grad_(true);
  info_ = ValueOrThrow(client_->CreateModule(spec), "CreateModule");
  module_id_ = info_.module_id();
  owns_module_ = true;
}

RemoteModuleImpl::RemoteModuleImpl(std::shared_ptr<client::Client> client, std::string module_id)
    : client_(std::move(client)), module_id_(std::move(module_id)) {
  TORCH_CHECK(client_ != nullptr, "gradwire: RemoteModule needs a client");
  // The service has no single-module lookup; listing is cheap and checks the id up front rather
  // than at the first forward.
  const std::vector<v1::ModuleInfo> modules =
      ValueOrThrow(client_->ListModules(module_id_), "ListModules");
  bool found = false;
  for (const v1::ModuleInfo& m : modules) {
    if (m.module_id() == module_id_) {
      info_ = m;
      found = true;
      break;
    }
  }
  if (!found) {
    throw RemoteError(
        "attach", absl::NotFoundError(absl::StrCat("module_id ", module_id_, " is not a module on ",
                                                   client_->options().server)));
  }
  client_->Hold(module_id_);  // kept alive on a server with --module-ttl while attached here
  weight_anchor_ = torch::empty({0}, torch::kFloat).requires_grad_(true);
}

RemoteModuleImpl::~RemoteModuleImpl() {
  if (!owns_module_ || keep_on_server_) {
    client_->Release(module_id_);  // the server's --module-ttl decides from here on
    return;
  }
  const absl::Status status = client_->DeleteModule(module_id_);
  if (!status.ok() && status.code() != absl::StatusCode::kNotFound) {
    try {
      TORCH_WARN("gradwire: could not delete module ", module_id_, ": ", status.ToString());
    } catch (...) {
      // A warning handler that throws must not escape a destructor.
    }
  }
}

torch::Tensor RemoteModuleImpl::forward(torch::Tensor x) {
  TORCH_CHECK(x.defined(), "gradwire: module ", module_id_, ": input is undefined");
  TORCH_CHECK(x.is_floating_point(), "gradwire: module ", module_id_,
              ": input must be floating point, got ", x.scalar_type());
  // A differentiable conversion: autograd maps grad_input back to x's dtype and device.
  const torch::Tensor input = x.to(torch::kCPU, torch::kFloat).contiguous();
  // As a local module: only no-grad mode skips the graph. eval() changes nothing about
  // gradients; it only means that, with an input that needs none, there is nothing to train and
  // the forward keeps nothing on the server.
  const bool track = c10::GradMode::is_enabled() &&
                     (x.requires_grad() || (is_training() && weight_anchor_.requires_grad()));
  torch::Tensor output;
  if (track) {
    output = RemoteFunction::apply(input, weight_anchor_, client_, module_id_);
  } else {
    client::ForwardResult result =
        ValueOrThrow(client_->Forward(module_id_, ToHost(input), /*training=*/false),
                     absl::StrCat("module ", module_id_));
    output = ToTorch(result.output);
  }
  return output.to(x.device(), x.scalar_type());
}

uint64_t RemoteModuleImpl::apply_gradients(float learning_rate) {
  return ValueOrThrow(client_->ApplyGradients(module_id_, learning_rate),
                      absl::StrCat("module ", module_id_));
}

NamedTensors RemoteModuleImpl::get_weights() const {
  return ToNamed(
      ValueOrThrow(client_->GetWeights(module_id_), absl::StrCat("module ", module_id_)));
}

uint64_t RemoteModuleImpl::set_weights(const NamedTensors& weights) {
  std::vector<std::pair<std::string, client::HostTensor>> parameters;
  parameters.reserve(weights.size());
  for (const auto& item : weights) {
    TORCH_CHECK(item.value().defined(), "gradwire: module ", module_id_, ": parameter ", item.key(),
                " is undefined");
    parameters.emplace_back(item.key(), ToHost(item.value()));
  }
  return ValueOrThrow(client_->SetWeights(module_id_, parameters),
                      absl::StrCat("module ", module_id_));
}

NamedTensors RemoteModuleImpl::get_gradients(bool zero) {
  return ToNamed(
      ValueOrThrow(client_->GetGradients(module_id_, zero), absl::StrCat("module ", module_id_)));
}

void RemoteModuleImpl::set_requires_grad(bool requires_grad) {
  weight_anchor_.requires_grad_(requires_grad);
}

bool RemoteModuleImpl::requires_grad() const { return weight_anchor_.requires_grad(); }

void RemoteModuleImpl::pretty_print(std::ostream& stream) const {
  const v1::ModuleSpec& spec = info_.spec();
  stream << "gradwire::RemoteModule(module_id=" << module_id_
         << ", kind=" << v1::ModuleKind_Name(spec.kind());
  for (const auto& [field, width] : client::KindWidths(spec))
    stream << ", " << field << "=" << width;
  stream << ", server=" << client_->options().server << ")";
}

}  // namespace gradwire::torch_client
