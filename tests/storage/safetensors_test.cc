// The safetensors reader/writer: bit-exact round trips, byte layout against the format's
// specification, and rejection of malformed or truncated input without crashes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gradwire/storage/safetensors_file.h"
#include "temp_dir.h"

namespace gradwire::storage {
namespace {

namespace fs = std::filesystem;

constexpr StDType kAllDTypes[] = {StDType::kF32, StDType::kBF16, StDType::kF16, StDType::kF8E4M3,
                                  StDType::kF8E5M2};

std::mt19937_64& Rng() {
  static std::mt19937_64* rng = [] {
    std::random_device rd;
    const uint64_t seed = (uint64_t{rd()} << 32) ^ rd();
    std::printf("safetensors_test random seed: %llu\n", static_cast<unsigned long long>(seed));
    return new std::mt19937_64(seed);
  }();
  return *rng;
}

std::string RandomBytes(size_t n) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(byte(Rng()));
  // A tensor that happens to be all zeros would not show bytes landing in the wrong place.
  if (n > 0 && s.find_first_not_of('\0') == std::string::npos) s[0] = '\x5a';
  return s;
}

int64_t Numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

StTensor RandomTensor(std::string name, StDType dtype, std::vector<int64_t> shape) {
  StTensor t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.data = RandomBytes(static_cast<size_t>(Numel(t.shape) * StDTypeSize(dtype)));
  return t;
}

std::string Le64(uint64_t v) {
  std::string s;
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  return s;
}

// A file per the specification, built without the serializer.
std::string MakeFile(const std::string& header_json, const std::string& data) {
  return Le64(header_json.size()) + header_json + data;
}

uint64_t HeaderLengthOf(const std::string& file) {
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t{static_cast<unsigned char>(file[i])} << (8 * i);
  return n;
}

void ExpectSameTensors(const std::vector<StTensor>& actual, const std::vector<StTensor>& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    SCOPED_TRACE(expected[i].name);
    EXPECT_EQ(actual[i].name, expected[i].name);
    EXPECT_EQ(actual[i].dtype, expected[i].dtype);
    EXPECT_EQ(actual[i].shape, expected[i].shape);
    EXPECT_TRUE(actual[i].data == expected[i].data) << "data differs";
  }
}

// Parses from an allocation of exactly bytes.size(), so any read past the end is an ASan report.
absl::StatusOr<std::vector<StTensor>> ParseExact(const std::string& bytes,
                                                 std::map<std::string, std::string>* metadata) {
  std::vector<char> copy(bytes.begin(), bytes.end());
  return ParseSafetensors(absl::string_view(copy.data(), copy.size()), metadata);
}

::testing::AssertionResult IsInvalidWith(const absl::Status& status,
                                         const std::vector<std::string>& words) {
  if (status.code() != absl::StatusCode::kInvalidArgument) {
    return ::testing::AssertionFailure() << "expected INVALID_ARGUMENT, got " << status;
  }
  for (const std::string& w : words) {
    if (std::string(status.message()).find(w) == std::string::npos) {
      return ::testing::AssertionFailure() << "message lacks \"" << w << "\": " << status;
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(SafetensorsTest, RoundTripIsBitExactForEveryDTypeAndShape) {
  const std::vector<std::vector<int64_t>> shapes = {
      {}, {1}, {7}, {1, 1, 1}, {3, 1}, {13, 11}, {2, 3, 5, 7}, {1, 17, 1}, {31}, {5, 1, 3}, {0, 3}};
  std::vector<StTensor> tensors;
  for (StDType dtype : kAllDTypes) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      tensors.push_back(RandomTensor(std::string(StDTypeName(dtype)) + "." + std::to_string(i),
                                     dtype, shapes[i]));
    }
  }
  absl::StatusOr<std::string> bytes = SerializeSafetensors(tensors, {});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<std::vector<StTensor>> parsed = ParseExact(*bytes, nullptr);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  // Input order is data order. Each zero-sized tensor shares its begin with the next tensor but
  // sorts first by its end, so the order survives.
  ExpectSameTensors(*parsed, tensors);
  // Serializing the parsed tensors reproduces the same bytes.
  absl::StatusOr<std::string> again = SerializeSafetensors(*parsed, {});
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(*again == *bytes);
}

TEST(SafetensorsTest, ScalarShapeHoldsOneElement) {
  for (StDType dtype : kAllDTypes) {
    SCOPED_TRACE(std::string(StDTypeName(dtype)));
    StTensor scalar = RandomTensor("s", dtype, {});
    ASSERT_EQ(static_cast<int64_t>(scalar.data.size()), StDTypeSize(dtype));
    absl::StatusOr<std::string> bytes = SerializeSafetensors({scalar}, {});
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_NE(bytes->find("\"shape\":[]"), std::string::npos);
    absl::StatusOr<std::vector<StTensor>> parsed = ParseExact(*bytes, nullptr);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    ExpectSameTensors(*parsed, {scalar});
    // A scalar without its one element is refused.
    scalar.data.clear();
    EXPECT_TRUE(IsInvalidWith(SerializeSafetensors({scalar}, {}).status(), {"'s'", "needs"}));
  }
}

TEST(SafetensorsTest, MetadataRoundTrips) {
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"quotes \"and\" \\backslashes\\", "new\nline\ttab"},
      {"unicode \xce\xbb", "\xe2\x9c\x93 \xf0\x9f\x98\x80"},
      {"empty", ""},
      {"random", std::to_string(Rng()())}};
  const std::vector<StTensor> tensors = {RandomTensor("w", StDType::kBF16, {3, 5})};
  absl::StatusOr<std::string> bytes = SerializeSafetensors(tensors, metadata);
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  std::map<std::string, std::string> got = {{"stale", "entry"}};
  absl::StatusOr<std::vector<StTensor>> parsed = ParseExact(*bytes, &got);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(got, metadata);
  ExpectSameTensors(*parsed, tensors);

  // No metadata: the key is left out and the output map comes back empty.
  bytes = SerializeSafetensors(tensors, {});
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(bytes->find("__metadata__"), std::string::npos);
  parsed = ParseExact(*bytes, &got);
  ASSERT_TRUE(parsed.ok());
  EXPECT_TRUE(got.empty());
}

TEST(SafetensorsTest, DataSectionStartsAtMultipleOf8) {
  // Name lengths 1..24 move the unpadded header length through every residue mod 8.
  for (int len = 1; len <= 24; ++len) {
    SCOPED_TRACE(len);
    const std::vector<StTensor> tensors = {RandomTensor(std::string(len, 'n'), StDType::kF16, {3}),
                                           RandomTensor("x", StDType::kF8E5M2, {5})};
    absl::StatusOr<std::string> bytes = SerializeSafetensors(tensors, {});
    ASSERT_TRUE(bytes.ok());
    const uint64_t n = HeaderLengthOf(*bytes);
    EXPECT_EQ(n % 8, 0u);
    ASSERT_EQ(bytes->size(), 8 + n + 6 + 5);
    // Padding is spaces after the closing brace.
    const std::string header = bytes->substr(8, n);
    const size_t brace = header.rfind('}');
    ASSERT_NE(brace, std::string::npos);
    EXPECT_EQ(header.find_first_not_of(' ', brace + 1), std::string::npos);
    EXPECT_LT(header.size() - brace - 1, 8u);
    EXPECT_TRUE(bytes->substr(8 + n) == tensors[0].data + tensors[1].data);
  }
}

TEST(SafetensorsTest, SerializerWritesTheSpecifiedBytes) {
  StTensor w = RandomTensor("w", StDType::kF32, {2});
  StTensor b = RandomTensor("b", StDType::kF8E4M3, {1, 3});
  absl::StatusOr<std::string> bytes = SerializeSafetensors({w, b}, {{"k", "v"}});
  ASSERT_TRUE(bytes.ok());
  std::string header = R"({"__metadata__":{"k":"v"},)"
                       R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F8_E4M3","shape":[1,3],"data_offsets":[8,11]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  EXPECT_EQ(*bytes, MakeFile(header, w.data + b.data));
}

TEST(SafetensorsTest, HandBuiltFileParses) {
  // An unpadded header whose length is not a multiple of 8, tensors listed out of data order, an
  // unknown field, whitespace, and a zero-sized tensor.
  const std::string data = RandomBytes(4 + 4 + 24);
  const std::string header =
      "{ \"b\": {\"dtype\": \"BF16\", \"shape\": [2], \"data_offsets\": [4, 8]},\n"
      "  \"__metadata__\": {\"format\": \"pt\"},\n"
      "  \"a\": {\"data_offsets\": [0, 4], \"shape\": [2, 2], \"dtype\": \"F8_E5M2\"},\n"
      "  \"z\": {\"dtype\": \"F16\", \"shape\": [0, 5], \"data_offsets\": [32, 32]},\n"
      "  \"c\": {\"dtype\": \"F32\", \"shape\": [3, 1, 2], \"data_offsets\": [8, 32],"
      " \"extra\": {\"nested\": [[1], {\"x\": null}]}}}";
  ASSERT_NE(header.size() % 8, 0u);
  std::map<std::string, std::string> metadata;
  absl::StatusOr<std::vector<StTensor>> parsed = ParseExact(MakeFile(header, data), &metadata);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(parsed->size(), 4u);
  const StTensor& a = (*parsed)[0];
  const StTensor& b = (*parsed)[1];
  const StTensor& c = (*parsed)[2];
  const StTensor& z = (*parsed)[3];
  EXPECT_EQ(a.name, "a");
  EXPECT_EQ(a.dtype, StDType::kF8E5M2);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_TRUE(a.data == data.substr(0, 4));
  EXPECT_EQ(b.name, "b");
  EXPECT_EQ(b.dtype, StDType::kBF16);
  EXPECT_EQ(b.shape, (std::vector<int64_t>{2}));
  EXPECT_TRUE(b.data == data.substr(4, 4));
  EXPECT_EQ(c.name, "c");
  EXPECT_EQ(c.dtype, StDType::kF32);
  EXPECT_EQ(c.shape, (std::vector<int64_t>{3, 1, 2}));
  EXPECT_TRUE(c.data == data.substr(8, 24));
  EXPECT_EQ(z.name, "z");
  EXPECT_EQ(z.dtype, StDType::kF16);
  EXPECT_EQ(z.shape, (std::vector<int64_t>{0, 5}));
  EXPECT_TRUE(z.data.empty());
}

TEST(SafetensorsTest, EmptyFileWithNoTensorsParses) {
  absl::StatusOr<std::vector<StTensor>> parsed = ParseExact(MakeFile("{}", ""), nullptr);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->empty());
  absl::StatusOr<std::string> bytes = SerializeSafetensors({}, {});
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(*bytes, MakeFile("{}      ", ""));
}

TEST(SafetensorsTest, LengthPrefixErrors) {
  for (size_t len = 0; len < 8; ++len) {
    EXPECT_TRUE(IsInvalidWith(ParseExact(std::string(len, '\x01'), nullptr).status(),
                              {"shorter than the 8-byte"}));
  }
  EXPECT_TRUE(IsInvalidWith(ParseExact(Le64(3) + "{}", nullptr).status(),
                            {"header length 3", "larger than the 2 bytes"}));
  EXPECT_TRUE(IsInvalidWith(ParseExact(Le64((100 << 20) + 1) + "{}", nullptr).status(),
                            {"header length 104857601", "100 MiB"}));
  EXPECT_TRUE(IsInvalidWith(ParseExact(Le64(~uint64_t{0}) + "{}", nullptr).status(),
                            {"header length 18446744073709551615", "100 MiB"}));
  EXPECT_TRUE(IsInvalidWith(ParseExact(Le64(0), nullptr).status(), {"not valid JSON"}));
}

struct MalformedCase {
  const char* what;
  std::string header;
  size_t data_size;
  std::vector<std::string> words;
};

TEST(SafetensorsTest, MalformedHeadersAreInvalidArgumentNamingTheProblem) {
  const std::string ok_a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::vector<MalformedCase> cases = {
      {"truncated JSON", R"({"a":)", 0, {"not valid JSON"}},
      {"trailing garbage", "{} x", 0, {"not valid JSON"}},
      {"NUL padding", std::string("{}\0\0\0\0\0\0", 8), 0, {"not valid JSON"}},
      {"junk after NUL", std::string("{}\0junk", 7), 0, {"not valid JSON", "NUL byte at"}},
      {"invalid UTF-8", "{\"\xff\":{}}", 0, {"not valid JSON"}},
      {"array header", "[1, 2]", 0, {"not a JSON object", "an array"}},
      {"string header", "\"x\"", 0, {"not a JSON object"}},
      {"entry not object", R"({"a":[1]})", 0, {"tensor 'a'", "must be a JSON object"}},
      {"entry null", R"({"a":null})", 0, {"tensor 'a'", "must be a JSON object", "null"}},
      {"missing dtype",
       R"({"a":{"shape":[2],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "missing \"dtype\""}},
      {"dtype number",
       R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "\"dtype\" must be a string"}},
      {"unknown dtype",
       R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "unknown", "'F64'"}},
      {"lower-case dtype",
       R"({"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "unknown", "'f32'"}},
      {"missing shape",
       R"({"a":{"dtype":"F32","data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "missing \"shape\""}},
      {"shape not array",
       R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "\"shape\" must be an array"}},
      {"shape float",
       R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "\"shape\" element 0", "non-integer"}},
      {"shape string",
       R"({"a":{"dtype":"F32","shape":[1,"2"],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "\"shape\" element 1", "a string"}},
      {"shape nested",
       R"({"a":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "\"shape\" element 0", "an array"}},
      {"negative dim",
       R"({"a":{"dtype":"F32","shape":[2,-3],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "negative dimension -3"}},
      {"numel overflow",
       R"({"a":{"dtype":"F32","shape":[1048576,1048576],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "overflow"}},
      {"dim 2^40",
       R"({"a":{"dtype":"F8_E4M3","shape":[0,1099511627776],"data_offsets":[0,0]}})",
       0,
       {"tensor 'a'", "overflow"}},
      {"dim 2^64-1",
       R"({"a":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "overflow"}},
      {"dim beyond u64",
       R"({"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "\"shape\" element 0"}},
      {"missing offsets",
       R"({"a":{"dtype":"F32","shape":[2]}})",
       8,
       {"tensor 'a'", "missing \"data_offsets\""}},
      {"offsets object",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":{"0":8}}})",
       8,
       {"tensor 'a'", "\"data_offsets\" must be an array of two"}},
      {"one offset",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8]}})",
       8,
       {"tensor 'a'", "\"data_offsets\" must be exactly two", "found 1"}},
      {"three offsets",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})",
       8,
       {"tensor 'a'", "\"data_offsets\" must be exactly two", "found more"}},
      {"negative offset",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})",
       8,
       {"tensor 'a'", "\"data_offsets\" element 0", "negative"}},
      {"float offset",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}})",
       8,
       {"tensor 'a'", "\"data_offsets\" element 1", "non-integer"}},
      {"begin after end",
       R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})",
       8,
       {"tensor 'a'", "[8, 0]", "begin after end"}},
      {"end beyond data",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       4,
       {"tensor 'a'", "[0, 8]", "beyond the data section of 4 bytes"}},
      {"size mismatch",
       R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "span 8 bytes", "needs 12"}},
      {"dtype size mismatch",
       R"({"a":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "span 8 bytes", "needs 4"}},
      {"overlap",
       "{" + ok_a + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12,
       {"tensor 'b'", "overlap", "tensor 'a'"}},
      {"identical ranges",
       "{" + ok_a + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8,
       {"tensor 'b'", "overlap"}},
      {"hole",
       "{" + ok_a + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
       20,
       {"[8, 12)", "not covered", "tensor 'b'"}},
      {"hole at start",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12,
       {"[0, 4)", "not covered"}},
      {"trailing bytes", "{" + ok_a + "}", 9, {"[8, 9)", "not covered"}},
      {"data but no tensors", "{}", 3, {"[0, 3)", "not covered"}},
      {"empty name", R"({"":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8, {"empty name"}},
      {"duplicate name", "{" + ok_a + "," + ok_a + "}", 8, {"'a'", "appears twice"}},
      {"duplicate field",
       R"({"a":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}})",
       8,
       {"tensor 'a'", "\"dtype\" appears twice"}},
      {"metadata array", R"({"__metadata__":["x"]})", 0, {"\"__metadata__\"", "an array"}},
      {"metadata string", R"({"__metadata__":"x"})", 0, {"\"__metadata__\"", "object of strings"}},
      {"metadata value number",
       R"({"__metadata__":{"k":1}})",
       0,
       {"\"__metadata__\"", "key 'k'", "must be a string"}},
      {"metadata value object",
       R"({"__metadata__":{"k":{}}})",
       0,
       {"\"__metadata__\"", "key 'k'", "an object"}},
      {"metadata twice",
       R"({"__metadata__":{},"__metadata__":{}})",
       0,
       {"\"__metadata__\"", "twice"}},
      {"metadata key twice", R"({"__metadata__":{"k":"1","k":"2"}})", 0, {"'k'", "twice"}},
  };
  for (const MalformedCase& c : cases) {
    SCOPED_TRACE(c.what);
    std::map<std::string, std::string> metadata = {{"untouched", "yes"}};
    const absl::StatusOr<std::vector<StTensor>> parsed =
        ParseExact(MakeFile(c.header, RandomBytes(c.data_size)), &metadata);
    EXPECT_TRUE(IsInvalidWith(parsed.status(), c.words));
    EXPECT_EQ(metadata.count("untouched"), 1u);
  }
}

TEST(SafetensorsTest, HostileNestingAndLongNamesStayBounded) {
  // Nesting deep enough to overflow a recursive parser's stack, where the format allows it: in
  // an unknown tensor field, which is skipped rather than stored.
  const std::string deep(200000, '[');
  EXPECT_TRUE(
      IsInvalidWith(ParseExact(MakeFile(deep, ""), nullptr).status(), {"not a JSON object"}));
  const std::string skipped = R"({"a":{"dtype":"F8_E4M3","shape":[],"data_offsets":[0,1],"x":)" +
                              deep + std::string(200000, ']') + "}}";
  absl::StatusOr<std::vector<StTensor>> parsed = ParseExact(MakeFile(skipped, "\x7f"), nullptr);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->size(), 1u);
  EXPECT_EQ((*parsed)[0].data, "\x7f");
  // A huge name is quoted only in part.
  const std::string long_name(1 << 20, 'q');
  const absl::Status status =
      ParseExact(MakeFile("{\"" + long_name + "\":7}", ""), nullptr).status();
  EXPECT_TRUE(IsInvalidWith(status, {"tensor 'qqqq", "must be a JSON object"}));
  EXPECT_LT(status.message().size(), 300u);
}

TEST(SafetensorsTest, EveryTruncationIsRejected) {
  const std::vector<StTensor> tensors = {RandomTensor("w", StDType::kF32, {3, 2}),
                                         RandomTensor("b", StDType::kF8E4M3, {5}),
                                         RandomTensor("s", StDType::kBF16, {})};
  absl::StatusOr<std::string> bytes = SerializeSafetensors(tensors, {{"step", "17"}});
  ASSERT_TRUE(bytes.ok());
  for (size_t len = 0; len < bytes->size(); ++len) {
    SCOPED_TRACE(len);
    EXPECT_EQ(ParseExact(bytes->substr(0, len), nullptr).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(ParseExact(*bytes, nullptr).ok());
  // One extra byte at the end is not covered by any tensor.
  EXPECT_TRUE(IsInvalidWith(ParseExact(*bytes + "x", nullptr).status(), {"not covered"}));
}

TEST(SafetensorsTest, CorruptedBytesNeverCrash) {
  const std::vector<StTensor> tensors = {RandomTensor("weight", StDType::kF16, {4, 3}),
                                         RandomTensor("scale", StDType::kF32, {1})};
  absl::StatusOr<std::string> bytes = SerializeSafetensors(tensors, {{"a", "b"}});
  ASSERT_TRUE(bytes.ok());
  std::uniform_int_distribution<size_t> pos(0, bytes->size() - 1);
  std::uniform_int_distribution<int> byte(0, 255);
  for (int i = 0; i < 3000; ++i) {
    std::string corrupt = *bytes;
    for (int k = 1 + i % 3; k > 0; --k) corrupt[pos(Rng())] = static_cast<char>(byte(Rng()));
    const absl::Status status = ParseExact(corrupt, nullptr).status();
    EXPECT_TRUE(status.ok() || status.code() == absl::StatusCode::kInvalidArgument) << status;
  }
  for (int i = 0; i < 500; ++i) {
    const absl::Status status = ParseExact(RandomBytes(i), nullptr).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  }
}

TEST(SafetensorsTest, SerializeRejectsBadTensors) {
  const StTensor good = RandomTensor("good", StDType::kF32, {2});
  auto with = [&](auto edit) {
    StTensor t = RandomTensor("t", StDType::kF16, {3});
    edit(t);
    return SerializeSafetensors({good, t}, {}).status();
  };
  EXPECT_TRUE(IsInvalidWith(with([](StTensor& t) { t.name.clear(); }), {"#1", "empty name"}));
  EXPECT_TRUE(IsInvalidWith(with([](StTensor& t) { t.name = "good"; }), {"'good'", "duplicate"}));
  EXPECT_TRUE(IsInvalidWith(with([](StTensor& t) { t.name = "__metadata__"; }), {"reserved"}));
  EXPECT_TRUE(IsInvalidWith(with([](StTensor& t) { t.name = "bad\xc3"; }), {"UTF-8"}));
  EXPECT_TRUE(IsInvalidWith(with([](StTensor& t) { t.data.pop_back(); }),
                            {"tensor 't'", "data has 5 bytes", "needs 6"}));
  EXPECT_TRUE(IsInvalidWith(with([](StTensor& t) { t.data += "xy"; }),
                            {"tensor 't'", "data has 8 bytes", "needs 6"}));
  EXPECT_TRUE(IsInvalidWith(with([](StTensor& t) {
                              t.shape = {3, -1};
                            }),
                            {"tensor 't'", "negative dimension -1"}));
  EXPECT_TRUE(IsInvalidWith(with([](StTensor& t) {
                              t.shape = {1 << 20, 1 << 20};
                            }),
                            {"tensor 't'", "overflow"}));
  EXPECT_TRUE(IsInvalidWith(with([](StTensor& t) { t.dtype = static_cast<StDType>(99); }),
                            {"tensor 't'", "invalid dtype"}));
  EXPECT_TRUE(IsInvalidWith(SerializeSafetensors({good}, {{"k", "\xe0\x80\x80"}}).status(),
                            {"metadata key 'k'", "UTF-8"}));
  EXPECT_TRUE(SerializeSafetensors({good}, {}).ok());
}

class SafetensorsFileTest : public TempDirTest {};

TEST_F(SafetensorsFileTest, WriteThenReadRoundTripsAndLeavesNoTempFile) {
  const std::string path = dir_ / "model.safetensors";
  const std::vector<StTensor> first = {RandomTensor("w", StDType::kF8E4M3, {7, 3}),
                                       RandomTensor("b", StDType::kF32, {7})};
  ASSERT_TRUE(WriteSafetensorsFile(path, first, {{"version", "1"}}).ok());
  std::map<std::string, std::string> metadata;
  absl::StatusOr<std::vector<StTensor>> read = ReadSafetensorsFile(path, &metadata);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameTensors(*read, first);
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{{"version", "1"}}));
  // The file holds exactly what the serializer produces.
  std::ifstream in(path, std::ios::binary);
  const std::string on_disk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(on_disk == *SerializeSafetensors(first, {{"version", "1"}}));

  // Overwriting replaces the whole file.
  const std::vector<StTensor> second = {RandomTensor("only", StDType::kBF16, {2, 11})};
  ASSERT_TRUE(WriteSafetensorsFile(path, second, {}).ok());
  read = ReadSafetensorsFile(path, &metadata);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameTensors(*read, second);
  EXPECT_TRUE(metadata.empty());
  EXPECT_EQ(DirEntries(), std::vector<std::string>{"model.safetensors"});
}

TEST_F(SafetensorsFileTest, WriteToMissingDirectoryFailsNamingThePath) {
  const std::string path = dir_ / "no_such_dir" / "m.safetensors";
  const absl::Status status =
      WriteSafetensorsFile(path, {RandomTensor("w", StDType::kF16, {2})}, {});
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_NE(std::string(status.message()).find(path), std::string::npos) << status;
  EXPECT_TRUE(DirEntries().empty());
}

TEST_F(SafetensorsFileTest, FailedWritesLeaveNoTempFile) {
  // rename(2) cannot replace a directory with a file.
  const fs::path target = dir_ / "is_a_dir";
  fs::create_directory(target);
  const absl::Status status =
      WriteSafetensorsFile(target, {RandomTensor("w", StDType::kF16, {2})}, {});
  EXPECT_FALSE(status.ok());
  EXPECT_NE(std::string(status.message()).find(target.string()), std::string::npos) << status;
  EXPECT_EQ(DirEntries(), std::vector<std::string>{"is_a_dir"});
  // Invalid tensors fail before any file is created.
  const absl::Status invalid = WriteSafetensorsFile(dir_ / "x.safetensors", {StTensor{}}, {});
  EXPECT_TRUE(IsInvalidWith(invalid, {"x.safetensors", "empty name"}));
  EXPECT_EQ(DirEntries(), std::vector<std::string>{"is_a_dir"});
}

TEST_F(SafetensorsFileTest, ReadErrorsNameThePath) {
  const std::string missing = dir_ / "missing.safetensors";
  absl::Status status = ReadSafetensorsFile(missing, nullptr).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound) << status;
  EXPECT_NE(std::string(status.message()).find(missing), std::string::npos) << status;

  status = ReadSafetensorsFile(dir_, nullptr).status();
  EXPECT_TRUE(IsInvalidWith(status, {dir_.string(), "not a regular file"}));

  // Every truncation of a real file on disk is rejected too.
  const std::string path = dir_ / "t.safetensors";
  absl::StatusOr<std::string> bytes =
      SerializeSafetensors({RandomTensor("w", StDType::kF32, {3})}, {{"m", "n"}});
  ASSERT_TRUE(bytes.ok());
  for (size_t len = 0; len < bytes->size(); ++len) {
    SCOPED_TRACE(len);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes->substr(0, len);
    status = ReadSafetensorsFile(path, nullptr).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_NE(std::string(status.message()).find(path), std::string::npos) << status;
  }
}

}  // namespace
}  // namespace gradwire::storage
