// Bearer-token authentication: tokens map to tenants; every module and context belongs to the
// tenant that created it. Tokens are kept only as SHA-256 digests and compared in constant time.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace gradwire::rpc {

class Authenticator {
 public:
  static constexpr size_t kMinTokenLength = 16;
  static constexpr size_t kMaxTenantLength = 64;

  // One (tenant, token) per entry. Tenants are 1-64 of [A-Za-z0-9._-]; tokens at least 16
  // characters of A-Z a-z 0-9 . _ - ~ + / = (base64, base64url, hex), each used once. Errors never
  // contain a token.
  static absl::StatusOr<Authenticator> FromEntries(
      const std::vector<std::pair<std::string, std::string>>& entries);

  // Each tenant's weight in the fair shares of context memory and of the device (default 1).
  using TenantWeights = std::unordered_map<std::string, double>;
  static constexpr double kMaxWeight = 1000;

  // A tokens file: one "TENANT TOKEN [WEIGHT]" per line; blank lines and lines starting with #
  // are skipped. A WEIGHT (a number in (0, 1000]) goes into `weights` when given; a tenant may
  // repeat its weight on several lines but not change it.
  static absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ReadTokensFile(
      const std::string& path, TenantWeights* weights = nullptr);

  // "TENANT:TOKEN" or "TENANT:TOKEN:WEIGHT" (the --tokens option's form; tokens hold no colon).
  static absl::StatusOr<std::pair<std::string, std::string>> ParseInline(
      std::string_view entry, TenantWeights* weights = nullptr);

  // The tenant of an `authorization` header value "Bearer TOKEN"; UNAUTHENTICATED otherwise. Every
  // stored token is compared, whatever matches, so timing does not tell which one did.
  absl::StatusOr<std::string> Authenticate(std::string_view authorization) const;
  // Longer authorization headers are refused without hashing them.
  static constexpr size_t kMaxAuthorizationLength = 4096;
  // Whether `authorization` is "Bearer TOKEN" for exactly `token`, compared in constant time
  // (the metrics endpoint's check).
  static bool TokenMatches(std::string_view authorization, std::string_view token);

  size_t size() const { return entries_.size(); }
  // Distinct tenants, sorted (for the startup log).
  std::vector<std::string> Tenants() const;

 private:
  using Digest = std::array<uint8_t, 32>;
  static Digest Sha256(std::string_view data);
  std::vector<std::pair<Digest, std::string>> entries_;  // token digest -> tenant
};

}  // namespace gradwire::rpc
