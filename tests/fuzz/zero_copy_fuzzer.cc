// libFuzzer target: the zero-copy message parser (gradwire/wire/zero_copy.h) against protobuf's
// own parser. The first byte picks the message type and how many slices the rest is cut into;
// the rest is the encoding. Parse must accept exactly what protobuf accepts, and then give the
// same fields and the same tensor bytes; re-serialising with SerializeMoving must give bytes that
// protobuf parses to the same message again.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "google/protobuf/stubs/logging.h"
#include "gradwire/v1/service.pb.h"
#include "gradwire/wire/zero_copy.h"

namespace {

namespace v1 = gradwire::v1;
namespace wire = gradwire::wire;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "zero_copy_fuzzer invariant broken: %s\n", what.c_str());
  std::abort();
}

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  if (!b.Dump(&slices).ok()) Fail("Dump");
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// The data (field 3) of the message in top-level field `field`, or "" when unset.
std::string DataOf(const google::protobuf::Message& m, int field) {
  const auto* fd = m.GetDescriptor()->FindFieldByNumber(field);
  if (fd == nullptr || !m.GetReflection()->HasField(m, fd)) return {};
  const google::protobuf::Message& sub = m.GetReflection()->GetMessage(m, fd);
  const auto* data = sub.GetDescriptor()->FindFieldByNumber(3);
  return sub.GetReflection()->GetString(sub, data);
}

void ClearData(google::protobuf::Message* m, int field) {
  const auto* fd = m->GetDescriptor()->FindFieldByNumber(field);
  if (fd == nullptr || !m->GetReflection()->HasField(*m, fd)) return;
  google::protobuf::Message* sub = m->GetReflection()->MutableMessage(m, fd);
  sub->GetReflection()->ClearField(sub, sub->GetDescriptor()->FindFieldByNumber(3));
}

template <typename M>
void Check(const std::string& bytes, int pieces, std::initializer_list<int> fields) {
  std::vector<grpc::Slice> slices;
  const size_t step = bytes.size() / size_t(pieces) + 1;
  for (size_t at = 0; at < bytes.size(); at += step) {
    slices.emplace_back(bytes.data() + at, std::min(step, bytes.size() - at));
  }
  const grpc::ByteBuffer buffer(slices.data(), slices.size());
  M expected, header;
  const bool protobuf_ok = expected.ParseFromString(bytes);
  wire::ReceivedMessage received;
  const absl::Status s = received.Parse(buffer, &header, fields);
  if (s.ok() != protobuf_ok) Fail("accepts differently from protobuf: " + s.ToString());
  if (!s.ok()) return;
  for (int f : fields) {
    if (std::string(received.data(f)) != DataOf(expected, f)) Fail("tensor bytes differ");
  }
  M stripped = expected;
  for (int f : fields) ClearData(&stripped, f);
  if (header.SerializeAsString() != stripped.SerializeAsString()) Fail("fields differ");
  // Out again without the copy, and back through protobuf.
  M moved = expected;
  grpc::ByteBuffer out;
  wire::SerializeMoving(&moved, fields, &out);
  M again;
  if (!again.ParseFromString(Flatten(out))) Fail("SerializeMoving made an invalid encoding");
  if (again.SerializeAsString() != expected.SerializeAsString()) Fail("SerializeMoving changed it");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in string fields is logged
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int pieces = 1 + (data[0] >> 2);
  const std::string bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] & 3) {
    case 0:
      Check<v1::ForwardRequest>(bytes, pieces, wire::kForwardRequestTensors);
      break;
    case 1:
      Check<v1::BackwardRequest>(bytes, pieces, wire::kBackwardRequestTensors);
      break;
    case 2:
      Check<v1::ForwardResponse>(bytes, pieces, wire::kForwardResponseTensors);
      break;
    default:
      Check<v1::ForwardRequestPart>(bytes, pieces, wire::kPartChunk);
  }
  return 0;
}
