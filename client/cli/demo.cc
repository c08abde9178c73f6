#include "demo.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gradwire/kernels/random.h"
#include "progress.h"

namespace gradwire::cli {
namespace {

using client::HostTensor;

// Random streams of the demo's generator (kernels::FillNormal is counter-based).
constexpr uint64_t kTeacherStream1 = 101, kTeacherStream2 = 102, kEvalStream = 103;
constexpr uint64_t kTrainStreamBase = 1000;

HostTensor Normal(std::vector<int64_t> shape, uint64_t seed, uint64_t stream, float scale) {
  HostTensor t = HostTensor::Zeros(std::move(shape));
  kernels::FillNormal(t.data.data(), t.numel(), seed, stream);
  for (float& v : t.data) v *= scale;
  return t;
}

// y[b, o] = sum_i x[b, i] * w[o, i]
HostTensor MatMulT(const HostTensor& x, const HostTensor& w) {
  const int64_t b = x.shape[0], in = x.shape[1], out = w.shape[0];
  HostTensor y = HostTensor::Zeros({b, out});
  for (int64_t r = 0; r < b; ++r) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < in; ++i) acc += double(x.data[r * in + i]) * w.data[o * in + i];
      y.data[r * out + o] = float(acc);
    }
  }
  return y;
}

// The task: a fixed random two-layer tanh network.
struct Teacher {
  HostTensor w1, w2;
  HostTensor operator()(const HostTensor& x) const {
    HostTensor h = MatMulT(x, w1);
    for (float& v : h.data) v = std::tanh(v);
    return MatMulT(h, w2);
  }
};

double MeanSquaredError(const HostTensor& y, const HostTensor& target) {
  double sum = 0;
  for (size_t i = 0; i < y.data.size(); ++i) {
    const double d = double(y.data[i]) - target.data[i];
    sum += d * d;
  }
  return sum / double(y.data.size());
}

void Relu(HostTensor& t) {
  for (float& v : t.data) v = std::max(v, 0.0f);
}

// The remote student: Linear -> ReLU (here) -> Linear.
struct Student {
  client::Client& client;
  std::string fc1, fc2;

  absl::StatusOr<HostTensor> Predict(const HostTensor& x) {
    auto h = client.Forward(fc1, x, /*training=*/false);
    if (!h.ok()) return h.status();
    Relu(h->output);
    auto y = client.Forward(fc2, h->output, /*training=*/false);
    if (!y.ok()) return y.status();
    return std::move(y->output);
  }
};

}  // namespace

absl::StatusOr<DemoResult> RunDemo(client::Client& client, const DemoOptions& o,
                                   std::FILE* progress) {
  if (o.steps < 1 || o.batch < 1 || !(o.learning_rate > 0)) {
    return absl::InvalidArgumentError("demo needs steps >= 1, batch >= 1 and learning_rate > 0");
  }
  const Teacher teacher{
      Normal({32, o.in_features}, o.seed, kTeacherStream1, 1.5f / std::sqrt(float(o.in_features))),
      Normal({o.out_features, 32}, o.seed, kTeacherStream2, 1.0f / std::sqrt(32.0f))};
  const HostTensor eval_x = Normal({256, o.in_features}, o.seed, kEvalStream, 1.0f);
  const HostTensor eval_y = teacher(eval_x);

  auto make_spec = [&](int64_t in, int64_t out, uint64_t seed, const char* name) {
    v1::ModuleSpec spec;
    spec.set_kind(v1::LINEAR);
    spec.set_in_features(in);
    spec.set_out_features(out);
    spec.set_bias(true);
    spec.mutable_recipe()->set_scaling(v1::CURRENT);
    spec.set_seed(seed);
    spec.set_name(name);
    return spec;
  };
  auto fc1 = client.CreateModule(make_spec(o.in_features, o.hidden, o.seed * 2 + 1, "demo.fc1"));
  if (!fc1.ok()) return fc1.status();
  auto fc2 = client.CreateModule(make_spec(o.hidden, o.out_features, o.seed * 2 + 2, "demo.fc2"));
  if (!fc2.ok()) {
    (void)client.DeleteModule(fc1->module_id());
    return fc2.status();
  }
  Student student{client, fc1->module_id(), fc2->module_id()};
  auto cleanup = [&] {
    if (o.keep_modules) return;
    (void)client.DeleteModule(student.fc1);
    (void)client.DeleteModule(student.fc2);
  };
  auto run = [&]() -> absl::StatusOr<DemoResult> {
    DemoResult result;
    auto before = student.Predict(eval_x);
    if (!before.ok()) return before.status();
    result.initial_loss = MeanSquaredError(*before, eval_y);

    ProgressBar bar(progress ? progress : stderr, o.steps, "training");
    const auto start = std::chrono::steady_clock::now();
    for (int64_t step = 0; step < o.steps; ++step) {
      const HostTensor x =
          Normal({o.batch, o.in_features}, o.seed, kTrainStreamBase + uint64_t(step), 1.0f);
      const HostTensor target = teacher(x);
      auto h = client.Forward(student.fc1, x, /*training=*/true);
      if (!h.ok()) return h.status();
      HostTensor a = h->output;
      Relu(a);
      auto y = client.Forward(student.fc2, a, /*training=*/true);
      if (!y.ok()) return y.status();
      const double loss = MeanSquaredError(y->output, target);
      // d(mean (y - t)^2)/dy = 2 (y - t) / numel
      HostTensor dy = HostTensor::Zeros(y->output.shape);
      const float k = 2.0f / float(dy.numel());
      for (size_t i = 0; i < dy.data.size(); ++i) {
        dy.data[i] = k * (y->output.data[i] - target.data[i]);
      }
      auto da = client.Backward(y->context_id, dy);
      if (!da.ok()) return da.status();
      for (size_t i = 0; i < da->data.size(); ++i) {
        if (h->output.data[i] <= 0.0f) da->data[i] = 0.0f;  // ReLU'
      }
      client::BackwardOptions first_layer;
      first_layer.skip_grad_input = true;
      auto dx = client.Backward(h->context_id, *da, first_layer);
      if (!dx.ok()) return dx.status();
      for (const std::string& id : {student.fc1, student.fc2}) {
        auto version = client.ApplyGradients(id, o.learning_rate);
        if (!version.ok()) return version.status();
      }
      if (progress) bar.Update(step + 1, absl::StrFormat("loss %.5f", loss));
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    result.steps = o.steps;
    result.steps_per_s = double(o.steps) / seconds;
    auto after = student.Predict(eval_x);
    if (!after.ok()) return after.status();
    result.final_loss = MeanSquaredError(*after, eval_y);
    if (progress) {
      bar.Finish(
          absl::StrFormat("held-out loss %.5f -> %.5f", result.initial_loss, result.final_loss));
    }
    return result;
  };
  auto result = run();
  cleanup();
  return result;
}

}  // namespace gradwire::cli
