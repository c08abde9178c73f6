// Malformed requests against the real service: each named case checks the exact status code and
// the key part of the message, that the server's state is exactly as before (weights, gradients,
// scaling state, versions, modules, live contexts and their bytes), and that a valid forward and
// backward on the same module succeed right after with finite results. A last test repeats every
// case and checks that live contexts and the process's RSS stay flat.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "gradwire/client/client.h"
#include "server/core/tensor_calls.h"
#include "server/rpc/auth.h"
#include "specs.h"
#include "test_server.h"
#include "tests/sanitized.h"

namespace gradwire {
namespace {

using client::HostTensor;
using client::WireDType;
using testing::Random;

constexpr int64_t kIn = 16, kOut = 8, kFfn = 12;
constexpr char kAliceToken[] = "alice-token-0123456789abcdef";
constexpr char kBobToken[] = "bob-token-fedcba9876543210xyz";
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

using gradwire::testing::kSanitized;

int64_t RssKiB() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

v1::Tensor Wire(std::vector<int64_t> shape, WireDType dtype = WireDType::kF32) {
  return client::ToWire(Random(std::move(shape)), dtype);
}

// A valid F32 [2, kIn] input with one element replaced by `value`.
v1::Tensor WireWith(float value, int64_t rows = 2, int64_t cols = kIn,
                    WireDType dtype = WireDType::kF32) {
  HostTensor t = Random({rows, cols});
  t.data[t.data.size() / 2] = value;
  return client::ToWire(t, dtype);
}

// Both servers: `plain` (no tokens) with one module of each kind, `isolated` with tenants alice
// and bob, one module each.
struct Env {
  std::unique_ptr<rpc::Authenticator> auth;
  std::unique_ptr<testing::TestServer> plain, isolated;
  std::unique_ptr<client::Client> c, alice, bob;
  std::map<std::string, std::string> id;  // "lin", "nob", "lnl", "lnr", "mlp", "alice", "bob"

  Env() {
    auto a = rpc::Authenticator::FromEntries({{"alice", kAliceToken}, {"bob", kBobToken}});
    EXPECT_TRUE(a.ok()) << a.status();
    auth = std::make_unique<rpc::Authenticator>(*std::move(a));
    plain = std::make_unique<testing::TestServer>();
    isolated = std::make_unique<testing::TestServer>(auth.get());
    c = plain->Connect();
    alice = isolated->Connect(kAliceToken);
    bob = isolated->Connect(kBobToken);
    v1::ModuleSpec s;
    s.set_in_features(kIn);
    s.set_out_features(kOut);
    s.set_seed(11);
    s.set_bias(true);
    s.mutable_optimizer()->mutable_sgd()->set_learning_rate(0.01f);
    s.set_kind(v1::LINEAR);
    s.mutable_recipe()->set_scaling(v1::DELAYED);  // NaN in an amax history would stick
    s.mutable_recipe()->set_amax_history_len(4);
    id["lin"] = Create(*c, s);
    id["alice"] = Create(*alice, s);
    id["bob"] = Create(*bob, s);
    s.set_bias(false);
    id["nob"] = Create(*c, s);
    s.set_bias(true);
    s.set_kind(v1::LAYERNORM_LINEAR);
    id["lnl"] = Create(*c, s);
    s.set_return_layernorm_output(true);
    id["lnr"] = Create(*c, s);
    s.set_return_layernorm_output(false);
    s.set_kind(v1::LAYERNORM_MLP);
    s.set_ffn_features(kFfn);
    s.set_activation(v1::SWIGLU);
    id["mlp"] = Create(*c, s);
  }
  static std::string Create(client::Client& cl, const v1::ModuleSpec& s) {
    auto info = cl.CreateModule(s);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->module_id() : "";
  }
  client::Client& For(const std::string& module) { return module == "bob" ? *bob : *alice; }
  // A live training context of `module` (rows x kIn input).
  std::string NewContext(const std::string& module, int64_t rows = 2) {
    client::Client& cl = module == "bob" || module == "alice" ? For(module) : *c;
    auto r = cl.Forward(id.at(module), Random({rows, kIn}), true);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->context_id : "";
  }
  grpc::Status Forward(const v1::ForwardRequest& req, client::Client* cl = nullptr) {
    cl = cl ? cl : c.get();
    grpc::ClientContext ctx;
    cl->PrepareContext(&ctx);
    v1::ForwardResponse resp;
    return cl->stub().Forward(&ctx, req, &resp);
  }
  v1::ForwardRequest ForwardReq(const std::string& module, v1::Tensor input) {
    v1::ForwardRequest req;
    req.set_module_id(id.count(module) ? id.at(module) : module);
    *req.mutable_input() = std::move(input);
    req.set_training(true);
    return req;
  }
  grpc::Status Backward(const v1::BackwardRequest& req, client::Client* cl = nullptr) {
    cl = cl ? cl : c.get();
    grpc::ClientContext ctx;
    cl->PrepareContext(&ctx);
    v1::BackwardResponse resp;
    return cl->stub().Backward(&ctx, req, &resp);
  }
  v1::BackwardRequest BackwardReq(const std::string& context, v1::Tensor grad) {
    v1::BackwardRequest req;
    req.set_context_id(context);
    *req.mutable_grad_output() = std::move(grad);
    return req;
  }
  grpc::Status Release(const std::string& context, client::Client* cl = nullptr) {
    cl = cl ? cl : c.get();
    grpc::ClientContext ctx;
    cl->PrepareContext(&ctx);
    v1::ReleaseContextRequest req;
    req.set_context_id(context);
    v1::ReleaseContextResponse resp;
    return cl->stub().ReleaseContext(&ctx, req, &resp);
  }
  grpc::Status CreateRaw(const v1::CreateModuleRequest& req) {
    grpc::ClientContext ctx;
    c->PrepareContext(&ctx);
    v1::CreateModuleResponse resp;
    return c->stub().CreateModule(&ctx, req, &resp);
  }
  grpc::Status CreateSpec(const std::function<void(v1::ModuleSpec*)>& edit) {
    v1::CreateModuleRequest req;
    v1::ModuleSpec* s = req.mutable_spec();
    s->set_kind(v1::LINEAR);
    s->set_in_features(kIn);
    s->set_out_features(kOut);
    edit(s);
    return CreateRaw(req);
  }
  grpc::Status SetWeights(const v1::SetWeightsRequest& req, client::Client* cl = nullptr) {
    cl = cl ? cl : c.get();
    grpc::ClientContext ctx;
    cl->PrepareContext(&ctx);
    v1::SetWeightsResponse resp;
    return cl->stub().SetWeights(&ctx, req, &resp);
  }
  // SetWeights on `module` with (name, tensor) pairs.
  grpc::Status SetWeightsOf(const std::string& module,
                            std::vector<std::pair<std::string, v1::Tensor>> params,
                            client::Client* cl = nullptr) {
    v1::SetWeightsRequest req;
    req.set_module_id(id.count(module) ? id.at(module) : module);
    for (auto& [name, t] : params) {
      v1::NamedTensor* p = req.add_parameters();
      p->set_name(name);
      *p->mutable_tensor() = std::move(t);
    }
    return SetWeights(req, cl);
  }
  grpc::Status ApplyGradients(const std::string& module_id, float lr,
                              client::Client* cl = nullptr) {
    cl = cl ? cl : c.get();
    grpc::ClientContext ctx;
    cl->PrepareContext(&ctx);
    v1::ApplyGradientsRequest req;
    req.set_module_id(module_id);
    req.set_learning_rate(lr);
    v1::ApplyGradientsResponse resp;
    return cl->stub().ApplyGradients(&ctx, req, &resp);
  }
  grpc::Status GetWeights(const std::string& module_id, v1::DType dtype,
                          client::Client* cl = nullptr) {
    cl = cl ? cl : c.get();
    grpc::ClientContext ctx;
    cl->PrepareContext(&ctx);
    v1::GetWeightsRequest req;
    req.set_module_id(module_id);
    req.set_dtype(dtype);
    v1::GetWeightsResponse resp;
    return cl->stub().GetWeights(&ctx, req, &resp);
  }
  grpc::Status GetGradients(const std::string& module_id, v1::DType dtype, bool zero,
                            client::Client* cl = nullptr) {
    cl = cl ? cl : c.get();
    grpc::ClientContext ctx;
    cl->PrepareContext(&ctx);
    v1::GetGradientsRequest req;
    req.set_module_id(module_id);
    req.set_dtype(dtype);
    req.set_zero(zero);
    v1::GetGradientsResponse resp;
    return cl->stub().GetGradients(&ctx, req, &resp);
  }
  grpc::Status Delete(const std::string& module_id, client::Client* cl = nullptr) {
    cl = cl ? cl : c.get();
    grpc::ClientContext ctx;
    cl->PrepareContext(&ctx);
    v1::DeleteModuleRequest req;
    req.set_module_id(module_id);
    v1::DeleteModuleResponse resp;
    return cl->stub().DeleteModule(&ctx, req, &resp);
  }
};

// Everything a bad request must leave alone, on both servers.
struct Snapshot {
  struct Module {
    std::vector<std::pair<std::string, at::Tensor>> weights, grads;
    uint64_t version = 0;
    int64_t steps = 0, accumulated = 0;
    std::vector<core::RoleScaling> scaling;
  };
  std::map<std::string, Module> modules;
  core::HostStats plain, isolated;

  static Snapshot Take(Env& e) {
    Snapshot s;
    for (auto* server : {e.plain.get(), e.isolated.get()}) {
      core::ModuleHost& host = server->host();
      for (const core::ModuleInfo& info : host.List()) {
        Module& m = s.modules[info.module_id];
        m.weights = core::TensorWeights(host, info.module_id)->tensors;
        auto g = core::TensorGradients(host, info.module_id, false);
        m.grads = g->tensors;
        m.accumulated = g->accumulated_backwards;
        m.version = info.weight_version;
        m.steps = info.optimizer_steps;
        m.scaling = *host.Scaling(info.module_id);
      }
    }
    s.plain = e.plain->host().Stats();
    s.isolated = e.isolated->host().Stats();
    return s;
  }

  // Differences from `after`, or "" when there are none.
  std::string Diff(const Snapshot& after) const {
    std::string out;
    auto stats = [&](const char* which, const core::HostStats& a, const core::HostStats& b) {
      if (a.modules != b.modules || a.live_contexts != b.live_contexts ||
          a.context_bytes != b.context_bytes) {
        out += std::string(which) + ": modules " + std::to_string(a.modules) + " -> " +
               std::to_string(b.modules) + ", live contexts " + std::to_string(a.live_contexts) +
               " -> " + std::to_string(b.live_contexts) + ", context bytes " +
               std::to_string(a.context_bytes) + " -> " + std::to_string(b.context_bytes) + "; ";
      }
    };
    stats("plain", plain, after.plain);
    stats("isolated", isolated, after.isolated);
    for (const auto& [id, m] : modules) {
      auto it = after.modules.find(id);
      if (it == after.modules.end()) {
        out += "module " + id + " is gone; ";
        continue;
      }
      const Module& n = it->second;
      if (m.version != n.version || m.steps != n.steps || m.accumulated != n.accumulated) {
        out += "module " + id + " version/steps/accumulated changed; ";
      }
      auto same = [](const auto& a, const auto& b) {
        if (a.size() != b.size()) return false;
        for (size_t i = 0; i < a.size(); ++i) {
          if (a[i].first != b[i].first || !at::equal(a[i].second, b[i].second)) return false;
        }
        return true;
      };
      if (!same(m.weights, n.weights)) out += "module " + id + " weights changed; ";
      if (!same(m.grads, n.grads)) out += "module " + id + " gradients changed; ";
      bool scaling_same = m.scaling.size() == n.scaling.size();
      for (size_t i = 0; scaling_same && i < m.scaling.size(); ++i) {
        const auto &a = m.scaling[i], &b = n.scaling[i];
        scaling_same = a.role == b.role && a.history.size() == b.history.size() &&
                       std::equal(a.history.begin(), a.history.end(), b.history.begin()) &&
                       (a.scale == b.scale || (std::isnan(a.scale) && std::isnan(b.scale)));
      }
      if (!scaling_same) out += "module " + id + " scaling state changed; ";
    }
    return out;
  }
};

enum class Prep { kNone, kContext, kConsumedContext, kReleasedContext, kBobContext };

struct Case {
  const char* name;
  grpc::StatusCode code;
  const char* message;  // a key part of the expected message
  std::string module;   // the module a valid call must still work on afterwards
  Prep setup;
  // Sends the bad request; `context` is the setup's context id (or "").
  std::function<grpc::Status(Env&, const std::string& context)> send;
};

// gtest prints a parameter when its test fails: the case's name says it all.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

using G = grpc::StatusCode;
constexpr G kInvalid = G::INVALID_ARGUMENT;
constexpr G kNotFound = G::NOT_FOUND;

std::vector<Case> Cases() {
  std::vector<Case> c;
  auto fwd = [&](const char* name, G code, const char* msg, std::string module,
                 std::function<v1::ForwardRequest(Env&)> make) {
    c.push_back({name, code, msg, module, Prep::kNone,
                 [make](Env& e, const std::string&) { return e.Forward(make(e)); }});
  };
  auto fwd_input = [&](const char* name, const char* msg, std::string module,
                       std::function<v1::Tensor()> input) {
    fwd(name, kInvalid, msg, module,
        [module, input](Env& e) { return e.ForwardReq(module, input()); });
  };
  // --- Forward: ids and presence.
  fwd("ForwardUnknownModule", kNotFound, "is not a module", "lin", [](Env& e) {
    return e.ForwardReq("00000000000000000000000000000001", Wire({2, kIn}));
  });
  fwd("ForwardEmptyModuleId", kInvalid, "module_id is required", "lin", [](Env& e) {
    return e.ForwardReq("", Wire({2, kIn}));
  });
  fwd("ForwardMissingInput", kInvalid, "input is required", "lin", [](Env& e) {
    v1::ForwardRequest r = e.ForwardReq("lin", {});
    r.clear_input();
    return r;
  });
  // --- Forward: dtype, shape and byte length of the input.
  fwd_input("ForwardDTypeUnspecified", "input.dtype must be one of", "lin", [] {
    v1::Tensor t = Wire({2, kIn});
    t.set_dtype(v1::DTYPE_UNSPECIFIED);
    return t;
  });
  fwd_input("ForwardDTypeOutOfEnum", "got 99", "lin", [] {
    v1::Tensor t = Wire({2, kIn});
    t.set_dtype(static_cast<v1::DType>(99));
    return t;
  });
  fwd_input("ForwardEmptyShape", "input.shape is empty", "lin", [] {
    v1::Tensor t = Wire({2, kIn});
    t.clear_shape();
    return t;
  });
  fwd_input("ForwardZeroDimension", "input.shape[0] must be >= 1, got 0", "lin", [] {
    v1::Tensor t = Wire({2, kIn});
    t.set_shape(0, 0);
    return t;
  });
  fwd_input("ForwardNegativeDimension", "input.shape[1] must be >= 1, got -16", "lin", [] {
    v1::Tensor t = Wire({2, kIn});
    t.set_shape(1, -kIn);
    return t;
  });
  fwd_input("ForwardHugeDimensions", "elements", "lin", [] {
    v1::Tensor t = Wire({2, kIn});
    t.set_shape(0, int64_t(1) << 40);
    t.set_shape(1, int64_t(1) << 40);
    return t;
  });
  fwd_input("ForwardInt64MaxDimension", "elements", "lin", [] {
    v1::Tensor t = Wire({2, kIn});
    t.set_shape(0, std::numeric_limits<int64_t>::max());
    return t;
  });
  fwd_input("ForwardOverflowingProduct", "elements", "lin", [] {
    v1::Tensor t = Wire({2, kIn});  // 2^32 * 2^32 wraps to 0 in 64 bits
    t.clear_shape();
    t.add_shape(int64_t(1) << 32);
    t.add_shape(int64_t(1) << 32);
    t.add_shape(kIn);
    return t;
  });
  fwd_input("ForwardTooFewBytes", "input.data has 127 bytes", "lin", [] {
    v1::Tensor t = Wire({2, kIn});
    t.mutable_data()->pop_back();
    return t;
  });
  fwd_input("ForwardTooManyBytes", "input.data has 132 bytes", "lin", [] {
    v1::Tensor t = Wire({2, kIn});
    t.mutable_data()->append(4, '\x01');
    return t;
  });
  fwd_input("ForwardEmptyData", "input.data has 0 bytes", "lin", [] {
    v1::Tensor t = Wire({2, kIn});
    t.clear_data();
    return t;
  });
  fwd_input("ForwardBf16ByteLengthOfF32", "needs 64", "lin", [] {
    v1::Tensor t = Wire({2, kIn});  // 128 bytes of F32 labelled BF16
    t.set_dtype(v1::BF16);
    return t;
  });
  fwd_input("ForwardWrongLastDimension", "input.shape must be [..., 16]", "lin", [] {
    return Wire({2, kIn - 1});
  });
  fwd_input("ForwardWrongLastDimensionMlp", "input.shape must be [..., 16]", "mlp", [] {
    return Wire({3, kOut});
  });
  // --- Forward: FP8 scale_inv.
  for (auto [name, value] :
       {std::pair{"ForwardFp8ZeroScaleInv", 0.0f}, std::pair{"ForwardFp8NaNScaleInv", kNaN},
        std::pair{"ForwardFp8InfScaleInv", kInf}, std::pair{"ForwardFp8NegativeScaleInv", -0.5f}}) {
    fwd_input(name, "input.scale_inv must be finite and > 0", "lin", [value = value] {
      v1::Tensor t = Wire({2, kIn}, WireDType::kFp8E4M3);
      t.set_scale_inv(value);
      return t;
    });
  }
  // --- Forward: FP8 block scales.
  auto blocked = [](bool columnwise) {
    return client::ToWire(Random({2, kIn}), WireDType::kFp8E4M3, {8, columnwise});
  };
  fwd_input("ForwardBlockScalesBesideScaleInv", "has both scale_inv", "lin", [blocked] {
    v1::Tensor t = blocked(false);
    t.set_scale_inv(1.0f);
    return t;
  });
  fwd_input("ForwardBlockScalesShortGrid", "input.block_scales.scale_inv has 12 bytes", "lin",
            [blocked] {
              v1::Tensor t = blocked(false);
              t.mutable_block_scales()->mutable_scale_inv()->resize(12);
              return t;
            });
  fwd_input("ForwardBlockScalesZeroBlock", "a block is at least 1 x 1", "lin", [blocked] {
    v1::Tensor t = blocked(true);
    t.mutable_columnwise_scales()->set_block_rows(0);
    return t;
  });
  fwd_input("ForwardBlockScalesNaNScale", "input.block_scales.scale_inv[3] must be finite", "lin",
            [blocked] {
              v1::Tensor t = blocked(false);
              const float nan = kNaN;
              t.mutable_block_scales()->mutable_scale_inv()->replace(
                  12, 4, reinterpret_cast<const char*>(&nan), 4);
              return t;
            });
  fwd_input("ForwardBlockScalesOnF32", "only FP8 tensors have scales", "lin", [blocked] {
    v1::Tensor t = Wire({2, kIn});
    *t.mutable_block_scales() = blocked(false).block_scales();
    return t;
  });
  fwd_input("ForwardColumnwiseWithoutItsCodes", "input.data has 32 bytes", "lin", [blocked] {
    v1::Tensor t = blocked(true);
    t.mutable_data()->resize(2 * kIn);
    return t;
  });
  fwd_input("ForwardBlockScaledNaNCode", "input must be finite", "lin", [blocked] {
    v1::Tensor t = blocked(false);
    (*t.mutable_data())[5] = '\x7f';  // E4M3's NaN
    return t;
  });
  fwd("ForwardBadOutputDType", kInvalid, "output_dtype must be", "lin", [](Env& e) {
    v1::ForwardRequest r = e.ForwardReq("lin", Wire({2, kIn}));
    r.set_output_dtype(static_cast<v1::DType>(77));
    return r;
  });
  // --- Forward: non-finite activations.
  fwd_input("ForwardNaNActivation", "input must be finite", "lin", [] { return WireWith(kNaN); });
  fwd_input("ForwardInfActivation", "input must be finite", "lin", [] { return WireWith(kInf); });
  fwd_input("ForwardNaNActivationBf16", "input must be finite", "lnl",
            [] { return WireWith(kNaN, 2, kIn, WireDType::kBF16); });
  fwd_input("ForwardNegInfActivationMlp", "input must be finite", "mlp",
            [] { return WireWith(-kInf, 3); });
  // --- Backward.
  auto bwd = [&](const char* name, G code, const char* msg, std::string module, Prep setup,
                 std::function<v1::BackwardRequest(Env&, const std::string&)> make) {
    c.push_back({name, code, msg, module, setup,
                 [make](Env& e, const std::string& ctx) { return e.Backward(make(e, ctx)); }});
  };
  bwd("BackwardUnknownContext", kNotFound, "is not a live context", "lin", Prep::kNone,
      [](Env& e, const std::string&) {
        return e.BackwardReq("00000000000000000000000000000002", Wire({2, kOut}));
      });
  bwd("BackwardEmptyContextId", kInvalid, "context_id is required", "lin", Prep::kNone,
      [](Env& e, const std::string&) {
        return e.BackwardReq("", Wire({2, kOut}));
      });
  bwd("BackwardMissingGradOutput", kInvalid, "grad_output is required", "lin", Prep::kContext,
      [](Env& e, const std::string& ctx) {
        v1::BackwardRequest r = e.BackwardReq(ctx, {});
        r.clear_grad_output();
        return r;
      });
  bwd("BackwardGradOutputWrongWidth", kInvalid, "grad_output.shape must be [2, 8]", "lin",
      Prep::kContext, [](Env& e, const std::string& ctx) {
        return e.BackwardReq(ctx, Wire({2, kIn}));
      });
  bwd("BackwardGradOutputWrongRows", kInvalid, "grad_output.shape must be [2, 8]", "lin",
      Prep::kContext, [](Env& e, const std::string& ctx) {
        return e.BackwardReq(ctx, Wire({3, kOut}));
      });
  bwd("BackwardGradOutputWrongRank", kInvalid, "grad_output.shape must be [2, 8]", "lin",
      Prep::kContext, [](Env& e, const std::string& ctx) {
        return e.BackwardReq(ctx, Wire({1, 2, kOut}));
      });
  bwd("BackwardGradOutputDTypeUnspecified", kInvalid, "grad_output.dtype must be one of", "lin",
      Prep::kContext, [](Env& e, const std::string& ctx) {
        v1::BackwardRequest r = e.BackwardReq(ctx, Wire({2, kOut}));
        r.mutable_grad_output()->set_dtype(v1::DTYPE_UNSPECIFIED);
        return r;
      });
  bwd("BackwardGradOutputByteMismatch", kInvalid, "grad_output.data has 60 bytes", "lin",
      Prep::kContext, [](Env& e, const std::string& ctx) {
        v1::BackwardRequest r = e.BackwardReq(ctx, Wire({2, kOut}));
        r.mutable_grad_output()->mutable_data()->resize(60);
        return r;
      });
  bwd("BackwardBadGradInputDType", kInvalid, "grad_input_dtype must be", "lin", Prep::kContext,
      [](Env& e, const std::string& ctx) {
        v1::BackwardRequest r = e.BackwardReq(ctx, Wire({2, kOut}));
        r.set_grad_input_dtype(static_cast<v1::DType>(-3));
        return r;
      });
  bwd("BackwardFp8ZeroScaleInv", kInvalid, "grad_output.scale_inv must be finite and > 0", "lin",
      Prep::kContext, [](Env& e, const std::string& ctx) {
        v1::BackwardRequest r = e.BackwardReq(ctx, Wire({2, kOut}, WireDType::kFp8E5M2));
        r.mutable_grad_output()->set_scale_inv(0.0f);
        return r;
      });
  bwd("BackwardBlockScalesShortGrid", kInvalid, "grad_output.block_scales.scale_inv has 4 bytes",
      "lin", Prep::kContext, [](Env& e, const std::string& ctx) {
        v1::BackwardRequest r =
            e.BackwardReq(ctx, client::ToWire(Random({2, kOut}), WireDType::kFp8E5M2, {4, false}));
        r.mutable_grad_output()->mutable_block_scales()->mutable_scale_inv()->resize(4);
        return r;
      });
  // --- Backward: a bias gradient sent beside an FP8 grad_output (grad_output_column_sums).
  auto with_sums = [](Env& e, const std::string& ctx, WireDType dtype, int count) {
    v1::BackwardRequest r = e.BackwardReq(ctx, Wire({2, kOut}, dtype));
    for (int i = 0; i < count; ++i) r.add_grad_output_column_sums(0.25f * float(i + 1));
    return r;
  };
  bwd("BackwardColumnSumsBesideF32", kInvalid,
      "grad_output_column_sums comes only with an FP8 grad_output; this one is F32", "lin",
      Prep::kContext, [with_sums](Env& e, const std::string& ctx) {
        return with_sums(e, ctx, WireDType::kF32, kOut);
      });
  bwd("BackwardColumnSumsWrongCount", kInvalid,
      "grad_output_column_sums holds 3 values; the module's out_features is 8", "lin",
      Prep::kContext, [with_sums](Env& e, const std::string& ctx) {
        return with_sums(e, ctx, WireDType::kFp8E5M2, 3);
      });
  bwd("BackwardColumnSumsWithoutBias", kInvalid,
      "grad_output_column_sums is a bias gradient, and this module has no bias", "nob",
      Prep::kContext, [with_sums](Env& e, const std::string& ctx) {
        return with_sums(e, ctx, WireDType::kFp8E5M2, kOut);
      });
  bwd("BackwardColumnSumsNaN", kInvalid, "grad_output_column_sums[5] must be finite, got nan",
      "lin", Prep::kContext, [with_sums](Env& e, const std::string& ctx) {
        v1::BackwardRequest r = with_sums(e, ctx, WireDType::kFp8E5M2, kOut);
        r.set_grad_output_column_sums(5, kNaN);
        return r;
      });
  bwd("BackwardNaNGradOutput", kInvalid, "grad_output must be finite", "lin", Prep::kContext,
      [](Env& e, const std::string& ctx) { return e.BackwardReq(ctx, WireWith(kNaN, 2, kOut)); });
  bwd("BackwardInfGradOutputMlp", kInvalid, "grad_output must be finite", "mlp", Prep::kContext,
      [](Env& e, const std::string& ctx) { return e.BackwardReq(ctx, WireWith(kInf, 2, kOut)); });
  bwd("BackwardTwice", G::FAILED_PRECONDITION, "was already consumed by a backward", "lin",
      Prep::kConsumedContext, [](Env& e, const std::string& ctx) {
        return e.BackwardReq(ctx, Wire({2, kOut}));
      });
  bwd("BackwardAfterRelease", G::FAILED_PRECONDITION, "was already consumed", "lin",
      Prep::kReleasedContext, [](Env& e, const std::string& ctx) {
        return e.BackwardReq(ctx, Wire({2, kOut}));
      });
  bwd("BackwardLayerNormGradOnModuleWithoutIt", kInvalid,
      "grad_layernorm_output is only for modules created with return_layernorm_output", "lnl",
      Prep::kContext, [](Env& e, const std::string& ctx) {
        v1::BackwardRequest r = e.BackwardReq(ctx, Wire({2, kOut}));
        *r.mutable_grad_layernorm_output() = Wire({2, kIn});
        return r;
      });
  bwd("BackwardLayerNormGradOnLinear", kInvalid,
      "grad_layernorm_output is only for modules created with return_layernorm_output", "lin",
      Prep::kContext, [](Env& e, const std::string& ctx) {
        v1::BackwardRequest r = e.BackwardReq(ctx, Wire({2, kOut}));
        *r.mutable_grad_layernorm_output() = Wire({2, kIn});
        return r;
      });
  bwd("BackwardLayerNormGradWrongShape", kInvalid, "grad_layernorm_output.shape must be [2, 16]",
      "lnr", Prep::kContext, [](Env& e, const std::string& ctx) {
        v1::BackwardRequest r = e.BackwardReq(ctx, Wire({2, kOut}));
        *r.mutable_grad_layernorm_output() = Wire({2, kOut});
        return r;
      });
  bwd("BackwardLayerNormGradBadDType", kInvalid, "grad_layernorm_output.dtype must be one of",
      "lnr", Prep::kContext, [](Env& e, const std::string& ctx) {
        v1::BackwardRequest r = e.BackwardReq(ctx, Wire({2, kOut}));
        *r.mutable_grad_layernorm_output() = Wire({2, kIn});
        r.mutable_grad_layernorm_output()->set_dtype(static_cast<v1::DType>(8));
        return r;
      });
  // --- ReleaseContext.
  c.push_back(
      {"ReleaseUnknownContext", kNotFound, "is not a live context", "lin", Prep::kNone,
       [](Env& e, const std::string&) { return e.Release("00000000000000000000000000000003"); }});
  c.push_back({"ReleaseEmptyContextId", kInvalid, "context_id is required", "lin", Prep::kNone,
               [](Env& e, const std::string&) { return e.Release(""); }});
  // --- Foreign tenant: alice names bob's module or context; worded as for an unknown id.
  c.push_back({"ForeignForward", kNotFound, "is not a module", "bob", Prep::kNone,
               [](Env& e, const std::string&) {
                 return e.Forward(e.ForwardReq("bob", Wire({2, kIn})), e.alice.get());
               }});
  c.push_back({"ForeignBackward", kNotFound, "is not a live context", "bob", Prep::kBobContext,
               [](Env& e, const std::string& ctx) {
                 return e.Backward(e.BackwardReq(ctx, Wire({2, kOut})), e.alice.get());
               }});
  c.push_back({"ForeignRelease", kNotFound, "is not a live context", "bob", Prep::kBobContext,
               [](Env& e, const std::string& ctx) { return e.Release(ctx, e.alice.get()); }});
  c.push_back({"ForeignSetWeights", kNotFound, "is not a module", "bob", Prep::kNone,
               [](Env& e, const std::string&) {
                 return e.SetWeightsOf("bob", {{"bias", Wire({kOut})}}, e.alice.get());
               }});
  c.push_back({"ForeignApplyGradients", kNotFound, "is not a module", "bob", Prep::kNone,
               [](Env& e, const std::string&) {
                 return e.ApplyGradients(e.id["bob"], 0.0f, e.alice.get());
               }});
  c.push_back({"ForeignGetWeights", kNotFound, "is not a module", "bob", Prep::kNone,
               [](Env& e, const std::string&) {
                 return e.GetWeights(e.id["bob"], v1::F32, e.alice.get());
               }});
  c.push_back({"ForeignDelete", kNotFound, "is not a module", "bob", Prep::kNone,
               [](Env& e, const std::string&) { return e.Delete(e.id["bob"], e.alice.get()); }});
  // --- CreateModule: bad specs (the module count must not move).
  auto create = [&](const char* name, const char* msg, std::function<void(v1::ModuleSpec*)> edit) {
    c.push_back({name, kInvalid, msg, "lin", Prep::kNone,
                 [edit](Env& e, const std::string&) { return e.CreateSpec(edit); }});
  };
  c.push_back({"CreateMissingSpec", kInvalid, "spec is required", "lin", Prep::kNone,
               [](Env& e, const std::string&) { return e.CreateRaw({}); }});
  create("CreateKindUnspecified", "spec.kind must be LINEAR, LAYERNORM_LINEAR or LAYERNORM_MLP",
         [](v1::ModuleSpec* s) { s->set_kind(v1::MODULE_KIND_UNSPECIFIED); });
  create("CreateKindOutOfEnum", "got 42",
         [](v1::ModuleSpec* s) { s->set_kind(static_cast<v1::ModuleKind>(42)); });
  create("CreateZeroInFeatures", "spec.in_features",
         [](v1::ModuleSpec* s) { s->set_in_features(0); });
  create("CreateNegativeOutFeatures", "spec.out_features",
         [](v1::ModuleSpec* s) { s->set_out_features(-8); });
  create("CreateHugeInFeatures", "spec.in_features",
         [](v1::ModuleSpec* s) { s->set_in_features(int64_t(1) << 40); });
  create("CreateTooManyParameters", "a module may have at most", [](v1::ModuleSpec* s) {
    s->set_in_features(1 << 16);
    s->set_out_features(1 << 16);
  });
  create("CreateMlpWithoutFfn", "spec.ffn_features",
         [](v1::ModuleSpec* s) { s->set_kind(v1::LAYERNORM_MLP); });
  create("CreateLinearWithFfn", "spec.ffn_features is only for LAYERNORM_MLP",
         [](v1::ModuleSpec* s) { s->set_ffn_features(4); });
  create("CreateLinearWithActivation", "spec.activation is only for LAYERNORM_MLP",
         [](v1::ModuleSpec* s) { s->set_activation(v1::RELU); });
  create("CreateActivationOutOfEnum", "spec.activation must be", [](v1::ModuleSpec* s) {
    s->set_kind(v1::LAYERNORM_MLP);
    s->set_ffn_features(4);
    s->set_activation(static_cast<v1::Activation>(99));
  });
  create("CreateScalingOutOfEnum", "spec.recipe.scaling must be CURRENT, DELAYED, BLOCK or MXFP8",
         [](v1::ModuleSpec* s) {
           s->mutable_recipe()->set_scaling(static_cast<v1::ScalingRecipe>(9));
         });
  create("CreateBlockWithMargin", "spec.recipe.margin must be 0 under BLOCK",
         [](v1::ModuleSpec* s) {
           s->mutable_recipe()->set_scaling(v1::BLOCK);
           s->mutable_recipe()->set_margin(1);
         });
  create("CreateMxfp8WithMargin", "spec.recipe.margin must be 0 under MXFP8",
         [](v1::ModuleSpec* s) {
           s->mutable_recipe()->set_scaling(v1::MXFP8);
           s->mutable_recipe()->set_margin(3);
         });
  create("CreateMxfp8Hybrid", "spec.recipe.format HYBRID is not one of MXFP8's",
         [](v1::ModuleSpec* s) {
           s->mutable_recipe()->set_scaling(v1::MXFP8);
           s->mutable_recipe()->set_format(v1::HYBRID);
         });
  create("CreateCurrentE4m3Only", "spec.recipe.format E4M3_ONLY is not one of CURRENT's",
         [](v1::ModuleSpec* s) {
           s->mutable_recipe()->set_scaling(v1::CURRENT);
           s->mutable_recipe()->set_format(v1::E4M3_ONLY);
         });
  create("CreateFormatOutOfEnum", "spec.recipe.format must be E4M3_ONLY or HYBRID",
         [](v1::ModuleSpec* s) {
           s->mutable_recipe()->set_scaling(v1::BLOCK);
           s->mutable_recipe()->set_format(static_cast<v1::Fp8Format>(7));
         });
  create("CreateAmaxAlgoOutOfEnum", "spec.recipe.amax_compute_algo must be MAX or MOST_RECENT",
         [](v1::ModuleSpec* s) {
           s->mutable_recipe()->set_amax_compute_algo(static_cast<v1::AmaxComputeAlgo>(5));
         });
  create("CreateNegativeMargin", "spec.recipe.margin",
         [](v1::ModuleSpec* s) { s->mutable_recipe()->set_margin(-1); });
  create("CreateNegativeHistoryLen", "spec.recipe.amax_history_len",
         [](v1::ModuleSpec* s) { s->mutable_recipe()->set_amax_history_len(-4); });
  create("CreateNaNLayerNormEps", "spec.layernorm_eps", [](v1::ModuleSpec* s) {
    s->set_kind(v1::LAYERNORM_LINEAR);
    s->set_layernorm_eps(kNaN);
  });
  create("CreateLinearZeroCenteredGamma", "are for the LayerNorm modules",
         [](v1::ModuleSpec* s) { s->set_zero_centered_gamma(true); });
  create("CreateSgdNegativeLearningRate", "spec.optimizer.sgd.learning_rate",
         [](v1::ModuleSpec* s) { s->mutable_optimizer()->mutable_sgd()->set_learning_rate(-1); });
  create("CreateSgdMomentumOne", "spec.optimizer.sgd.momentum", [](v1::ModuleSpec* s) {
    s->mutable_optimizer()->mutable_sgd()->set_learning_rate(0.1f);
    s->mutable_optimizer()->mutable_sgd()->set_momentum(1.0f);
  });
  create("CreateAdamWBeta1One", "spec.optimizer.adamw.beta1", [](v1::ModuleSpec* s) {
    s->mutable_optimizer()->mutable_adamw()->set_learning_rate(0.001f);
    s->mutable_optimizer()->mutable_adamw()->set_beta1(1.0f);
  });
  create("CreateAdamWNaNWeightDecay", "spec.optimizer.adamw.weight_decay", [](v1::ModuleSpec* s) {
    s->mutable_optimizer()->mutable_adamw()->set_learning_rate(0.001f);
    s->mutable_optimizer()->mutable_adamw()->set_weight_decay(kNaN);
  });
  c.push_back(
      {"DeleteUnknownModule", kNotFound, "is not a module", "lin", Prep::kNone,
       [](Env& e, const std::string&) { return e.Delete("00000000000000000000000000000004"); }});
  c.push_back({"DeleteEmptyModuleId", kInvalid, "module_id is required", "lin", Prep::kNone,
               [](Env& e, const std::string&) { return e.Delete(""); }});
  // --- Optimizer and weights.
  c.push_back({"ApplyGradientsUnknownModule", kNotFound, "is not a module", "lin", Prep::kNone,
               [](Env& e, const std::string&) {
                 return e.ApplyGradients("00000000000000000000000000000004", 0);
               }});
  c.push_back({"ApplyGradientsNegativeLearningRate", kInvalid, "learning_rate must be finite",
               "lin", Prep::kNone,
               [](Env& e, const std::string&) { return e.ApplyGradients(e.id["lin"], -0.1f); }});
  c.push_back({"ApplyGradientsNaNLearningRate", kInvalid, "learning_rate must be finite", "lin",
               Prep::kNone,
               [](Env& e, const std::string&) { return e.ApplyGradients(e.id["lin"], kNaN); }});
  c.push_back({"GetGradientsBadDType", kInvalid, "dtype must be", "lin", Prep::kNone,
               [](Env& e, const std::string&) {
                 // zero=true with a bad dtype must not zero anything either.
                 return e.GetGradients(e.id["lin"], static_cast<v1::DType>(12), true);
               }});
  c.push_back({"GetWeightsBadDType", kInvalid, "dtype must be", "lin", Prep::kNone,
               [](Env& e, const std::string&) {
                 return e.GetWeights(e.id["lin"], static_cast<v1::DType>(6));
               }});
  c.push_back({"GetWeightsUnknownModule", kNotFound, "is not a module", "lin", Prep::kNone,
               [](Env& e, const std::string&) {
                 return e.GetWeights("00000000000000000000000000000005", v1::F32);
               }});
  auto set = [&](const char* name, G code, const char* msg, std::string module,
                 std::function<std::vector<std::pair<std::string, v1::Tensor>>()> params) {
    c.push_back(
        {name, code, msg, module, Prep::kNone, [module, params](Env& e, const std::string&) {
           return e.SetWeightsOf(module, params());
         }});
  };
  set("SetWeightsUnknownModule", kNotFound, "is not a module", "00000000000000000000000000000004",
      [] {
        return std::vector<std::pair<std::string, v1::Tensor>>{{"bias", Wire({kOut})}};
      });
  set("SetWeightsEmptyParameters", kInvalid, "parameters is empty", "lin",
      [] { return std::vector<std::pair<std::string, v1::Tensor>>{}; });
  set("SetWeightsUnknownName", kInvalid, "not a parameter of this Linear", "lin", [] {
    return std::vector<std::pair<std::string, v1::Tensor>>{{"gamma", Wire({kOut})}};
  });
  set("SetWeightsNameOfOtherModuleKind", kInvalid, "not a parameter of this Linear", "lin", [] {
    return std::vector<std::pair<std::string, v1::Tensor>>{{"layer_norm_weight", Wire({kIn})}};
  });
  set("SetWeightsDuplicateName", kInvalid, "given twice", "lin", [] {
    return std::vector<std::pair<std::string, v1::Tensor>>{{"bias", Wire({kOut})},
                                                           {"bias", Wire({kOut})}};
  });
  set("SetWeightsWrongShape", kInvalid, ".shape must be [8, 16]", "lin", [] {
    return std::vector<std::pair<std::string, v1::Tensor>>{{"weight", Wire({kIn, kOut})}};
  });
  set("SetWeightsNaNValue", kInvalid, "must be finite", "lin", [] {
    return std::vector<std::pair<std::string, v1::Tensor>>{{"weight", WireWith(kNaN, kOut, kIn)}};
  });
  set("SetWeightsBadTensorDType", kInvalid, "parameters[0].tensor.dtype must be one of", "lin", [] {
    v1::Tensor t = Wire({kOut});
    t.set_dtype(static_cast<v1::DType>(31));
    return std::vector<std::pair<std::string, v1::Tensor>>{{"bias", t}};
  });
  set("SetWeightsFp8ZeroScaleInv", kInvalid, "parameters[0].tensor.scale_inv", "lin", [] {
    v1::Tensor t = Wire({kOut}, WireDType::kFp8E4M3);
    t.set_scale_inv(0.0f);
    return std::vector<std::pair<std::string, v1::Tensor>>{{"bias", t}};
  });
  set("SetWeightsValidThenBadShape", kInvalid, "parameters[1] (bias).shape must be [8]", "lin", [] {
    // The first parameter is fine: nothing may be applied when a later one is bad.
    return std::vector<std::pair<std::string, v1::Tensor>>{{"weight", Wire({kOut, kIn})},
                                                           {"bias", Wire({kOut + 1})}};
  });
  set("SetWeightsValidThenBadBytes", kInvalid, "parameters[1].tensor.data has", "mlp", [] {
    v1::Tensor bad = Wire({kOut});
    bad.mutable_data()->resize(7);
    return std::vector<std::pair<std::string, v1::Tensor>>{{"fc2_bias", Wire({kOut})},
                                                           {"fc1_bias", bad}};
  });
  return c;
}

// One server pair per test process (gtest_discover_tests runs each test in its own process).
class BadInputTest : public ::testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() { env_ = new Env(); }
  static void TearDownTestSuite() {
    delete env_;
    env_ = nullptr;
  }

  // Whatever the setup made, for the case and for its clean-up.
  static std::string Prepare(Env& e, Prep setup) {
    switch (setup) {
      case Prep::kNone:
        return "";
      case Prep::kContext:
        return e.NewContext(GetParam().module);
      case Prep::kConsumedContext: {
        const std::string ctx = e.NewContext(GetParam().module);
        EXPECT_TRUE(e.c->Backward(ctx, Random({2, kOut})).ok());
        return ctx;
      }
      case Prep::kReleasedContext: {
        const std::string ctx = e.NewContext(GetParam().module);
        EXPECT_TRUE(e.c->ReleaseContext(ctx).ok());
        return ctx;
      }
      case Prep::kBobContext:
        return e.NewContext("bob");
    }
    return "";
  }

  // A valid training forward and backward on `module`, with finite results.
  static void ExpectValidStep(Env& e, std::string module) {
    if (!e.id.count(module)) module = "lin";  // the case named an id that does not exist
    client::Client& cl = module == "bob" || module == "alice" ? e.For(module) : *e.c;
    auto fwd = cl.Forward(e.id.at(module), Random({3, kIn}), true);
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    for (float v : fwd->output.data) ASSERT_TRUE(std::isfinite(v)) << "forward output " << v;
    auto grad = cl.Backward(fwd->context_id, Random({3, kOut}));
    ASSERT_TRUE(grad.ok()) << grad.status();
    for (float v : grad->data) ASSERT_TRUE(std::isfinite(v)) << "grad_input " << v;
  }

  static Env* env_;
};
Env* BadInputTest::env_ = nullptr;

TEST_P(BadInputTest, RejectedCleanlyAndChangesNothing) {
  Env& e = *env_;
  const Case& c = GetParam();
  const std::string context = Prepare(e, c.setup);
  const Snapshot before = Snapshot::Take(e);
  const grpc::Status s = c.send(e, context);
  EXPECT_EQ(s.error_code(), c.code) << s.error_message();
  EXPECT_NE(s.error_message().find(c.message), std::string::npos)
      << "message: " << s.error_message() << "\nexpected to contain: " << c.message;
  const std::string diff = before.Diff(Snapshot::Take(e));
  EXPECT_EQ(diff, "") << "state changed";
  if (c.setup == Prep::kContext) {
    EXPECT_TRUE(e.c->ReleaseContext(context).ok());
  }
  if (c.setup == Prep::kBobContext) {
    EXPECT_TRUE(e.bob->ReleaseContext(context).ok());
  }
  ExpectValidStep(e, c.module);
  // The bad request's context, if any, is gone and nothing else is live.
  EXPECT_EQ(e.plain->host().Stats().live_contexts, 0);
  EXPECT_EQ(e.isolated->host().Stats().live_contexts, 0);
}

INSTANTIATE_TEST_SUITE_P(Cases, BadInputTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.name);
                         });

// Regression: the service used to drop BackwardRequest.grad_layernorm_output, so the LayerNorm
// output's gradient never reached grad_input or the LayerNorm parameters. Over the wire it must
// give exactly what the module host computes in-process with the same gradient.
TEST(GradLayerNormOutputTest, ReachesTheModuleOverTheWire) {
  testing::TestServer server;
  auto c = server.Connect();
  v1::ModuleSpec s = testing::LayerNormLinearSpec(kIn, kOut, true, 5);
  s.set_return_layernorm_output(true);
  auto wire_module = c->CreateModule(s);
  auto local_module = c->CreateModule(s);  // same seed: same weights
  ASSERT_TRUE(wire_module.ok() && local_module.ok());
  const HostTensor x = Random({3, kIn}), dy = Random({3, kOut}), dln = Random({3, kIn});
  auto torch = [](const HostTensor& t) {
    return at::from_blob(const_cast<float*>(t.data.data()), t.shape, at::kFloat).clone();
  };

  auto fwd = c->Forward(wire_module->module_id(), x, true);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  client::BackwardOptions options;
  options.grad_layernorm_output = dln;
  auto wire_dx = c->Backward(fwd->context_id, dy, options);
  ASSERT_TRUE(wire_dx.ok()) << wire_dx.status();

  core::ModuleHost& host = server.host();
  auto local = core::TensorForward(host, local_module->module_id(), torch(x), true);
  ASSERT_TRUE(local.ok()) << local.status();
  core::BackwardInput in;
  in.grad_output = torch(dy);
  in.grad_layernorm_output = torch(dln);
  auto local_dx = core::TensorBackward(host, local->context_id, in);
  ASSERT_TRUE(local_dx.ok()) << local_dx.status();
  EXPECT_TRUE(at::equal(torch(*wire_dx), *local_dx));

  // And it matters: without it grad_input differs.
  auto fwd2 = c->Forward(wire_module->module_id(), x, true);
  ASSERT_TRUE(fwd2.ok());
  auto plain_dx = c->Backward(fwd2->context_id, dy);
  ASSERT_TRUE(plain_dx.ok());
  EXPECT_FALSE(at::allclose(torch(*plain_dx), *local_dx));
  auto wire_grads = core::TensorGradients(host, wire_module->module_id(), false);
  auto local_grads = core::TensorGradients(host, local_module->module_id(), false);
  ASSERT_TRUE(wire_grads.ok() && local_grads.ok());
  // layer_norm_weight's gradient of the first backward matches (the second added more to it).
  EXPECT_EQ(wire_grads->tensors[0].first, "layer_norm_weight");
  EXPECT_FALSE(
      at::equal(wire_grads->tensors[0].second, at::zeros_like(wire_grads->tensors[0].second)));
}

TEST(BadInputSuiteTest, HasFiftyDistinctCases) {
  std::set<std::string> names;
  for (const Case& c : Cases()) EXPECT_TRUE(names.insert(c.name).second) << c.name;
  EXPECT_GE(names.size(), 50u);
}

// Every case, many times over: live contexts and context bytes return to zero and the process's
// RSS stays within a generous bound of what it was after the first round (which warms up the
// allocators, gRPC's buffers and libtorch).
TEST(BadInputMemoryTest, RepeatedBadInputsDoNotGrowMemory) {
  Env e;
  const std::vector<Case> cases = Cases();
  auto round = [&] {
    for (const Case& c : cases) {
      std::string context;
      switch (c.setup) {
        case Prep::kContext:
          context = e.NewContext(c.module);
          break;
        case Prep::kConsumedContext:
          context = e.NewContext(c.module);
          EXPECT_TRUE(e.c->Backward(context, Random({2, kOut})).ok());
          break;
        case Prep::kReleasedContext:
          context = e.NewContext(c.module);
          EXPECT_TRUE(e.c->ReleaseContext(context).ok());
          break;
        case Prep::kBobContext:
          context = e.NewContext("bob");
          break;
        case Prep::kNone:
          break;
      }
      EXPECT_EQ(c.send(e, context).error_code(), c.code) << c.name;
      if (c.setup == Prep::kContext) (void)e.c->ReleaseContext(context);
      if (c.setup == Prep::kBobContext) (void)e.bob->ReleaseContext(context);
    }
  };
  round();
  round();
  const int64_t rss_after_warmup = RssKiB();
  ASSERT_GT(rss_after_warmup, 0);
  for (int i = 0; i < 20; ++i) round();
  const int64_t rss_end = RssKiB();
  EXPECT_EQ(e.plain->host().Stats().live_contexts, 0);
  EXPECT_EQ(e.plain->host().Stats().context_bytes, 0);
  EXPECT_EQ(e.isolated->host().Stats().live_contexts, 0);
  EXPECT_EQ(e.plain->host().Stats().modules, 5);  // lin, nob, lnl, lnr, mlp
  // 20 rounds of ~80 requests: a leak of even 2 KiB per request would show as 3 MiB; allow 48.
  if (kSanitized) {
    std::printf("RSS bound not checked in a sanitizer build (%lld -> %lld KiB)\n",
                (long long)rss_after_warmup, (long long)rss_end);
  } else {
    EXPECT_LT(rss_end - rss_after_warmup, 48 * 1024)
        << "RSS grew from " << rss_after_warmup << " KiB to " << rss_end << " KiB";
  }
}

}  // namespace
}  // namespace gradwire
