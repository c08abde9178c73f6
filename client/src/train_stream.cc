#include "gradwire/client/train_stream.h"

#include "call_util.h"

namespace gradwire::client {

using internal::FromGrpc;

TrainStream::~TrainStream() {
  if (stream_) {
    ctx_.TryCancel();
    stream_->Finish();
  }
}

bool TrainStream::Send(const v1::TrainRequest& request) {
  return !writes_done_ && stream_->Write(request);
}

bool TrainStream::SendForward(uint64_t request_id, const std::string& module_id,
                              const HostTensor& input, bool training) {
  v1::TrainRequest req;
  req.set_request_id(request_id);
  v1::ForwardRequest* f = req.mutable_forward();
  f->set_module_id(module_id);
  // As Client::Forward forms it, from the modules this client has seen.
  const std::optional<ModuleShape> known = shapes_ ? shapes_->Find(module_id) : std::nullopt;
  const TensorForm in_form =
      InputForm(wire_dtype_, input, known.has_value(), known && known->fp8_input,
                known ? known->fp8_block : 0, training);
  *f->mutable_input() = ToWire(input, in_form);
  f->set_training(training);
  f->set_output_dtype(ToProto(wire_dtype_.dtype));
  return Send(req);
}

bool TrainStream::SendBackward(uint64_t request_id, const std::string& context_id,
                               const HostTensor& grad_output, BackwardOptions options) {
  v1::TrainRequest req;
  req.set_request_id(request_id);
  v1::BackwardRequest* b = req.mutable_backward();
  b->set_context_id(context_id);
  // FP8 gradients scale as the module's recipe does where the context's module is known.
  const std::string module_id = shapes_ ? shapes_->ModuleOfContext(context_id) : std::string();
  const std::optional<ModuleShape> known =
      module_id.empty() ? std::nullopt : shapes_->Find(module_id);
  *b->mutable_grad_output() =
      ToWire(grad_output, GradientForm(wire_dtype_, known ? known->fp8_block : 0));
  b->set_retain(options.retain);
  b->set_skip_grad_input(options.skip_grad_input);
  b->set_grad_input_dtype(ToProto(wire_dtype_.dtype));
  return Send(req);
}

std::optional<v1::TrainResponse> TrainStream::Read() {
  v1::TrainResponse resp;
  if (!stream_->Read(&resp)) return std::nullopt;
  return resp;
}

absl::Status TrainStream::Finish() {
  if (!writes_done_) {
    writes_done_ = true;
    stream_->WritesDone();
  }
  v1::TrainResponse drain;
  while (stream_->Read(&drain)) {
  }
  const grpc::Status s = stream_->Finish();
  stream_.reset();
  return FromGrpc("Train", s);
}

void TrainStream::Cancel() { ctx_.TryCancel(); }

}  // namespace gradwire::client
