// libtorch front end of the gradwire client: a torch::nn::Module whose forward and backward run on
// a gradwire server.
//
// The parameters live on the server (float32 master weights, cast to FP8 there), so a
// RemoteModule registers no local torch parameters: parameters() is empty and a local
// torch::optim optimizer never sees them. Backward accumulates the weight gradients on the
// server; apply_gradients() then steps the module's own optimizer there.
//
//   auto client = std::make_shared<gradwire::client::Client>(options);
//   gradwire::torch_client::RemoteModule layer(client, spec);
//   torch::Tensor loss = layer(x).square().mean();
//   loss.backward();                // runs Backward on the server
//   layer->apply_gradients(0.05f);  // one optimizer step on the server
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/ordered_dict.h>
#include <torch/types.h>

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <stdexcept>
#include <string>

#include "absl/status/status.h"
#include "gradwire/client/client.h"

namespace gradwire::torch_client {

// A call to the server failed. what() names the call and carries the gRPC status code name
// (e.g. "INVALID_ARGUMENT") and the server's message; code() is the gRPC code.
class RemoteError : public std::runtime_error {
 public:
  RemoteError(const std::string& what_failed, const absl::Status& status);
  absl::StatusCode code() const { return code_; }

 private:
  absl::StatusCode code_;
};

struct RemoteModuleOptions {
  // Leave a module created from a spec on the server when the RemoteModule is destroyed, e.g. for
  // another process to attach to by id. A module attached by id is never deleted.
  bool keep_on_server = false;
};

// Parameters (or their gradients) by name, in the module's order; float32 CPU tensors.
using NamedTensors = torch::OrderedDict<std::string, torch::Tensor>;

class RemoteModuleImpl : public torch::nn::Module {
 public:
  // Creates the module on the server (RemoteError when the server refuses the spec).
  RemoteModuleImpl(std::shared_ptr<client::Client> client, const v1::ModuleSpec& spec,
                   RemoteModuleOptions options = {});
  // Attaches to a module that already exists on the server (RemoteError NOT_FOUND when it does
  // not).
  RemoteModuleImpl(std::shared_ptr<client::Client> client, std::string module_id);
  // Deletes a module created from a spec unless keep_on_server; errors are only warned about.
  ~RemoteModuleImpl() override;

  RemoteModuleImpl(const RemoteModuleImpl&) = delete;
  RemoteModuleImpl& operator=(const RemoteModuleImpl&) = delete;

  // x: floating point [..., in_features] on any device; it travels as float32 and the result,
  // [..., out_features], comes back in x's dtype on x's device.
  //
  // With grad enabled, when x requires grad (in any mode, as for a local module: eval() does not
  // cut the graph) or, in training mode, the module requires grad, the server keeps the forward's
  // saved tensors under a context that the returned tensor's graph owns: backward through it runs
  // the server's Backward (accumulating the weight gradients there) and frees the context;
  // dropping the graph without backward releases it. Backward through the same output twice
  // (retain_graph) is not supported, because the first backward frees the context.
  //
  // Otherwise (torch::NoGradGuard, torch::InferenceMode, or eval() with an input that needs no
  // gradient) the server runs inference, keeps nothing, and the result is not part of any
  // autograd graph.
  //
  // Throws RemoteError when the server rejects the call, e.g. a wrong input shape.
  torch::Tensor forward(torch::Tensor x);

  // One step of the module's optimizer on the server with the gradients accumulated since the
  // last step, which it then zeroes. learning_rate > 0 overrides the configured rate for this
  // step. Returns the new weight version.
  uint64_t apply_gradients(float learning_rate = 0.0f);

  // The server's float32 master weights (not their FP8 casts).
  NamedTensors get_weights() const;
  // Replaces any subset of the parameters (converted to float32); all are checked by the server
  // before any changes. Returns the new weight version.
  uint64_t set_weights(const NamedTensors& weights);
  // The gradients accumulated on the server; zero=true also clears them there.
  NamedTensors get_gradients(bool zero = false);

  // Whether backward should compute (and accumulate on the server) weight gradients when the
  // input does not require grad. Default true; false freezes a first layer whose input needs no
  // gradient (its forwards then run as inference).
  void set_requires_grad(bool requires_grad);
  bool requires_grad() const;

  void set_keep_on_server(bool keep) { keep_on_server_ = keep; }

  const std::string& module_id() const { return module_id_; }
  // The module as the server described it on creation or attach (spec, parameter names).
  const v1::ModuleInfo& info() const { return info_; }
  const std::shared_ptr<client::Client>& client() const { return client_; }

  void pretty_print(std::ostream& stream) const override;

 private:
  std::shared_ptr<client::Client> client_;
  std::string module_id_;
  v1::ModuleInfo info_;
  bool owns_module_ = false;
  bool keep_on_server_ = false;
  // A zero-element leaf that requires grad, passed into the autograd function so that its output
  // requires grad (and backward reaches the server) even when x does not: the weights it stands
  // for are not local tensors. It never receives a gradient.
  torch::Tensor weight_anchor_;
};

TORCH_MODULE(RemoteModule);

}  // namespace gradwire::torch_client
