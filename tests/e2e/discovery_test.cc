// Discovery with the real gradwire-server binary: grpc.health.v1 and server reflection.
#include <google/protobuf/descriptor.pb.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "gradwire/client/client.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "server_process.h"

namespace gradwire {
namespace {

namespace refl = ::grpc::reflection::v1alpha;
using testing::ServerProcess;

class DiscoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/gradwire-discovery-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
    server_ = std::make_unique<ServerProcess>(dir_, std::vector<std::string>{});
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
  }
  void TearDown() override {
    server_.reset();
    EXPECT_EQ(std::system(("rm -rf " + dir_).c_str()), 0);
  }

  // One request on the reflection stream.
  refl::ServerReflectionResponse Ask(const refl::ServerReflectionRequest& req) {
    auto stub = refl::ServerReflection::NewStub(channel_);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto stream = stub->ServerReflectionInfo(&ctx);
    EXPECT_TRUE(stream->Write(req));
    stream->WritesDone();
    refl::ServerReflectionResponse resp;
    EXPECT_TRUE(stream->Read(&resp));
    EXPECT_TRUE(stream->Finish().ok());
    return resp;
  }

  std::string dir_;
  std::unique_ptr<ServerProcess> server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(DiscoveryTest, ReflectionListsAndDescribesTheServices) {
  refl::ServerReflectionRequest list;
  list.set_list_services("*");
  const refl::ServerReflectionResponse services = Ask(list);
  std::vector<std::string> names;
  for (const auto& s : services.list_services_response().service()) names.push_back(s.name());
  EXPECT_NE(std::find(names.begin(), names.end(), "gradwire.v1.Gradwire"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "grpc.health.v1.Health"), names.end());

  refl::ServerReflectionRequest symbol;
  symbol.set_file_containing_symbol("gradwire.v1.Gradwire");
  const refl::ServerReflectionResponse file = Ask(symbol);
  ASSERT_GE(file.file_descriptor_response().file_descriptor_proto_size(), 1);
  google::protobuf::FileDescriptorProto proto;
  ASSERT_TRUE(proto.ParseFromString(file.file_descriptor_response().file_descriptor_proto(0)));
  EXPECT_EQ(proto.name(), "gradwire/v1/service.proto");
  ASSERT_EQ(proto.service_size(), 1);
  bool has_forward = false;
  for (const auto& m : proto.service(0).method()) has_forward |= m.name() == "Forward";
  EXPECT_TRUE(has_forward);
}

TEST_F(DiscoveryTest, HealthIsServingForTheServerAndTheGradwireService) {
  client::ClientOptions options;
  options.server = server_->address();
  client::Client client(options);
  EXPECT_EQ(client.CheckHealth("").value_or("error"), "SERVING");
  EXPECT_EQ(client.CheckHealth("gradwire.v1.Gradwire").value_or("error"), "SERVING");
  EXPECT_EQ(client.CheckHealth("no.such.Service").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace gradwire
