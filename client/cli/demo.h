// The demo: trains a two-layer model whose Linear layers live on the server (ReLU between them
// on the client) on a synthetic regression task, with SGD on the server.
#pragma once

#include <cstdint>
#include <cstdio>

#include "absl/status/statusor.h"
#include "gradwire/client/client.h"

namespace gradwire::cli {

struct DemoOptions {
  int64_t steps = 200;  // training steps (one forward+backward+SGD per layer)
  int64_t batch = 64;   // samples per step
  int64_t in_features = 16;
  int64_t hidden = 64;
  int64_t out_features = 4;
  float learning_rate = 0.5f;  // SGD step on the mean squared error
  uint64_t seed = 7;           // data, teacher and initial weights
  bool keep_modules = false;   // leave the modules on the server afterwards
};

struct DemoResult {
  double initial_loss = 0;  // held-out MSE before training (inference forwards)
  double final_loss = 0;    // held-out MSE after training
  int64_t steps = 0;
  double steps_per_s = 0;
};

// Progress goes to `progress` (nullptr: silent).
absl::StatusOr<DemoResult> RunDemo(client::Client& client, const DemoOptions& options,
                                   std::FILE* progress);

}  // namespace gradwire::cli
