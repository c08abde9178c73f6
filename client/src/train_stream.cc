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
  if (training && shapes_) {
    std::lock_guard<std::mutex> lock(forwards_mu_);
    forwards_[request_id] = {module_id, input.numel()};
  }
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
  const TensorForm out_form =
      GradOutputForm(wire_dtype_, grad_output, known ? known->fp8_grad : ExactGradForm::kNone,
                     known && known->bias, known ? known->fp8_block : 0);
  *b->mutable_grad_output() = ToWire(grad_output, out_form);
  SetColumnSums(out_form, b);
  b->set_retain(options.retain);
  b->set_skip_grad_input(options.skip_grad_input);
  b->set_grad_input_dtype(ToProto(wire_dtype_.dtype));
  return Send(req);
}

std::optional<v1::TrainResponse> TrainStream::Read() {
  v1::TrainResponse resp;
  if (!stream_->Read(&resp)) return std::nullopt;
  std::pair<std::string, int64_t> sent;
  {
    std::lock_guard<std::mutex> lock(forwards_mu_);
    auto it = forwards_.find(resp.request_id());
    if (it != forwards_.end()) {
      sent = std::move(it->second);
      forwards_.erase(it);
    }
  }
  // A training forward's context: its backward (here or through the client) knows its module.
  if (!sent.first.empty() && resp.code() == 0 && resp.has_forward() &&
      !resp.forward().context_id().empty()) {
    shapes_->NoteContext(resp.forward().context_id(), sent.first, sent.second);
  }
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
