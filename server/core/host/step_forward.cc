// StepRunner::Forward: one path for a forward alone and for a batch of forwards (step_runner.h).
#include <ATen/ATen.h>

#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/common/status_macros.h"
#include "server/core/host/batch_scaling.h"
#include "server/core/host/module.h"
#include "server/core/host/module_registry.h"
#include "server/core/host/step_runner.h"
#include "server/core/host/wire_destination.h"

namespace gradwire::core {

// The forwards of one call to StepRunner::Forward: Run computes a group of its requests as one
// kind call and writes their results.
class StepRunner::ForwardRun {
 public:
  using Result = absl::StatusOr<WireForwardOutput>;
  ForwardRun(StepRunner& runner, const std::string& module_id, ModulePtr m,
             const std::vector<const WireForwardRequest*>& reqs, std::vector<Result>& results)
      : runner_(runner), module_id_(module_id), m_(std::move(m)), reqs_(reqs), results_(results) {
    codes_.reserve(reqs_.size());
    for (const WireForwardRequest* r : reqs_) {
      codes_.push_back(m_->kind->UsesFp8Input() &&
                       device::CodesServeInput(r->input, m_->spec.recipe.mode, r->training));
    }
  }

  // FP8 input reaches the kind as its codes when it UsesFp8Input and they are what its input
  // cast would make under the module's recipe (CodesServeInput); other FP8 input is decoded and
  // cast. bf16 input stays bf16 for a kind whose casts read it; anything else arrives as fp32.
  bool Codes(size_t i) const { return codes_[i] != 0; }
  bool Bf16(size_t i) const {
    return reqs_[i]->input.dtype == wire::DType::kBF16 && m_->kind->UsesBf16Input();
  }

  // Runs `members` (well-formed requests, indices into reqs, all training or all inference and
  // reaching the kind the same way) as one kind call over their stacked rows. A group of one
  // always gets its answer. A group of several that cannot run together (a refusal, an
  // exception while its outputs are encoded, a non-finite value, a context over the budget)
  // changes nothing, writes no result and returns false: its requests then run alone, and each
  // meets the answer there.
  bool Run(const std::vector<size_t>& members);

 private:
  StepRunner& runner_;
  const std::string& module_id_;
  const ModulePtr m_;
  const std::vector<const WireForwardRequest*>& reqs_;
  std::vector<Result>& results_;
  std::vector<char> codes_;  // Codes(i), per request
};

bool StepRunner::ForwardRun::Run(const std::vector<size_t>& members) {
  const Backend& b = runner_.backend_;
  ContextStore& contexts = runner_.contexts_;
  Module& m = *m_;
  const size_t n = members.size();
  const bool alone = n == 1;
  const int64_t k = m.spec.in_features;
  const bool training = reqs_[members[0]]->training;
  const bool codes = Codes(members[0]);
  const bool bf16 = Bf16(members[0]);
  // The inputs, on the device, stacked by rows.
  auto groups = std::make_shared<std::vector<int64_t>>();
  std::vector<at::Tensor> inputs;
  std::vector<Fp8Tensor> parts;
  for (size_t i : members) {
    const wire::TensorView& v = reqs_[i]->input;
    groups->push_back(v.numel() / k);
    Fp8Tensor part;
    inputs.push_back(b.ToDevice(
        bf16 ? b.FromWireBf16(v, groups->back(), k)
             : b.FromWire(v, groups->back(), k, codes ? &part : nullptr, {true, training})));
    if (codes) parts.push_back(std::move(part));
  }
  const at::Tensor x = alone ? inputs[0] : at::cat(inputs, 0);
  inputs.clear();
  Fp8Tensor input_codes;
  if (codes) input_codes = alone ? std::move(parts[0]) : StackRows(std::move(parts));
  runner_.compute_calls_.fetch_add(int64_t(n), std::memory_order_relaxed);
  // A group of several that cannot run together takes back its count: its requests count
  // themselves alone.
  auto apart = [&] {
    runner_.compute_calls_.fetch_sub(int64_t(n), std::memory_order_relaxed);
    return false;
  };
  std::vector<WireForwardOutput> encoded(n);
  std::vector<std::string> context_ids(n);
  std::vector<absl::Status> put(n);
  uint64_t version = 0;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.SyncDevice();
    KindForwardArgs args;
    args.backend = &b;
    args.spec = &m.spec;
    args.input = x;
    args.input_fp8 = codes ? &input_codes : nullptr;
    // bf16 from the GEMM when every request's response is bf16 (else each narrows its own):
    // FpropBf16 gives the bits ToWire would round the fp32 output to.
    args.bf16_output = true;
    for (size_t i : members) {
      args.bf16_output = args.bf16_output && reqs_[i]->output_dtype == wire::DType::kBF16;
    }
    args.params = m.weights.DeviceTable();
    args.quantizers = m.Quantizers();
    const std::vector<RoleDef>& roles = m.kind->Roles();
    // A group of several: each request's casts are its own, stepped in order on a copy of the
    // scaling state.
    std::vector<std::shared_ptr<RoleSteps>> steps(roles.size());
    if (!alone) {
      steps = BatchQuantizers(roles, *m.steps.scaling, m.spec.recipe.mode == ScalingMode::kDelayed,
                              training, groups, args.quantizers);
    }
    args.weight_version = m.weights.version;
    args.workspace = m.steps.workspace;
    args.training = training;
    // A lone request's float32 output is written by the GEMM into its response's bytes.
    WireDestination into;
    if (alone && !args.bf16_output && reqs_[members[0]]->output_dtype == wire::DType::kF32) {
      into.Prepare(b, x.size(0), m.spec.out_features);
      args.output_into = into.view();
    }
    absl::StatusOr<KindForwardResult> done = m.kind->Forward(args);
    if (!done.ok()) {
      if (!alone) return apart();
      results_[members[0]] = done.status();
      return true;
    }
    KindForwardResult& r = *done;
    // Each request's outputs are encoded as soon as they are queued, before anything below reads
    // a value back: on a GPU the first copy back is then the call's only wait besides the other
    // results' copies, and brings every amax read below with it. Nothing has changed yet: a
    // refusal below drops these bytes.
    // FP8 results of a block-scaled recipe carry its activations' row blocks (1 x 128, 1 x 32).
    const wire::Fp8Scaling wire_scaling{device::ActivationBlockLength(m.spec.recipe.mode), false};
    try {
      int64_t row = 0;
      for (size_t j = 0; j < n; ++j) {
        const WireForwardRequest& req = *reqs_[members[j]];
        const int64_t rows = (*groups)[j];
        WireForwardOutput& out = encoded[j];
        std::vector<int64_t> out_shape = req.input.shape;
        out_shape.back() = m.spec.out_features;
        if (alone && into.Holds(r.output)) {
          out.output = into.Take(std::move(out_shape));
          runner_.results_in_place_.fetch_add(1, std::memory_order_relaxed);
          r.output = at::Tensor();  // it viewed those bytes
        } else {
          out.output = b.ToWireScaled(alone ? r.output : r.output.narrow(0, row, rows),
                                      req.output_dtype, std::move(out_shape), wire_scaling);
        }
        if (r.layernorm_output.defined()) {
          out.layernorm_output =
              b.ToWireScaled(alone ? r.layernorm_output : r.layernorm_output.narrow(0, row, rows),
                             req.output_dtype, req.input.shape, wire_scaling);
          out.has_layernorm_output = true;
        }
        row += rows;
      }
    } catch (const std::exception&) {
      if (alone) throw;  // nothing has changed
      return apart();
    }
    // A NaN or inf would stick in the amax history and, through the backward, in the shared
    // gradient buffers: it is refused before it touches any state. The casts measured every
    // activation's amax on the way (a cast's amax is NaN or inf exactly when its input holds
    // one), so the input is only scanned, for the message, when one of them is not finite.
    // Per request and role, the amax its step records: a cast's own, a weight's for every one.
    std::vector<std::vector<RoleAmax>> step_amaxes(n);
    for (const auto& [role, cast] : r.amaxes) {
      const float amax = cast.amax();
      if (!roles.at(role).weight && !std::isfinite(amax)) {
        if (!alone) return apart();
        absl::Status scan = CheckFinite("input", x);
        results_[members[0]] =
            !scan.ok() ? scan
                       : absl::OutOfRangeError(absl::StrCat(
                             "the ", roles[role].name,
                             " of this forward came out non-finite (fp32 overflow) from a "
                             "finite input; nothing was changed: scale the input down"));
        return true;
      }
      const RoleSteps* st = steps.at(role).get();
      // Not one cast per request: the steps would not be the sequence's.
      if (st && st->steps() != n) return apart();
      if (!training) continue;
      for (size_t j = 0; j < n; ++j) step_amaxes[j].emplace_back(role, st ? st->amax(j) : amax);
    }
    // Each training request's saved state must fit the context budget.
    std::vector<std::shared_ptr<SavedTensors>> saved;
    if (training) {
      if (alone) {
        saved.push_back(std::move(r.saved));
      } else {
        saved = std::move(r.saved_groups);
        if (saved.size() != n) return apart();
      }
      for (size_t j = 0; j < n; ++j) {
        if (alone) {
          if (absl::Status s = contexts.CheckFits(saved[j]->bytes()); !s.ok()) {
            results_[members[0]] = s;
            return true;
          }
        } else if (!contexts.Fits(saved[j]->bytes())) {
          return apart();
        }
      }
    }
    // The call runs: the scaling steps (inference leaves the scaling state alone: evaluation
    // traffic must not move training scales), the workspace, the contexts.
    for (size_t j = 0; training && j < n; ++j) m.steps.EndStep(step_amaxes[j]);
    if (r.workspace_built) runner_.workspace_builds_.fetch_add(1);
    runner_.workspace_hits_.fetch_add(int64_t(n) - (r.workspace_built ? 1 : 0));
    m.steps.workspace = std::move(r.workspace);
    version = m.weights.version;
    try {
      for (size_t j = 0; training && j < n; ++j) {
        const WireForwardRequest& req = *reqs_[members[j]];
        saved[j]->input_shape = req.input.shape;
        absl::StatusOr<std::string> id =
            contexts.Put(module_id_, m.weights.version, std::move(saved[j]), m.tenant, req.client,
                         req.context_id);
        if (id.ok()) {
          context_ids[j] = *std::move(id);
        } else {
          put[j] = id.status();
        }
      }
    } catch (...) {
      for (const std::string& id : context_ids) {
        if (!id.empty()) (void)contexts.Release(id);
      }
      throw;
    }
  }
  if (!alone) runner_.batched_forwards_.fetch_add(int64_t(n), std::memory_order_relaxed);
  for (size_t j = 0; j < n; ++j) {
    if (!put[j].ok()) {
      results_[members[j]] = put[j];
      continue;
    }
    WireForwardOutput& out = encoded[j];
    out.context_id = std::move(context_ids[j]);
    out.weight_version = version;
    out.batch_requests = alone ? 0 : int32_t(n);
    results_[members[j]] = std::move(out);
  }
  return true;
}

std::vector<absl::StatusOr<WireForwardOutput>> StepRunner::Forward(
    const std::string& module_id, const std::vector<const WireForwardRequest*>& reqs) {
  std::vector<absl::StatusOr<WireForwardOutput>> results(
      reqs.size(), absl::InternalError("Forward: request not run"));
  absl::StatusOr<ModulePtr> found = modules_.Find(module_id);
  if (!found.ok()) {
    for (auto& r : results) r = found.status();
    return results;
  }
  ForwardRun run(*this, module_id, *found, reqs, results);
  const int64_t k = (*found)->spec.in_features;
  // The well-formed requests; a malformed one gets its own error, which changes nothing.
  std::vector<size_t> members;
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (absl::Status s = CheckViewShape("input", reqs[i]->input, k, "in_features"); !s.ok()) {
      results[i] = s;
    } else {
      members.push_back(i);
    }
  }
  if (members.empty()) return results;
  // Together when they are all training or all inference and reach the kind the same way (FP8
  // codes, bf16 or fp32 values). Otherwise each runs alone, in order.
  const size_t first = members[0];
  const bool training = reqs[first]->training;
  bool together = members.size() > 1;
  for (size_t i : members) {
    together = together && reqs[i]->training == training && run.Codes(i) == run.Codes(first) &&
               run.Bf16(i) == run.Bf16(first);
  }
  if (!together || !run.Run(members)) {
    for (size_t i : members) run.Run({i});
  }
  // A forward that succeeded renews the module's lease; refusals alone renew nothing.
  for (const auto& r : results) {
    if (r.ok()) {
      modules_.Renew(**found);
      break;
    }
  }
  return results;
}

}  // namespace gradwire::core
