#include "gradwire/client/credentials.h"

#include <cctype>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "absl/strings/str_cat.h"

namespace gradwire::client {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const ClientOptions& o) {
  if (o.tls_ca_file.empty() && o.tls_cert_file.empty() && o.tls_key_file.empty()) {
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions tls;
  if (!o.tls_ca_file.empty()) tls.pem_root_certs = ReadFile(o.tls_ca_file);
  if (!o.tls_cert_file.empty()) tls.pem_cert_chain = ReadFile(o.tls_cert_file);
  if (!o.tls_key_file.empty()) tls.pem_private_key = ReadFile(o.tls_key_file);
  return grpc::SslCredentials(tls);
}

absl::StatusOr<std::string> ResolveToken(const std::string& token_file) {
  std::string token;
  if (token_file.empty()) {
    const char* env = std::getenv("GRADWIRE_TOKEN");
    return env ? std::string(env) : std::string();
  }
  std::ifstream in(token_file);
  std::getline(in, token);
  while (!token.empty() && std::isspace(static_cast<unsigned char>(token.back()))) token.pop_back();
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", token_file, ": the first line holds no token"));
  }
  return token;
}

}  // namespace gradwire::client
