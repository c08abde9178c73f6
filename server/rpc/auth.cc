#include "server/rpc/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"

namespace gradwire::rpc {
namespace {

bool ValidTenant(std::string_view t) {
  if (t.empty() || t.size() > Authenticator::kMaxTenantLength) return false;
  return std::all_of(t.begin(), t.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
}

bool ValidToken(std::string_view t) {
  return t.size() >= Authenticator::kMinTokenLength && std::all_of(t.begin(), t.end(), [](char c) {
           return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '_' || c == '-' || c == '~' || c == '+' || c == '/' || c == '=';
         });
}

// Records `tenant`'s weight from `text`; `where` names the line or entry in errors.
absl::Status AddWeight(Authenticator::TenantWeights* weights, std::string_view tenant,
                       std::string_view text, const std::string& where) {
  const std::string copy(text);
  char* end = nullptr;
  const double w = std::strtod(copy.c_str(), &end);
  if (copy.empty() || end != copy.c_str() + copy.size() || !std::isfinite(w) || w <= 0 ||
      w > Authenticator::kMaxWeight) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the weight \"", copy,
                                                   "\" is not a number in (0, ",
                                                   Authenticator::kMaxWeight, "]"));
  }
  if (weights == nullptr) return absl::OkStatus();
  auto [it, inserted] = weights->emplace(std::string(tenant), w);
  if (!inserted && it->second != w) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": tenant ", std::string(tenant),
                                                   " was given weight ", it->second,
                                                   " before, now ", w));
  }
  return absl::OkStatus();
}

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  return s;
}

}  // namespace

Authenticator::Digest Authenticator::Sha256(std::string_view data) {
  Digest d{};
  unsigned int len = 0;
  if (EVP_Digest(data.data(), data.size(), d.data(), &len, EVP_sha256(), nullptr) != 1 ||
      len != d.size()) {
    // Cannot happen with a working libcrypto; an all-zero digest matches no stored token's
    // digest in practice, and the check below still rejects the call.
    d.fill(0);
  }
  return d;
}

absl::StatusOr<Authenticator> Authenticator::FromEntries(
    const std::vector<std::pair<std::string, std::string>>& entries) {
  Authenticator auth;
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& [tenant, token] = entries[i];
    if (!ValidTenant(tenant)) {
      return absl::InvalidArgumentError(
          absl::StrCat("token entry ", i + 1, ": tenant '", tenant.substr(0, 80),
                       "' must be 1-64 characters of A-Z a-z 0-9 . _ -"));
    }
    if (!ValidToken(token)) {
      return absl::InvalidArgumentError(
          absl::StrCat("token entry ", i + 1, " (tenant ", tenant, "): a token must be at least ",
                       kMinTokenLength, " characters of A-Z a-z 0-9 . _ - ~ + / ="));
    }
    const Digest d = Sha256(token);
    for (const auto& [other, other_tenant] : auth.entries_) {
      if (other == d) {
        return absl::InvalidArgumentError(absl::StrCat("token entry ", i + 1, " (tenant ", tenant,
                                                       ") repeats the token of tenant ",
                                                       other_tenant));
      }
    }
    auth.entries_.emplace_back(d, tenant);
  }
  if (auth.entries_.empty()) return absl::InvalidArgumentError("no tokens given");
  return auth;
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> Authenticator::ReadTokensFile(
    const std::string& path, TenantWeights* weights) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read tokens file ", path));
  std::vector<std::pair<std::string, std::string>> out;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    const std::string_view l = Trim(line);
    if (l.empty() || l.front() == '#') continue;
    const size_t space = l.find_first_of(" \t");
    if (space == std::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", number, ": want \"TENANT TOKEN\" (the token is missing)"));
    }
    const std::string_view tenant = l.substr(0, space);
    std::string_view token = Trim(l.substr(space + 1));
    if (const size_t gap = token.find_first_of(" \t"); gap != std::string_view::npos) {
      const std::string_view weight = Trim(token.substr(gap + 1));
      token = token.substr(0, gap);
      if (weight.find_first_of(" \t") != std::string_view::npos) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ":", number, ": want \"TENANT TOKEN [WEIGHT]\" (more than three fields)"));
      }
      if (auto s = AddWeight(weights, tenant, weight, absl::StrCat(path, ":", number)); !s.ok()) {
        return s;
      }
    }
    out.emplace_back(std::string(tenant), std::string(token));
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, " holds no tokens"));
  return out;
}

absl::StatusOr<std::pair<std::string, std::string>> Authenticator::ParseInline(
    std::string_view entry, TenantWeights* weights) {
  const size_t colon = entry.find(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == entry.size()) {
    return absl::InvalidArgumentError(
        "a --tokens entry must be TENANT:TOKEN or TENANT:TOKEN:WEIGHT");
  }
  const std::string_view tenant = entry.substr(0, colon);
  std::string_view token = entry.substr(colon + 1);
  if (const size_t second = token.find(':'); second != std::string_view::npos) {
    const std::string_view weight = token.substr(second + 1);
    token = token.substr(0, second);
    if (token.empty()) {
      return absl::InvalidArgumentError(
          "a --tokens entry must be TENANT:TOKEN or TENANT:TOKEN:WEIGHT");
    }
    if (auto s = AddWeight(weights, tenant, weight, "--tokens " + std::string(tenant) + ":...");
        !s.ok()) {
      return s;
    }
  }
  return std::pair{std::string(tenant), std::string(token)};
}

absl::StatusOr<std::string> Authenticator::Authenticate(std::string_view authorization) const {
  static constexpr std::string_view kBearer = "Bearer ";
  if (authorization.size() > kMaxAuthorizationLength) {
    return absl::UnauthenticatedError(
        absl::StrCat("the authorization header is ", authorization.size(),
                     " bytes, over the limit of ", kMaxAuthorizationLength));
  }
  if (authorization.size() <= kBearer.size() ||
      authorization.substr(0, kBearer.size()) != kBearer) {
    return absl::UnauthenticatedError(
        "this server requires a bearer token: send metadata 'authorization: Bearer TOKEN'");
  }
  const Digest presented = Sha256(authorization.substr(kBearer.size()));
  const std::string* tenant = nullptr;
  for (const auto& [digest, t] : entries_) {
    // No early exit: every entry costs the same whether or not it matches.
    const bool match = CRYPTO_memcmp(digest.data(), presented.data(), digest.size()) == 0;
    if (match) tenant = &t;
  }
  if (tenant == nullptr) return absl::UnauthenticatedError("the bearer token is not valid");
  return *tenant;
}

bool Authenticator::TokenMatches(std::string_view authorization, std::string_view token) {
  static constexpr std::string_view kBearer = "Bearer ";
  if (authorization.size() > kMaxAuthorizationLength ||
      authorization.substr(0, kBearer.size()) != kBearer) {
    return false;
  }
  const Digest presented = Sha256(authorization.substr(kBearer.size()));
  const Digest expected = Sha256(token);
  return CRYPTO_memcmp(presented.data(), expected.data(), expected.size()) == 0;
}

std::vector<std::string> Authenticator::Tenants() const {
  std::set<std::string> tenants;
  for (const auto& [d, t] : entries_) tenants.insert(t);
  return {tenants.begin(), tenants.end()};
}

}  // namespace gradwire::rpc
