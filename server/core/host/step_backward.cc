// StepRunner::Backward: one path for a backward alone and for a batch of backwards
// (step_runner.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
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

// The backwards of one call to StepRunner::Backward.
class StepRunner::BackwardRun {
 public:
  using Result = absl::StatusOr<std::optional<wire::EncodedTensor>>;
  BackwardRun(StepRunner& runner, const std::vector<std::string>& context_ids,
              const std::vector<const WireBackwardRequest*>& reqs, std::vector<Result>& results)
      : runner_(runner), ids_(context_ids), reqs_(reqs), results_(results) {}

  // Runs the requests `which` (indices, in order): the longest run of them that can share a call
  // as one group, then every other as a group of one, in order. A request that fails a check gets
  // its answer at once (it changes nothing wherever it runs). `ran` gets what ran as a group of
  // several.
  void Run(const std::vector<size_t>& which, BatchRan* ran);

 private:
  struct Member {
    size_t index = 0;
    ContextStore::Lease lease;
    at::Tensor grad_output, grad_layernorm_output;  // on the device, 2-D
    // grad_output's codes as they came, when they are its kind's grad_output cast
    // (ModuleKindOps::Fp8GradOutputRole, device::CodesServeGradient); `grad_output` decodes them.
    bool codes = false;
    Fp8Tensor grad_codes;
    at::Tensor sums;        // grad_output_column_sums as float32 [1, out_features]; undefined: none
    bool done = false;      // its context was finished (consumed, or given back and answered)
    bool consumed = false;  // ran in the group
    std::optional<wire::EncodedTensor> grad_input;  // its rows of the group's, encoded
  };

  // Hands a leased context back untouched (every refusal does).
  void GiveBack(Member& one) {
    if (one.done) return;
    one.done = true;
    one.lease.saved.reset();
    runner_.contexts_.Finish(ids_[one.index], /*consumed=*/false, reqs_[one.index]->retain);
  }
  // A member's refusal: its context back untouched, its answer `status`.
  void Refuse(Member& one, absl::Status status) {
    GiveBack(one);
    results_[one.index] = std::move(status);
  }
  // The request's checks against its context, in the order a backward alone meets them: the
  // gradients' shapes against the forward's.
  absl::Status Check(const Module& m, const Member& one) const;
  // The group `members` (one module's, locked by the caller) as one kind call; returns how many
  // members, from the first, ran and committed. A group of one always gets its answer. In a group
  // of several, anything that fails before a gradient is committed changes nothing and returns
  // 0; a non-finite value at member j returns j, after the members before it were committed.
  size_t RunGroup(Module& m, std::vector<Member>& members, bool skip, bool with_ln);

  StepRunner& runner_;
  const std::vector<std::string>& ids_;
  const std::vector<const WireBackwardRequest*>& reqs_;
  std::vector<Result>& results_;
};

absl::Status StepRunner::BackwardRun::Check(const Module& m, const Member& one) const {
  const WireBackwardRequest& req = *reqs_[one.index];
  const std::vector<int64_t>& input_shape = one.lease.saved->input_shape;
  std::vector<int64_t> expected = input_shape;
  expected.back() = m.spec.out_features;
  GW_RETURN_IF_ERROR(CheckViewExactShape("grad_output", req.grad_output, expected));
  if (req.grad_layernorm_output.data != nullptr) {
    if (!m.spec.return_layernorm_output) {
      return absl::InvalidArgumentError(
          "grad_layernorm_output is only for modules created with return_layernorm_output");
    }
    GW_RETURN_IF_ERROR(
        CheckViewExactShape("grad_layernorm_output", req.grad_layernorm_output, input_shape));
  }
  if (const size_t sums = req.grad_output_column_sums.size(); sums > 0) {
    if (!wire::IsFp8(req.grad_output.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("grad_output_column_sums comes only with an FP8 grad_output; this one is ",
                       wire::DTypeName(req.grad_output.dtype), ", whose columns the server sums"));
    }
    if (!m.spec.bias) {
      return absl::InvalidArgumentError(
          "grad_output_column_sums is a bias gradient, and this module has no bias");
    }
    if (int64_t(sums) != m.spec.out_features) {
      return absl::InvalidArgumentError(absl::StrCat("grad_output_column_sums holds ", sums,
                                                     " values; the module's ", "out_features is ",
                                                     m.spec.out_features));
    }
    for (size_t i = 0; i < sums; ++i) {
      if (!std::isfinite(req.grad_output_column_sums[i])) {
        return absl::InvalidArgumentError(absl::StrCat("grad_output_column_sums[", i,
                                                       "] must be finite, got ",
                                                       req.grad_output_column_sums[i]));
      }
    }
  }
  return absl::OkStatus();
}

void StepRunner::BackwardRun::Run(const std::vector<size_t>& which, BatchRan* ran) {
  const Backend& b = runner_.backend_;
  ContextStore& contexts = runner_.contexts_;
  const bool single = which.size() == 1;
  // Requests that run alone once the group is done, in order: every request from the first one
  // that could change something but cannot join (so the sequence's order holds), and the members
  // a group of several sends back.
  std::vector<size_t> alone;
  std::vector<Member> members;
  ModulePtr m;
  // The group's, from its first member.
  bool skip = false, with_ln = false, with_sums = false;
  size_t committed = 0;  // members[0, committed) ran in the group
  try {
    for (size_t pos = 0; pos < which.size(); ++pos) {
      const size_t i = which[pos];
      const WireBackwardRequest& req = *reqs_[i];
      const bool has_ln = req.grad_layernorm_output.data != nullptr;
      auto rest = [&] {
        alone.insert(alone.end(), which.begin() + std::ptrdiff_t(pos), which.end());
      };
      if (req.grad_output.shape.empty() || req.grad_output.numel() == 0) {
        results_[i] = absl::InvalidArgumentError("grad_output is required");
        continue;
      }
      const bool has_sums = !req.grad_output_column_sums.empty();
      if (!members.empty() &&
          (req.skip_grad_input != skip || has_ln != with_ln || has_sums != with_sums)) {
        rest();  // the group ends
        break;
      }
      absl::StatusOr<ContextStore::Lease> lease = contexts.Acquire(ids_[i]);
      if (!lease.ok()) {
        // Unknown or gone for good: refused wherever it runs. Live but not available now (its
        // backward running, no room to restore it): the group ends before it, and it tries
        // again alone.
        if (single || contexts.Locate(ids_[i]) == ContextStore::Residence::kNone) {
          results_[i] = lease.status();
          continue;
        }
        rest();
        break;
      }
      members.emplace_back();
      Member& one = members.back();
      one.index = i;
      one.lease = *std::move(lease);
      ModulePtr mine = m;
      if (!mine) {
        absl::StatusOr<ModulePtr> found = runner_.modules_.Find(one.lease.module_id);
        if (!found.ok()) {  // its module is gone: refused wherever it runs
          Refuse(one, found.status());
          members.pop_back();
          continue;
        }
        mine = *std::move(found);
      } else if (one.lease.module_id != members[0].lease.module_id) {
        // Another module's context: the group ends before it.
        GiveBack(one);
        members.pop_back();
        rest();
        break;
      }
      if (absl::Status s = Check(*mine, one); !s.ok()) {
        Refuse(one, std::move(s));
        members.pop_back();
        continue;
      }
      // FP8 grad_output reaches the kind as its codes when they are what its grad_output cast
      // would make (Fp8GradOutputRole, CodesServeGradient); a group's members all come so or
      // all not (a group of one decides).
      const std::optional<size_t> grad_role = mine->kind->Fp8GradOutputRole();
      one.codes =
          grad_role.has_value() &&
          device::CodesServeGradient(req.grad_output,
                                     RoleQuantizer(mine->spec, mine->kind->Roles().at(*grad_role)));
      if (members.size() > 1 && one.codes != members[0].codes) {
        GiveBack(one);
        members.pop_back();
        rest();
        break;
      }
      // The gradients cross to the device in their wire dtype. A bf16 grad_output stays bf16 for
      // a kind whose backward only casts it and sums its columns (UsesBf16GradOutput).
      auto decode = [&](const wire::TensorView& v, bool keep_bf16, Fp8Tensor* codes) {
        const int64_t cols = std::max<int64_t>(1, v.shape.back());
        const at::Tensor host =
            keep_bf16 ? b.FromWireBf16(v, v.numel() / cols, cols)
                      : b.FromWire(v, v.numel() / cols, cols, codes, {true, codes != nullptr});
        return b.ToDevice(As2D(host.reshape(v.shape)));
      };
      one.grad_output =
          decode(req.grad_output,
                 req.grad_output.dtype == wire::DType::kBF16 && mine->kind->UsesBf16GradOutput(),
                 one.codes ? &one.grad_codes : nullptr);
      if (has_ln) one.grad_layernorm_output = decode(req.grad_layernorm_output, false, nullptr);
      if (has_sums) {
        const std::vector<float>& sums = req.grad_output_column_sums;
        at::Tensor host = at::empty({1, int64_t(sums.size())}, at::TensorOptions(at::kFloat));
        std::copy(sums.begin(), sums.end(), host.data_ptr<float>());
        one.sums = b.ToDevice(host);
      }
      if (members.size() == 1) {
        m = mine;
        skip = req.skip_grad_input;
        with_ln = has_ln;
        with_sums = has_sums;
      }
    }
    if (!members.empty()) {
      runner_.compute_calls_.fetch_add(int64_t(members.size()), std::memory_order_relaxed);
      {
        std::lock_guard<std::mutex> lock(m->mu);
        // A context past the module's staleness bound is refused (it changes nothing).
        for (size_t j = 0; j < members.size();) {
          const uint64_t made = members[j].lease.weight_version;
          if (m->spec.max_staleness >= 0 &&
              m->weights.version - made > uint64_t(m->spec.max_staleness)) {
            Refuse(members[j],
                   absl::FailedPreconditionError(absl::StrCat(
                       "context_id ", ids_[members[j].index], " was made under weight version ",
                       made, "; the module is at version ", m->weights.version,
                       " and allows max_staleness ", m->spec.max_staleness)));
            members.erase(members.begin() + std::ptrdiff_t(j));
          } else {
            ++j;
          }
        }
        if (!members.empty()) committed = RunGroup(*m, members, skip, with_ln);
      }
      // The members not run in the group go back untouched and run alone after it, in order;
      // they count themselves there.
      int64_t sent = 0;
      for (size_t j = committed; j < members.size(); ++j) {
        if (!members[j].done) {
          GiveBack(members[j]);
          alone.push_back(members[j].index);
          ++sent;
        }
      }
      runner_.compute_calls_.fetch_sub(sent, std::memory_order_relaxed);
    }
  } catch (...) {
    // Every lease not consumed goes back, whatever happened.
    for (Member& one : members) {
      if (!one.consumed) {
        GiveBack(one);
      } else if (!one.done) {
        one.done = true;
        one.lease.saved.reset();
        contexts.Finish(ids_[one.index], /*consumed=*/true, reqs_[one.index]->retain);
      }
    }
    throw;
  }
  if (committed > 0 && members.size() > 1) {
    runner_.batched_backwards_.fetch_add(int64_t(committed), std::memory_order_relaxed);
    if (ran != nullptr) {
      ran->requests = int64_t(committed);
      for (size_t j = 0; j < committed; ++j) ran->rows += members[j].grad_output.size(0);
    }
  }
  // Every consumed context is finished (its saved tensors freed) before the caller answers; its
  // grad_input was encoded before the group's checks.
  for (size_t j = 0; j < committed; ++j) {
    Member& one = members[j];
    one.lease.saved.reset();
    one.done = true;
    contexts.Finish(ids_[one.index], /*consumed=*/true, reqs_[one.index]->retain);
    results_[one.index] = Result(std::move(one.grad_input));
  }
  if (committed > 0) runner_.modules_.Renew(*m);  // a backward that succeeded renews its module
  std::sort(alone.begin(), alone.end());
  for (size_t i : alone) {
    try {
      Run({i}, nullptr);
    } catch (const std::exception& e) {
      results_[i] = absl::InternalError(absl::StrCat("Backward failed: ", e.what()));
    }
  }
}

size_t StepRunner::BackwardRun::RunGroup(Module& m, std::vector<Member>& members, bool skip,
                                         bool with_ln) {
  const Backend& b = runner_.backend_;
  const size_t n = members.size();
  const bool alone = n == 1;
  // A failure before anything is committed: a group of one is refused with `status` (its
  // context kept); a group of several runs again alone.
  auto fall_back = [&](absl::Status status) -> size_t {
    if (alone) Refuse(members[0], std::move(status));
    return 0;
  };
  auto failed = [](const std::exception& e) {
    return absl::InternalError(absl::StrCat("backward failed: ", e.what()));
  };
  auto groups = std::make_shared<std::vector<int64_t>>();
  for (const Member& one : members) groups->push_back(one.grad_output.size(0));
  // The kind hands its parameter gradients to `grads`, which adds them to the accumulators only
  // after everything below has checked out: a refused backward changes nothing.
  DeferredGradients grads(b);
  const std::vector<RoleDef>& roles = m.kind->Roles();
  std::vector<std::shared_ptr<RoleSteps>> steps(roles.size());
  KindBackwardArgs args;
  std::shared_ptr<SavedTensors> stacked;
  Fp8Tensor grad_codes;  // the members' grad_output codes, stacked (args.grad_output_fp8)
  // A lone request's float32 grad_input, written by a Linear's dgrad GEMM into its response's
  // bytes; declared before the result that views them.
  WireDestination into;
  absl::StatusOr<KindBackwardResult> r = absl::InternalError("not run");
  try {
    args.backend = &b;
    args.spec = &m.spec;
    args.grads = &grads;
    args.quantizers = m.Quantizers();
    args.compute_grad_input = !skip;
    if (members[0].codes) {
      std::vector<Fp8Tensor> parts;
      for (Member& one : members) parts.push_back(one.grad_codes);
      grad_codes = alone ? std::move(parts[0]) : StackRows(std::move(parts));
      args.grad_output_fp8 = &grad_codes;
    }
    if (members[0].sums.defined()) {
      std::vector<at::Tensor> sums;
      for (const Member& one : members) sums.push_back(one.sums);
      args.grad_output_sums = alone ? sums[0] : at::cat(sums, 0);
    }
    if (alone) {
      args.grad_output = members[0].grad_output;
      args.grad_layernorm_output = members[0].grad_layernorm_output;
      args.saved = members[0].lease.saved.get();
      if (!skip && m.kind->DgradIsGradInput() &&
          reqs_[members[0].index]->grad_input_dtype == wire::DType::kF32) {
        into.Prepare(b, members[0].grad_output.size(0), m.spec.in_features);
        args.grad_input_into = into.view();
      }
    } else {
      // One saved state stacking the members' by rows; null when they cannot run together (a
      // checkpointed context recomputes its forward with its own casts).
      std::vector<const SavedTensors*> parts;
      std::vector<at::Tensor> grads_out, grads_ln;
      for (const Member& one : members) {
        parts.push_back(one.lease.saved.get());
        grads_out.push_back(b.Widen(one.grad_output));
        if (with_ln) grads_ln.push_back(one.grad_layernorm_output);
      }
      stacked = m.kind->StackSaved(parts);
      if (!stacked) return 0;
      args.grad_output = at::cat(grads_out, 0);
      if (with_ln) args.grad_layernorm_output = at::cat(grads_ln, 0);
      args.saved = stacked.get();
      args.row_groups = groups;
      steps = BatchQuantizers(roles, *m.steps.scaling, m.spec.recipe.mode == ScalingMode::kDelayed,
                              /*training=*/true, groups, args.quantizers);
    }
    m.SyncDevice();
    r = m.kind->Backward(args);
  } catch (const std::exception& e) {
    // A device or library error: nothing was accumulated (the gradients are still only
    // collected) and every context stays as it was.
    return fall_back(failed(e));
  }
  if (!r.ok()) return fall_back(r.status());
  // Each request's step: the amax of each gradient cast of its rows, in the kind's order.
  for (const auto& [role, cast] : r->amaxes) {
    const RoleSteps* st = steps.at(role).get();
    if (!alone && (st == nullptr || st->steps() != n)) return 0;
  }
  const at::Tensor& grad_input = r->grad_input;
  auto rows_of = [&](const at::Tensor& t, size_t j, int64_t at) {
    return alone ? t : t.narrow(0, at, (*groups)[j]);
  };
  const bool bounded = static_cast<bool>(r->grad_input_bound);
  // Each request's grad_input check where no bound covers it, queued now for them all: the
  // first read below waits once for every one of them. Then each request's grad_input is
  // encoded, before anything below reads a value back: on a GPU the first copy back is the
  // call's only wait besides the other results' copies, and brings every check and amax read
  // below with it. Nothing has changed yet; the members that do not commit drop their bytes.
  std::vector<CastScalars> grad_input_amax(n, CastScalars(1.0f, 1.0f, 0.0f));
  std::vector<std::optional<wire::EncodedTensor>> encoded(n);
  try {
    if (grad_input.defined()) {
      int64_t at = 0;
      for (size_t j = 0; j < n; ++j) {
        if (!bounded) grad_input_amax[j] = b.AbsMaxLater(rows_of(grad_input, j, at));
        at += (*groups)[j];
      }
      at = 0;
      for (size_t j = 0; j < n; ++j) {
        // FP8 under a block-scaled recipe: its gradients' row blocks (1 x 128, 1 x 32). The bytes
        // the GEMM wrote move on whole, and grad_input keeps viewing them where they go.
        if (alone && into.Holds(grad_input)) {
          encoded[j] = into.Take(members[j].lease.saved->input_shape);
          runner_.results_in_place_.fetch_add(1, std::memory_order_relaxed);
        } else {
          encoded[j] =
              b.ToWireScaled(rows_of(grad_input, j, at), reqs_[members[j].index]->grad_input_dtype,
                             members[j].lease.saved->input_shape,
                             {device::ActivationBlockLength(m.spec.recipe.mode), false});
        }
        at += (*groups)[j];
      }
    }
  } catch (const std::exception& e) {
    return fall_back(failed(e));
  }
  // A non-finite value anywhere comes from the request (a NaN or inf in a gradient sent) or from
  // fp32 overflow of finite values. Alone, the scan that tells which runs then, and the request
  // is refused with its context kept; in a group, the member and those after it run alone.
  auto refuse = [&](const std::string& what) -> size_t {
    Member& one = members[0];
    if (absl::Status s = CheckFinite("grad_output", args.grad_output); !s.ok()) {
      Refuse(one, s);
      return 0;
    }
    if (args.grad_layernorm_output.defined()) {
      if (absl::Status s = CheckFinite("grad_layernorm_output", args.grad_layernorm_output);
          !s.ok()) {
        Refuse(one, s);
        return 0;
      }
    }
    Refuse(one, absl::OutOfRangeError(absl::StrCat(
                    "the ", what,
                    " of this backward came out non-finite (fp32 overflow); nothing was "
                    "accumulated, the scaling state is unchanged and context_id ",
                    ids_[one.index], " is kept: scale grad_output down and retry, or release it")));
    return 0;
  };
  int64_t row = 0;
  for (size_t j = 0; j < n; ++j) {
    Member& one = members[j];
    // The casts' amaxes: the gradients as they were cast (grad_output first).
    std::vector<RoleAmax> step;
    for (const auto& [role, cast] : r->amaxes) {
      const float a = alone ? cast.amax() : steps[role]->amax(j);
      if (!std::isfinite(a)) return alone ? refuse(roles.at(role).name) : j;
      step.emplace_back(role, a);
    }
    if (grad_input.defined()) {
      bool finite = true;
      try {
        // A bound that does not prove it finite (rare: values near fp32's range) is measured.
        finite = bounded ? ProvablyFinite(r->grad_input_bound()) ||
                               std::isfinite(b.AbsMax(rows_of(grad_input, j, row)))
                         : std::isfinite(grad_input_amax[j].amax());
      } catch (const std::exception& e) {
        if (alone) return fall_back(failed(e));
        return j;
      }
      if (!finite) return alone ? refuse("grad_input") : j;
    }
    std::optional<Param> overflowed;
    try {
      overflowed = grads.Commit([&](Param id) { return m.gradients.Accumulator(id); }, j);
      // The step's roll runs on the device and can fail as the sums can: with them.
      if (!overflowed.has_value()) m.steps.EndStep(step);
    } catch (const std::exception& e) {
      // Only a device or library failure gets here (a refused sum returns, changing nothing);
      // the accumulators may then hold part of this request's sums, so they are zeroed. It
      // fails with its context kept, and the rest run alone.
      m.gradients.ZeroAll();
      Refuse(one,
             absl::InternalError(absl::StrCat(
                 "backward failed while accumulating gradients (they were reset): ", e.what())));
      return j;
    }
    if (overflowed.has_value()) {
      if (!alone) return j;
      return refuse(absl::StrCat("accumulated ", ParamName(*overflowed), " gradient"));
    }
    ++m.gradients.accumulated_backwards;
    one.consumed = true;
    one.grad_input = std::move(encoded[j]);
    row += (*groups)[j];
  }
  return n;
}

std::vector<absl::StatusOr<std::optional<wire::EncodedTensor>>> StepRunner::Backward(
    const std::vector<std::string>& context_ids,
    const std::vector<const WireBackwardRequest*>& reqs, BatchRan* ran) {
  using Result = absl::StatusOr<std::optional<wire::EncodedTensor>>;
  if (ran != nullptr) *ran = BatchRan{};
  if (context_ids.size() != reqs.size()) {
    return std::vector<Result>(
        std::max(context_ids.size(), reqs.size()),
        absl::InternalError("Backward: as many context ids as requests are needed"));
  }
  std::vector<Result> results(reqs.size(), absl::InternalError("Backward: request not run"));
  std::vector<size_t> all(reqs.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  BackwardRun(*this, context_ids, reqs, results).Run(all, ran);
  return results;
}

}  // namespace gradwire::core
