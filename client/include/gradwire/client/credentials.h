// How a C++ client proves who it is: the channel's TLS credentials and the bearer token.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gradwire/client/options.h"

namespace gradwire::client {

// The channel credentials `options` ask for: TLS when a CA bundle, client certificate or key is
// given (each read from its file), plaintext otherwise. Throws std::runtime_error when a file
// cannot be read.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const ClientOptions& options);

// The bearer token a command-line tool uses: the first line of `token_file` (trailing space
// trimmed; INVALID_ARGUMENT when unreadable or empty), or else $GRADWIRE_TOKEN, or else none.
absl::StatusOr<std::string> ResolveToken(const std::string& token_file);

}  // namespace gradwire::client
