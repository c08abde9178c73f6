#include "demo.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gradwire/client/recipes.h"
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

v1::ModuleSpec BaseSpec(const DemoOptions& o, uint64_t seed, const char* name) {
  v1::ModuleSpec spec;
  spec.set_bias(true);
  // Unset (the server's --default-recipe) unless the demo was given one.
  if (std::optional<v1::Fp8Recipe> recipe = client::RecipeSpecByName(o.recipe)) {
    *spec.mutable_recipe() = *recipe;
  }
  spec.mutable_optimizer()->mutable_sgd()->set_learning_rate(o.learning_rate);
  spec.set_seed(seed);
  spec.set_name(name);
  return spec;
}

// Modules created on the server and deleted with the model.
class RemoteModel : public DemoModel {
 public:
  RemoteModel(client::Cluster& client, bool keep, std::vector<int> placement)
      : client_(client), keep_(keep), placement_(std::move(placement)) {}
  ~RemoteModel() override {
    if (keep_) return;
    for (const std::string& id : ids_) (void)client_.DeleteModule(id);
  }
  std::vector<std::string> module_ids() const override { return ids_; }
  std::vector<std::string> module_servers() const override { return servers_; }
  absl::Status Step(float learning_rate) override {
    for (const std::string& id : ids_) {
      auto version = client_.ApplyGradients(id, learning_rate);
      if (!version.ok()) return version.status();
    }
    return absl::OkStatus();
  }
  absl::Status Create(const v1::ModuleSpec& spec) {
    const size_t index = ids_.size();
    if (!placement_.empty() && index >= placement_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("placement names ", placement_.size(),
                                                     " servers; the model has more modules"));
    }
    auto info = client_.CreateModule(
        spec, placement_.empty() ? client::Cluster::kRoundRobin : placement_[index]);
    if (!info.ok()) return info.status();
    ids_.push_back(info->module_id());
    auto where = client_.Locate(info->module_id());
    if (!where.ok()) return where.status();
    servers_.push_back(client_.address(*where));
    return absl::OkStatus();
  }

 protected:
  client::Cluster& client_;
  bool keep_;
  std::vector<int> placement_;
  std::vector<std::string> ids_;
  std::vector<std::string> servers_;
};

// Linear -> ReLU (here) -> Linear.
class RemoteTwoLinear final : public RemoteModel {
 public:
  using RemoteModel::RemoteModel;
  absl::StatusOr<HostTensor> Forward(const HostTensor& x, bool training) override {
    auto h = client_.Forward(ids_[0], x, training);
    if (!h.ok()) return h.status();
    HostTensor a = h->output;
    for (float& v : a.data) v = std::max(v, 0.0f);
    auto y = client_.Forward(ids_[1], a, training);
    if (!y.ok()) return y.status();
    if (training) {
      pre_activation_ = std::move(h->output);
      contexts_ = {h->context_id, y->context_id};
    }
    return std::move(y->output);
  }
  absl::Status Backward(const HostTensor& dy) override {
    auto da = client_.Backward(contexts_[1], dy);
    if (!da.ok()) return da.status();
    for (size_t i = 0; i < da->data.size(); ++i) {
      if (pre_activation_.data[i] <= 0.0f) da->data[i] = 0.0f;  // ReLU'
    }
    client::BackwardOptions first_layer;
    first_layer.skip_grad_input = true;
    return client_.Backward(contexts_[0], *da, first_layer).status();
  }

 private:
  HostTensor pre_activation_;
  std::vector<std::string> contexts_;
};

// One LayerNormMLP.
class RemoteMlp final : public RemoteModel {
 public:
  using RemoteModel::RemoteModel;
  absl::StatusOr<HostTensor> Forward(const HostTensor& x, bool training) override {
    auto y = client_.Forward(ids_[0], x, training);
    if (!y.ok()) return y.status();
    if (training) context_ = y->context_id;
    return std::move(y->output);
  }
  absl::Status Backward(const HostTensor& dy) override {
    client::BackwardOptions first_layer;
    first_layer.skip_grad_input = true;
    return client_.Backward(context_, dy, first_layer).status();
  }

 private:
  std::string context_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DemoModel>> MakeRemoteModel(client::Cluster& client,
                                                           const DemoOptions& o) {
  if (!o.recipe.empty() && !client::RecipeSpecByName(o.recipe)) {
    return absl::InvalidArgumentError(
        absl::StrCat("recipe must be one of ", client::RecipeNamesJoined(), ", got ", o.recipe));
  }
  if (o.model == "linear") {
    auto model = std::make_unique<RemoteTwoLinear>(client, o.keep_modules, o.placement);
    if (o.placement.size() > 2) {
      return absl::InvalidArgumentError("--model linear has 2 modules; placement names more");
    }
    v1::ModuleSpec fc1 = BaseSpec(o, o.seed * 2 + 1, "demo.fc1");
    fc1.set_kind(v1::LINEAR);
    fc1.set_in_features(o.in_features);
    fc1.set_out_features(o.hidden);
    v1::ModuleSpec fc2 = BaseSpec(o, o.seed * 2 + 2, "demo.fc2");
    fc2.set_kind(v1::LINEAR);
    fc2.set_in_features(o.hidden);
    fc2.set_out_features(o.out_features);
    if (auto s = model->Create(fc1); !s.ok()) return s;
    if (auto s = model->Create(fc2); !s.ok()) return s;  // the destructor deletes fc1
    return std::unique_ptr<DemoModel>(std::move(model));
  }
  if (o.model == "mlp") {
    auto model = std::make_unique<RemoteMlp>(client, o.keep_modules, o.placement);
    if (o.placement.size() > 1) {
      return absl::InvalidArgumentError("--model mlp has 1 module; placement names more");
    }
    v1::ModuleSpec mlp = BaseSpec(o, o.seed * 2 + 1, "demo.mlp");
    mlp.set_kind(v1::LAYERNORM_MLP);
    mlp.set_in_features(o.in_features);
    mlp.set_ffn_features(o.hidden);
    mlp.set_out_features(o.out_features);
    mlp.set_activation(v1::GELU);
    if (auto s = model->Create(mlp); !s.ok()) return s;
    return std::unique_ptr<DemoModel>(std::move(model));
  }
  return absl::InvalidArgumentError(absl::StrCat("model must be linear or mlp, got ", o.model));
}

absl::StatusOr<DemoResult> Train(DemoModel& model, const DemoOptions& o, std::FILE* progress) {
  if (o.steps < 1 || o.batch < 1 || !(o.learning_rate > 0)) {
    return absl::InvalidArgumentError("demo needs steps >= 1, batch >= 1 and learning_rate > 0");
  }
  const Teacher teacher{
      Normal({32, o.in_features}, o.seed, kTeacherStream1, 1.5f / std::sqrt(float(o.in_features))),
      Normal({o.out_features, 32}, o.seed, kTeacherStream2, 1.0f / std::sqrt(32.0f))};
  const HostTensor eval_x = Normal({256, o.in_features}, o.seed, kEvalStream, 1.0f);
  const HostTensor eval_y = teacher(eval_x);

  DemoResult result;
  result.module_ids = model.module_ids();
  result.module_servers = model.module_servers();
  auto before = model.Forward(eval_x, /*training=*/false);
  if (!before.ok()) return before.status();
  result.initial_loss = MeanSquaredError(*before, eval_y);

  ProgressBar bar(progress ? progress : stderr, o.steps, "training");
  const auto start = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < o.steps; ++step) {
    const HostTensor x =
        Normal({o.batch, o.in_features}, o.seed, kTrainStreamBase + uint64_t(step), 1.0f);
    const HostTensor target = teacher(x);
    auto y = model.Forward(x, /*training=*/true);
    if (!y.ok()) return y.status();
    const double loss = MeanSquaredError(*y, target);
    // d(mean (y - t)^2)/dy = 2 (y - t) / numel
    HostTensor dy = HostTensor::Zeros(y->shape);
    const float k = 2.0f / float(dy.numel());
    for (size_t i = 0; i < dy.data.size(); ++i) dy.data[i] = k * (y->data[i] - target.data[i]);
    if (auto s = model.Backward(dy); !s.ok()) return s;
    if (auto s = model.Step(o.learning_rate); !s.ok()) return s;
    if (progress) bar.Update(step + 1, absl::StrFormat("loss %.5f", loss));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.steps = o.steps;
  result.steps_per_s = double(o.steps) / seconds;
  auto after = model.Forward(eval_x, /*training=*/false);
  if (!after.ok()) return after.status();
  result.final_loss = MeanSquaredError(*after, eval_y);
  if (progress) {
    bar.Finish(
        absl::StrFormat("held-out loss %.5f -> %.5f", result.initial_loss, result.final_loss));
  }
  return result;
}

absl::StatusOr<DemoResult> RunDemo(client::Cluster& cluster, const DemoOptions& options,
                                   std::FILE* progress) {
  auto model = MakeRemoteModel(cluster, options);
  if (!model.ok()) return model.status();
  return Train(**model, options, progress);
}

}  // namespace gradwire::cli
