// C++ client of gradwire-server. Every call has a deadline (ClientOptions::timeout) and returns
// an absl::Status whose code is the gRPC status code and whose message names the method.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "gradwire/v1/service.grpc.pb.h"
#include "gradwire/wire/codec.h"
#include "gradwire/wire/tensor.h"

namespace gradwire::client {

// How float tensors travel to the server. The FP8 kinds are cast with a current-scaling scale of
// their own (amax of the tensor maps to the format's largest value), sent with its scale_inv; the
// server uses FP8 input codes as they are. Activations are usually E4M3, gradients E5M2.
// The wire codec's element types (gradwire/wire/codec.h), which the server decodes alike.
using WireDType = wire::DType;
using wire::ToProto;

// A float32 host tensor, row-major.
struct HostTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;

  int64_t numel() const;
  static HostTensor Zeros(std::vector<int64_t> shape);
};

// HostTensor -> wire tensor in `dtype`.
v1::Tensor ToWire(const HostTensor& t, WireDType dtype);
// Wire tensor (any dtype, FP8 included) -> HostTensor; INVALID_ARGUMENT when malformed.
absl::StatusOr<HostTensor> FromWire(const v1::Tensor& t);
// The same for a tensor whose bytes arrived apart from its message (gradwire/wire/zero_copy.h).
absl::StatusOr<HostTensor> FromWire(const v1::Tensor& t, absl::string_view data);

struct ClientOptions {
  std::string server = "127.0.0.1:50051";    // host:port of gradwire-server
  std::chrono::milliseconds timeout{30000};  // deadline of each call
  WireDType wire_dtype = WireDType::kF32;    // dtype of activations and gradients both ways
  int max_message_mib = 64;                  // largest message sent or received
  // TLS: a PEM CA bundle that signed the server's certificate turns TLS on; a PEM client
  // certificate and key answer a server that requires mutual TLS. Empty: plaintext.
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  // The name the server's certificate must carry, when it is not the host of `server` (a probe
  // that dials 127.0.0.1 inside a pod whose certificate names the service).
  std::string tls_server_name;
  // Bearer token for a server that requires tokens: sent as "authorization: Bearer TOKEN" on every
  // call (health checks too; the server ignores it there).
  std::string token;
  // Tensors larger than one chunk travel on the chunked calls (ForwardChunked, ...) in chunks of
  // this many KiB; it must not exceed the server's --chunk-kib. kAuto picks the call by the
  // request's and the expected response's size; kAlways / kNever force one (tests, benchmarks).
  int chunk_kib = 4096;
  enum class Chunking { kAuto, kAlways, kNever };
  Chunking chunking = Chunking::kAuto;
};

struct ForwardResult {
  HostTensor output;
  std::string context_id;  // empty for inference
  uint64_t weight_version = 0;
  std::optional<HostTensor> layernorm_output;  // modules with return_layernorm_output
};

struct BackwardOptions {
  bool retain = false;                              // keep the context for another backward
  bool skip_grad_input = false;                     // first layer: no grad_input needed
  std::optional<HostTensor> grad_layernorm_output;  // with return_layernorm_output
};

// Parameters (or their gradients) by name, in the module's order.
struct NamedTensors {
  std::vector<std::pair<std::string, HostTensor>> tensors;
  uint64_t weight_version = 0;
  int64_t accumulated_backwards = 0;  // gradients only
  // nullptr when there is no such parameter.
  const HostTensor* Find(const std::string& name) const;
};

// One Train stream: a client pipelines forwards, backwards and releases, each tagged with a
// request id that its response carries back. Send and Read may be used from two threads (one
// each). Ending or cancelling the stream makes the server release every context it created and
// did not consume.
class TrainStream {
 public:
  ~TrainStream();
  // False when the stream is broken; Finish then says why.
  bool Send(const v1::TrainRequest& request);
  bool SendForward(uint64_t request_id, const std::string& module_id, const HostTensor& input,
                   bool training);
  bool SendBackward(uint64_t request_id, const std::string& context_id,
                    const HostTensor& grad_output, BackwardOptions options = {});
  // The next response (completion order, which on one server is request order); nullopt when the
  // server ended the stream.
  std::optional<v1::TrainResponse> Read();
  // Half-closes (no more requests), reads what is left and returns the stream's status.
  absl::Status Finish();
  // Ends the stream now from the client side.
  void Cancel();

 private:
  friend class Client;
  TrainStream() = default;
  WireDType wire_dtype_ = WireDType::kF32;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::TrainRequest, v1::TrainResponse>> stream_;
  bool writes_done_ = false;
};

// The bearer token a command-line tool uses: the first line of `token_file` (trailing space
// trimmed; INVALID_ARGUMENT when unreadable or empty), or else $GRADWIRE_TOKEN, or else none.
absl::StatusOr<std::string> ResolveToken(const std::string& token_file);

class Client {
 public:
  // Throws std::runtime_error when a TLS file cannot be read.
  explicit Client(ClientOptions options);
  ~Client();

  const ClientOptions& options() const { return options_; }

  // Waits until the channel is connected; UNAVAILABLE naming the server if it is not by then.
  absl::Status WaitForReady(std::chrono::milliseconds timeout);

  absl::StatusOr<v1::GetServerInfoResponse> GetServerInfo();
  // grpc.health.v1 Check of `service` ("" is the server as a whole): "SERVING", "NOT_SERVING" or
  // "UNKNOWN"; NOT_FOUND when the server does not know the service.
  absl::StatusOr<std::string> CheckHealth(const std::string& service = "");
  absl::StatusOr<v1::ModuleInfo> CreateModule(const v1::ModuleSpec& spec);
  absl::StatusOr<std::vector<v1::ModuleInfo>> ListModules();
  absl::Status DeleteModule(const std::string& module_id);

  absl::StatusOr<ForwardResult> Forward(const std::string& module_id, const HostTensor& input,
                                        bool training);
  // Returns grad_input (empty shape with skip_grad_input).
  absl::StatusOr<HostTensor> Backward(const std::string& context_id, const HostTensor& grad_output,
                                      BackwardOptions options = {});
  absl::Status ReleaseContext(const std::string& context_id);
  // Opens a Train stream (no deadline: it lives until Finish or Cancel).
  std::unique_ptr<TrainStream> OpenTrainStream();

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
  // call the deadline and token every wrapped call has.
  v1::Gradwire::Stub& stub() { return *stub_; }
  void PrepareContext(grpc::ClientContext* ctx) const;

  // Calls made on the chunked variants so far (tests, benchmarks).
  int64_t chunked_calls() const;

 private:
  // What the client remembers of a module to predict response sizes.
  struct ModuleShape {
    int64_t in = 0, out = 0, ffn = 0;
    bool layernorm_output = false;  // forward also returns the LayerNorm output
    bool gated = false;             // SWIGLU / GEGLU: fc1 is twice as wide
  };
  // Whether a call whose request carries `request_bytes` of tensors and whose response is
  // expected to carry `response_bytes` (-1: unknown) goes chunked.
  bool UseChunked(int64_t request_bytes, int64_t response_bytes) const;
  void Remember(const v1::ModuleInfo& info);
  // The module's shape, asking the server (ListModules) once when it is not known yet.
  std::optional<ModuleShape> Shape(const std::string& module_id);
  void NoteContext(const std::string& context_id, int64_t grad_input_elements);
  int64_t TakeContext(const std::string& context_id, bool keep);  // -1: unknown

  // A chunked call's context (PrepareContext), counted in chunked_calls_.
  void StartChunked(grpc::ClientContext* ctx);
  absl::StatusOr<v1::ForwardResponse> ForwardChunked(v1::ForwardRequest& req);
  absl::StatusOr<v1::BackwardResponse> BackwardChunked(v1::BackwardRequest& req);
  absl::StatusOr<v1::GetWeightsResponse> GetWeightsChunked(const v1::GetWeightsRequest& req);
  absl::StatusOr<v1::SetWeightsResponse> SetWeightsChunked(v1::SetWeightsRequest& req);

  ClientOptions options_;
  mutable std::mutex cache_mu_;
  std::unordered_map<std::string, ModuleShape> modules_;
  // Training contexts this client created: elements of the forward input (= of grad_input).
  std::unordered_map<std::string, int64_t> contexts_;
  std::deque<std::string> context_order_;  // oldest first, to bound contexts_
  int64_t chunked_calls_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Gradwire::Stub> stub_;
};

}  // namespace gradwire::client
