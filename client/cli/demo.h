// The demo: trains a small model whose layers live on the server on a synthetic regression task
// (a fixed random tanh network is the teacher), with SGD on the server.
//   --model linear: Linear -> ReLU (on the client) -> Linear, two remote modules
//   --model mlp:    one remote LayerNormMLP (LayerNorm -> FC1 -> GELU -> FC2)
// The training loop runs on the DemoModel interface, so a local float32 model can be trained on
// exactly the same data for comparison.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/client/client.h"
#include "gradwire/client/cluster.h"

namespace gradwire::cli {

struct DemoOptions {
  std::string model = "linear";  // "linear" or "mlp"
  // FP8 scaling: "current", "delayed", "block" or "mxfp8"; empty: the server's default
  std::string recipe;
  int64_t steps = 200;  // training steps (forward + backward + optimizer step)
  int64_t batch = 64;   // samples per step
  int64_t in_features = 16;
  int64_t hidden = 64;  // hidden width (the MLP's ffn_features)
  int64_t out_features = 4;
  float learning_rate = 0.5f;  // SGD on the mean squared error
  uint64_t seed = 7;           // data, teacher and initial weights
  bool keep_modules = false;   // leave the modules on the server afterwards
  // Server index of each module, in order (fc1, fc2 / mlp); empty: round-robin over the servers.
  std::vector<int> placement;
};

struct DemoResult {
  double initial_loss = 0;  // held-out MSE before training (inference forwards)
  double final_loss = 0;    // held-out MSE after training
  int64_t steps = 0;
  double steps_per_s = 0;
  std::vector<std::string> module_ids;
  std::vector<std::string> module_servers;  // where each module lived
};

// A model the demo can train: forward, backward of the last training forward, optimizer step.
class DemoModel {
 public:
  virtual ~DemoModel() = default;
  virtual absl::StatusOr<client::HostTensor> Forward(const client::HostTensor& x,
                                                     bool training) = 0;
  // dL/dy of the last training forward; accumulates the parameter gradients.
  virtual absl::Status Backward(const client::HostTensor& grad_output) = 0;
  virtual absl::Status Step(float learning_rate) = 0;
  virtual std::vector<std::string> module_ids() const { return {}; }
  virtual std::vector<std::string> module_servers() const { return {}; }
};

// Creates the remote model of options.model on the servers of `cluster` (options.placement, or
// round-robin): a two-module model spans two servers when there are two. Every backward goes to
// the server of its forward. Its destructor deletes the modules unless keep_modules.
absl::StatusOr<std::unique_ptr<DemoModel>> MakeRemoteModel(client::Cluster& cluster,
                                                           const DemoOptions& options);

// The training loop on the demo's data. Progress goes to `progress` (nullptr: silent).
absl::StatusOr<DemoResult> Train(DemoModel& model, const DemoOptions& options, std::FILE* progress);

// MakeRemoteModel + Train.
absl::StatusOr<DemoResult> RunDemo(client::Cluster& cluster, const DemoOptions& options,
                                   std::FILE* progress);

}  // namespace gradwire::cli
