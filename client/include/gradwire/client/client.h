// C++ client of gradwire-server. Every call has a deadline (ClientOptions::timeout) and returns
// an absl::Status whose code is the gRPC status code and whose message names the method.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/client/credentials.h"
#include "gradwire/client/host_tensor.h"
#include "gradwire/client/options.h"
#include "gradwire/client/shape_cache.h"
#include "gradwire/client/train_stream.h"
#include "gradwire/v1/service.grpc.pb.h"

namespace gradwire::client {
namespace internal {
class SharedMemoryPool;
}

struct ForwardResult {
  HostTensor output;
  std::string context_id;  // empty for inference
  uint64_t weight_version = 0;
  std::optional<HostTensor> layernorm_output;  // modules with return_layernorm_output
  // Requests computed in one backend call with this one when the server batches
  // (--max-batch-rows); 0: alone. The result is the same bits either way.
  int32_t batch_requests = 0;
};

// A W3C `traceparent` (version 00, sampled): `trace_id` (32 lowercase hex digits) when given,
// else a fresh random trace-id, and a fresh random parent id.
std::string NewTraceparent(const std::string& trace_id = "");
// The metadata header naming the module a call is about, for proxies that route on it
// (docs/scaling-out.md).
inline constexpr char kRouteHeader[] = "gradwire-route";

// An id a client chooses: 128 random bits as 32 lowercase hex digits. A training forward's
// context id (ForwardRequest.context_id) and a new module's (CreateModuleRequest.module_id).
std::string NewRandomId();
inline std::string NewContextId() { return NewRandomId(); }

class Client {
 public:
  // Throws std::runtime_error when a TLS file cannot be read.
  explicit Client(ClientOptions options);
  // Over an existing channel (an in-process channel into a server, a channel shared by several
  // clients); `options.server` then only names the server in messages, and the TLS and message
  // size options are the channel's business. An in-process channel is ready from the start, and
  // gRPC cannot watch its state: do not call WaitForReady on such a client.
  Client(ClientOptions options, std::shared_ptr<grpc::Channel> channel);
  ~Client();

  const ClientOptions& options() const { return options_; }

  // Waits until the channel is connected; UNAVAILABLE naming the server if it is not by then.
  absl::Status WaitForReady(std::chrono::milliseconds timeout);

  absl::StatusOr<v1::GetServerInfoResponse> GetServerInfo();
  // grpc.health.v1 Check of `service` ("" is the server as a whole): "SERVING", "NOT_SERVING" or
  // "UNKNOWN"; NOT_FOUND when the server does not know the service.
  absl::StatusOr<std::string> CheckHealth(const std::string& service = "");
  // A module this client creates is kept alive on a server with --module-ttl while the client
  // lives (KeepAlive every third of the TTL, from a thread of its own) until DeleteModule.
  //
  // Routing: every call about a module carries its id in the "gradwire-route" header (a proxy in
  // front of several servers sends each module's calls to one of them by it;
  // docs/scaling-out.md), a backward or release that of its context's module. So CreateModule
  // proposes the module's id (a fresh random one, NewRandomId) and routes by it.
  absl::StatusOr<v1::ModuleInfo> CreateModule(const v1::ModuleSpec& spec);
  // `route`: a module id to send the call by (behind a routing proxy, the server that holds that
  // module answers); empty, any server.
  absl::StatusOr<std::vector<v1::ModuleInfo>> ListModules(const std::string& route = {});
  absl::Status DeleteModule(const std::string& module_id);
  // Keeps an existing module alive as a created one is (a module attached by id); Release stops.
  void Hold(const std::string& module_id);
  void Release(const std::string& module_id);
  // The modules kept alive, and the KeepAlive calls sent so far (tests).
  std::vector<std::string> held() const;
  int64_t keep_alive_calls() const;

  // A training forward names its context itself (ForwardRequest.context_id, 128 random bits).
  // When the call ends without the server's answer reaching this client (cancelled, past its
  // deadline, the connection lost) or its answer cannot be read, the context may exist on the
  // server with nobody knowing its id: the client releases it then, in the background (one
  // ReleaseContext with a short deadline; the destructor waits for those still in flight).
  absl::StatusOr<ForwardResult> Forward(const std::string& module_id, const HostTensor& input,
                                        bool training);
  // Returns grad_input (empty shape with skip_grad_input).
  absl::StatusOr<HostTensor> Backward(const std::string& context_id, const HostTensor& grad_output,
                                      BackwardOptions options = {});
  absl::Status ReleaseContext(const std::string& context_id);
  // Opens a Train stream (no deadline: it lives until Finish or Cancel). `route`: the one module
  // its requests are about (their module, or their contexts' module), sent as the stream's
  // "gradwire-route" header; the server refuses a request about another one. A client behind a
  // routing proxy opens one stream per module. Empty: no header (a direct connection).
  std::unique_ptr<TrainStream> OpenTrainStream(const std::string& route = {});

  // Applies the accumulated gradients with the module's optimizer (learning_rate > 0 overrides
  // its rate for this step); returns the new weight version.
  absl::StatusOr<uint64_t> ApplyGradients(const std::string& module_id, float learning_rate = 0.0f);
  // The accumulated gradients; zero=true also clears them on the server.
  absl::StatusOr<NamedTensors> GetGradients(const std::string& module_id, bool zero = false);
  absl::StatusOr<NamedTensors> GetWeights(const std::string& module_id);
  // Replaces the named parameters (any subset); returns the new weight version.
  absl::StatusOr<uint64_t> SetWeights(
      const std::string& module_id,
      const std::vector<std::pair<std::string, HostTensor>>& parameters);

  // Shared-memory tensors (a server on this host started with --allow-shared-memory; see
  // shared_memory.h). Registers bytes [offset, offset + byte_size) of the object `key` as
  // `name`; unregisters one region, or with an empty name every region of this caller (returns
  // how many); lists them.
  absl::Status RegisterSharedMemory(const std::string& name, const std::string& key,
                                    uint64_t offset, uint64_t byte_size);
  absl::StatusOr<int> UnregisterSharedMemory(const std::string& name = "");
  absl::StatusOr<std::vector<v1::ListSharedMemoryResponse::Region>> ListSharedMemory(
      const std::string& name = "");
  // The request as given, on the unary call: for tensors that reference shared memory, or results
  // the server should write there. A training forward's context is remembered as Forward's is.
  absl::StatusOr<v1::ForwardResponse> ForwardRaw(const v1::ForwardRequest& req);
  absl::StatusOr<v1::BackwardResponse> BackwardRaw(const v1::BackwardRequest& req);

  // The raw stub, for calls the wrapper does not cover; PrepareContext gives a context of such a
  // call the deadline, token and W3C `traceparent` every wrapped call has, logs the traceparent
  // at debug level (spdlog's default logger) with `method`, and returns it. The server's request
  // id for the call is its trace-id: the server's log lines and errors about the call carry it.
  // `route`, when not empty, goes in the "gradwire-route" header: the module the call is about.
  v1::Gradwire::Stub& stub() { return *stub_; }
  std::string PrepareContext(grpc::ClientContext* ctx, const char* method = "call",
                             const std::string& route = {}) const;
  // The module a training context of this client's came from ("" when it does not know it).
  std::string ModuleOfContext(const std::string& context_id) const;

  // Calls made on the chunked variants so far (tests, benchmarks).
  int64_t chunked_calls() const;
  // Forward and Backward calls whose tensors went through shared memory so far, and whether this
  // client has stopped asking for it (the server cannot give it a region it can open).
  int64_t shared_memory_calls() const;
  bool shared_memory_off() const;
  // Forwards whose input crossed as its FP8 cast under the exact wire (Forward, not the Train
  // stream; tests, benchmarks).
  int64_t exact_fp8_inputs() const { return exact_fp8_inputs_.load(); }
  // Backwards whose grad_output crossed as its FP8 cast under the exact wire (Backward, not the
  // Train stream; tests, benchmarks).
  int64_t exact_fp8_gradients() const { return exact_fp8_gradients_.load(); }
  // ReleaseContext calls sent for training forwards that ended without their answer (tests).
  int64_t unanswered_releases() const;

 private:
  // Forward with the context id chosen (empty for inference); `answered` is set when the server's
  // OK answer arrived, whatever happens to it here after.
  absl::StatusOr<ForwardResult> ForwardNamed(const std::string& module_id, const HostTensor& input,
                                             bool training, const std::string& context_id,
                                             bool* answered);
  // One ReleaseContext of `context_id`, sent without waiting for it.
  void ReleaseInBackground(const std::string& context_id, const std::string& module_id);
  // Whether a call whose request carries `request_bytes` of tensors and whose response is
  // expected to carry `response_bytes` (-1: unknown) goes chunked.
  bool UseChunked(int64_t request_bytes, int64_t response_bytes) const;
  // The module's shape, asking the server (ListModules) once when it is not known yet.
  std::optional<ModuleShape> Shape(const std::string& module_id);

  // A chunked call's context (PrepareContext), counted in chunked_calls_.
  void StartChunked(grpc::ClientContext* ctx, const char* method, const std::string& route);
  absl::StatusOr<v1::ForwardResponse> ForwardChunked(v1::ForwardRequest& req);
  // `route`: the module of req's context (the caller looked it up before forgetting it).
  absl::StatusOr<v1::BackwardResponse> BackwardChunked(v1::BackwardRequest& req,
                                                       const std::string& route);
  absl::StatusOr<v1::GetWeightsResponse> GetWeightsChunked(const v1::GetWeightsRequest& req);
  absl::StatusOr<v1::SetWeightsResponse> SetWeightsChunked(v1::SetWeightsRequest& req);
  // Through a shared-memory region when the tensors are large enough and the pool lends one:
  // the result, or nullopt for the wire (no region, or the server had closed the one lent).
  std::optional<absl::StatusOr<ForwardResult>> ForwardShared(
      const std::string& module_id, const HostTensor& input, const TensorForm& in_form,
      WireDType out_dtype, bool training, const std::string& context_id, int64_t output_elements,
      int64_t layernorm_elements, bool* answered);
  std::optional<absl::StatusOr<HostTensor>> BackwardShared(
      const std::string& route, const v1::BackwardRequest& header, const HostTensor& grad_output,
      const HostTensor* grad_layernorm_output, int64_t grad_input_elements,
      const TensorForm& out_form, const TensorForm& ln_form);

  ClientOptions options_;
  // Shared with the Train streams it opens (the exact wire reads a module's spec there too).
  std::shared_ptr<ShapeCache> shapes_ = std::make_shared<ShapeCache>();
  std::atomic<int64_t> chunked_calls_{0};
  std::atomic<int64_t> shared_memory_calls_{0};
  std::atomic<int64_t> exact_fp8_inputs_{0};
  std::atomic<int64_t> exact_fp8_gradients_{0};
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Gradwire::Stub> stub_;
  // After the stub: the keep-alive thread and the shared-memory regions use it until they go.
  class Keeper;
  std::unique_ptr<Keeper> keeper_;
  std::unique_ptr<internal::SharedMemoryPool> shm_;
  // Background ReleaseContext calls in flight (shared with their callbacks), waited for when the
  // client goes.
  struct Background;
  std::shared_ptr<Background> background_;
};

}  // namespace gradwire::client
