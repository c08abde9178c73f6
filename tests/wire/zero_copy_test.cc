// The zero-copy message path against protobuf itself: what SerializeMoving / SerializeReferencing
// produce parses with protobuf to the same message, and ReceivedMessage::Parse agrees with
// protobuf's parser on standard encodings split into slices anywhere, on truncations and on
// random corruptions of them (accepting exactly what protobuf accepts, giving the same fields).
#include "gradwire/wire/zero_copy.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gradwire/v1/service.pb.h"

namespace gradwire::wire {
namespace {

std::string RandomBytes(size_t n, std::mt19937& rng) {
  std::string s(n, '\0');
  for (char& c : s) c = char(rng());
  return s;
}

v1::ForwardRequest Request(size_t bytes, std::mt19937& rng) {
  v1::ForwardRequest r;
  r.set_module_id("0123456789abcdef0123456789abcdef");
  r.set_training(true);
  r.set_output_dtype(v1::BF16);
  v1::Tensor* t = r.mutable_input();
  t->set_dtype(v1::FP8_E4M3);
  t->add_shape(int64_t(bytes));
  t->set_scale_inv(0.125f);
  t->set_data(RandomBytes(bytes, rng));
  return r;
}

std::string Flatten(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(b.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// `bytes` cut into slices at random points (at most `pieces`).
grpc::ByteBuffer Sliced(const std::string& bytes, int pieces, std::mt19937& rng) {
  std::vector<size_t> cuts = {0, bytes.size()};
  for (int i = 1; i < pieces && !bytes.empty(); ++i) cuts.push_back(rng() % bytes.size());
  std::sort(cuts.begin(), cuts.end());
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) {
    slices.emplace_back(bytes.data() + cuts[i], cuts[i + 1] - cuts[i]);
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

// Parse must agree with protobuf: both accept or both refuse, and accepted, the header plus the
// data equal protobuf's message.
void ExpectAgrees(const std::string& bytes, int pieces, std::mt19937& rng) {
  SCOPED_TRACE(absl::CEscape(bytes));
  v1::ForwardRequest expected;
  const bool protobuf_ok = expected.ParseFromString(bytes);
  ReceivedMessage received;
  v1::ForwardRequest header;
  const absl::Status s =
      received.Parse(Sliced(bytes, pieces, rng), &header, kForwardRequestTensors);
  ASSERT_EQ(s.ok(), protobuf_ok) << s;
  if (!s.ok()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return;
  }
  EXPECT_EQ(std::string(received.data(2)), expected.input().data());
  if (expected.has_input()) expected.mutable_input()->clear_data();
  EXPECT_EQ(header.SerializeAsString(), expected.SerializeAsString());
}

TEST(ZeroCopyTest, MovingSerialisationIsTheStandardEncoding) {
  std::mt19937 rng(1);
  for (size_t bytes : {size_t(0), size_t(1), size_t(127), size_t(128), size_t(70000)}) {
    v1::ForwardRequest r = Request(bytes, rng);
    const v1::ForwardRequest original = r;
    grpc::ByteBuffer buffer;
    SerializeMoving(&r, kForwardRequestTensors, &buffer);
    EXPECT_TRUE(r.input().data().empty());     // moved out
    EXPECT_EQ(r.input().scale_inv(), 0.125f);  // the rest stays
    v1::ForwardRequest parsed;
    ASSERT_TRUE(parsed.ParseFromString(Flatten(buffer)));
    EXPECT_EQ(parsed.SerializeAsString(), original.SerializeAsString()) << bytes;
  }
}

TEST(ZeroCopyTest, ResponsesWithTwoTensorsAndReferencedBytes) {
  std::mt19937 rng(2);
  v1::ForwardResponse r;
  r.mutable_output()->set_dtype(v1::F32);
  r.mutable_output()->add_shape(300);
  r.mutable_output()->set_data(RandomBytes(1200, rng));
  r.mutable_layernorm_output()->set_dtype(v1::F16);
  r.mutable_layernorm_output()->add_shape(5);
  r.mutable_layernorm_output()->set_data(RandomBytes(10, rng));
  r.set_context_id("ctx");
  r.set_server_seconds(0.5);
  const v1::ForwardResponse original = r;
  grpc::ByteBuffer moved;
  SerializeMoving(&r, kForwardResponseTensors, &moved);
  ReceivedMessage received;
  v1::ForwardResponse header;
  ASSERT_TRUE(received.Parse(moved, &header, kForwardResponseTensors).ok());
  EXPECT_EQ(std::string(received.data(1)), original.output().data());
  EXPECT_EQ(std::string(received.data(4)), original.layernorm_output().data());
  EXPECT_EQ(header.context_id(), "ctx");
  EXPECT_EQ(header.output().shape(0), 300);
  EXPECT_TRUE(header.output().data().empty());
  // Referencing: the caller's bytes are sent as they are.
  v1::ForwardResponse headers_only = original;
  headers_only.mutable_output()->clear_data();
  headers_only.mutable_layernorm_output()->clear_data();
  int released = 0;
  {
    grpc::ByteBuffer referenced;
    SerializeReferencing(
        headers_only, {{1, original.output().data()}, {4, original.layernorm_output().data()}},
        [&released] { ++released; }, &referenced);
    v1::ForwardResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(Flatten(referenced)));
    EXPECT_EQ(parsed.SerializeAsString(), original.SerializeAsString());
    grpc::ByteBuffer copy = referenced;  // a copy shares the slices
    EXPECT_EQ(released, 0);
  }
  EXPECT_EQ(released, 1);  // once, when the last slice went
}

TEST(ZeroCopyTest, ViewsWhenInOneSliceAndOneCopyWhenSpanning) {
  std::mt19937 rng(3);
  v1::ForwardRequest r = Request(1 << 16, rng);
  const std::string data = r.input().data();
  grpc::ByteBuffer buffer;
  SerializeMoving(&r, kForwardRequestTensors, &buffer);
  ReceivedMessage received;
  v1::ForwardRequest header;
  ASSERT_TRUE(received.Parse(buffer, &header, kForwardRequestTensors).ok());
  EXPECT_EQ(received.copies(), 0);  // its own slice: a view
  EXPECT_EQ(std::string(received.data(2)), data);
  ASSERT_TRUE(
      received.Parse(Sliced(Flatten(buffer), 64, rng), &header, kForwardRequestTensors).ok());
  EXPECT_GT(received.pieces(2).size(), 1u);
  EXPECT_EQ(received.copies(), 0);  // not joined until asked for
  std::string appended;
  received.AppendTo(2, &appended);
  EXPECT_EQ(appended, data);
  EXPECT_EQ(std::string(received.data(2)), data);
  EXPECT_EQ(received.copies(), 1);  // joined once
}

TEST(ZeroCopyTest, AgreesWithProtobufOnSlicedTruncatedAndCorruptedEncodings) {
  std::mt19937 rng(4);
  for (int round = 0; round < 40; ++round) {
    v1::ForwardRequest r = Request(rng() % 300, rng);
    if (round % 3 == 0) r.mutable_input()->add_shape(7);  // packed repeated field
    if (round % 5 == 0) r.clear_input();
    std::string bytes = r.SerializeAsString();
    if (round % 4 == 0) bytes += r.SerializeAsString();  // repeated fields merge
    ExpectAgrees(bytes, 1 + int(rng() % 8), rng);
    for (size_t cut = 0; cut < bytes.size(); cut += 1 + rng() % 7) {
      ExpectAgrees(bytes.substr(0, cut), 1 + int(rng() % 4), rng);
    }
    for (int k = 0; k < 30 && !bytes.empty(); ++k) {
      std::string bad = bytes;
      for (int flips = 1 + int(rng() % 3); flips > 0; --flips)
        bad[rng() % bad.size()] = char(rng());
      ExpectAgrees(bad, 1 + int(rng() % 4), rng);
    }
  }
}

// Groups (unused by this protocol, kept by protobuf among unknown fields) nested to any depth: the
// walk agrees with protobuf's own limit, and very deep nesting is refused without recursion.
TEST(ZeroCopyTest, NestedGroupsAgreeWithProtobuf) {
  std::mt19937 rng(5);
  const std::string input = Request(16, rng).SerializeAsString();
  for (int depth : {1, 50, 99, 100, 101, 150, 5000}) {
    SCOPED_TRACE(depth);
    std::string bytes = input;
    for (int i = 0; i < depth; ++i) bytes += char((7 << 3) | 3);  // start group, field 7
    for (int i = 0; i < depth; ++i) bytes += char((7 << 3) | 4);  // end group, field 7
    ExpectAgrees(bytes, 3, rng);
    // The same inside the tensor's sub-message.
    v1::ForwardRequest r = Request(8, rng);
    std::string sub = r.input().SerializeAsString();
    for (int i = 0; i < depth; ++i) sub += char((9 << 3) | 3);
    for (int i = 0; i < depth; ++i) sub += char((9 << 3) | 4);
    std::string outer;
    outer += char((2 << 3) | 2);
    for (uint64_t n = sub.size();; n >>= 7) {  // varint length
      if (n < 0x80) {
        outer += char(n);
        break;
      }
      outer += char((n & 0x7f) | 0x80);
    }
    outer += sub;
    ExpectAgrees(outer, 2, rng);
  }
}

TEST(ZeroCopyTest, EmptyBufferIsAnEmptyMessage) {
  ReceivedMessage received;
  v1::ForwardRequest header;
  header.set_module_id("stale");
  EXPECT_TRUE(received.Parse(grpc::ByteBuffer(), &header, kForwardRequestTensors).ok());
  EXPECT_TRUE(header.module_id().empty());
  EXPECT_TRUE(received.data(2).empty());
}

}  // namespace
}  // namespace gradwire::wire
