// The Train bidi stream of the C++ client (Client::OpenTrainStream).
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include "absl/status/status.h"
#include "gradwire/client/host_tensor.h"
#include "gradwire/client/shape_cache.h"
#include "gradwire/v1/service.grpc.pb.h"

namespace gradwire::client {

struct BackwardOptions {
  bool retain = false;                              // keep the context for another backward
  bool skip_grad_input = false;                     // first layer: no grad_input needed
  std::optional<HostTensor> grad_layernorm_output;  // with return_layernorm_output
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
  WireForm wire_dtype_;
  // The client's: under the exact wire, a forward's input to a module it knows to take FP8 codes
  // crosses as E4M3 (a module it has not seen yet: F32), and a backward's grad_output as its FP8
  // cast where the context's module is known: the client's own contexts, and those of training
  // forwards sent here, noted as their answers are read.
  std::shared_ptr<ShapeCache> shapes_;
  // Training forwards sent with SendForward and not yet answered: request id -> their module and
  // input elements (grad_input's).
  std::mutex forwards_mu_;
  std::unordered_map<uint64_t, std::pair<std::string, int64_t>> forwards_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::TrainRequest, v1::TrainResponse>> stream_;
  bool writes_done_ = false;
};

}  // namespace gradwire::client
