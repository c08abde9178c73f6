#include "server/core/checkpoint.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <system_error>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gradwire/storage/durable_file.h"
#include "gradwire/storage/safetensors_file.h"
#include "server/common/status_macros.h"
#include "server/core/context_store.h"
#include "server/core/module_state.h"

namespace gradwire::core {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using storage::StDType;
using storage::StTensor;

constexpr char kSuffix[] = ".gradwire.safetensors";
constexpr char kLockFile[] = ".gradwire-lock";
// DIR/.servers/<token>/: a shared server's heartbeat and the hand-over requests addressed to it.
constexpr char kServersDir[] = ".servers";
constexpr char kAliveFile[] = "alive";
constexpr int kFormatVersion = 1;

json SpecToJson(const ModuleSpec& s) {
  return json{{"kind", int(s.kind)},
              {"in_features", s.in_features},
              {"out_features", s.out_features},
              {"ffn_features", s.ffn_features},
              {"bias", s.bias},
              {"activation", int(s.activation)},
              {"layernorm_eps", s.layernorm_eps},
              {"zero_centered_gamma", s.zero_centered_gamma},
              {"return_layernorm_output", s.return_layernorm_output},
              {"checkpoint", s.checkpoint},
              {"recipe",
               {{"mode", int(s.recipe.mode)},
                {"margin", s.recipe.margin},
                {"history_len", s.recipe.history_len},
                {"algo", int(s.recipe.algo)}}},
              {"optimizer",
               {{"kind", int(s.optimizer.kind)},
                {"sgd",
                 {{"learning_rate", s.optimizer.sgd.learning_rate},
                  {"momentum", s.optimizer.sgd.momentum},
                  {"weight_decay", s.optimizer.sgd.weight_decay},
                  {"nesterov", s.optimizer.sgd.nesterov}}},
                {"adamw",
                 {{"learning_rate", s.optimizer.adamw.learning_rate},
                  {"beta1", s.optimizer.adamw.beta1},
                  {"beta2", s.optimizer.adamw.beta2},
                  {"eps", s.optimizer.adamw.eps},
                  {"weight_decay", s.optimizer.adamw.weight_decay}}}}},
              {"max_staleness", s.max_staleness},
              {"seed", s.seed},
              {"name", s.name}};
}

ModuleSpec SpecFromJson(const json& j) {
  ModuleSpec s;
  s.kind = ModuleKind(j.at("kind").get<int>());
  s.in_features = j.at("in_features");
  s.out_features = j.at("out_features");
  s.ffn_features = j.at("ffn_features");
  s.bias = j.at("bias");
  s.activation = kernels::Activation(j.at("activation").get<int>());
  s.layernorm_eps = j.at("layernorm_eps");
  s.zero_centered_gamma = j.at("zero_centered_gamma");
  s.return_layernorm_output = j.at("return_layernorm_output");
  s.checkpoint = j.at("checkpoint");
  const json& r = j.at("recipe");
  s.recipe.mode = ScalingMode(r.at("mode").get<int>());
  s.recipe.margin = r.at("margin");
  s.recipe.history_len = r.at("history_len");
  s.recipe.algo = AmaxAlgo(r.at("algo").get<int>());
  const json& o = j.at("optimizer");
  s.optimizer.kind = OptimizerConfig::Kind(o.at("kind").get<int>());
  s.optimizer.sgd.learning_rate = o.at("sgd").at("learning_rate");
  s.optimizer.sgd.momentum = o.at("sgd").at("momentum");
  s.optimizer.sgd.weight_decay = o.at("sgd").at("weight_decay");
  s.optimizer.sgd.nesterov = o.at("sgd").at("nesterov");
  s.optimizer.adamw.learning_rate = o.at("adamw").at("learning_rate");
  s.optimizer.adamw.beta1 = o.at("adamw").at("beta1");
  s.optimizer.adamw.beta2 = o.at("adamw").at("beta2");
  s.optimizer.adamw.eps = o.at("adamw").at("eps");
  s.optimizer.adamw.weight_decay = o.at("adamw").at("weight_decay");
  s.max_staleness = j.at("max_staleness");
  s.seed = j.at("seed");
  s.name = j.at("name");
  return s;
}

StTensor ToSt(const std::string& name, const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  StTensor out;
  out.name = name;
  out.dtype = StDType::kF32;
  out.shape.assign(c.sizes().begin(), c.sizes().end());
  out.data.assign(reinterpret_cast<const char*>(c.data_ptr<float>()),
                  size_t(c.numel()) * sizeof(float));
  return out;
}

absl::StatusOr<at::Tensor> FromSt(const StTensor& t) {
  if (t.dtype != StDType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, " is not F32"));
  }
  at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(at::kFloat));
  std::memcpy(out.data_ptr<float>(), t.data.data(), t.data.size());
  return out;
}

bool EndsWith(const std::string& s, const char* suffix) {
  const size_t n = strlen(suffix);
  return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

// A module id that can name a folder: not empty, no separators, not hidden.
absl::Status CheckFolderName(const std::string& id) {
  if (id.empty() || id.size() > 255 || id[0] == '.' || id.find('/') != std::string::npos ||
      id.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("module id \"", id, "\" cannot name a checkpoint folder"));
  }
  return absl::OkStatus();
}

// The claims and states in a module's folder, by epoch.
struct Scan {
  std::vector<int64_t> claims;
  std::vector<int64_t> states;
  bool legacy = false;
  int64_t max_claim() const {
    return claims.empty() ? 0 : *std::max_element(claims.begin(), claims.end());
  }
  int64_t max_state() const {
    return states.empty() ? -1 : *std::max_element(states.begin(), states.end());
  }
  bool any_state() const { return legacy || !states.empty(); }
};

Scan ScanFolder(const std::string& folder, const std::string& legacy) {
  Scan scan;
  std::error_code ec;
  scan.legacy = fs::exists(legacy, ec);
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    int64_t epoch = 0;
    if (name.rfind("claim.", 0) == 0) {
      if (absl::SimpleAtoi(name.substr(6), &epoch) && epoch > 0) scan.claims.push_back(epoch);
    } else if (name.rfind("state.", 0) == 0 && EndsWith(name, kSuffix)) {
      const std::string digits = name.substr(6, name.size() - 6 - strlen(kSuffix));
      if (absl::SimpleAtoi(digits, &epoch) && epoch > 0) scan.states.push_back(epoch);
    }
  }
  return scan;
}

// A claim file: the claim's token, then (from servers that hand modules over) "server <token>".
struct Claim {
  std::string token;   // empty when the file cannot be read
  std::string server;  // whom to ask for a hand-over; empty in claims of older servers
};
Claim ReadClaim(const std::string& path) {
  Claim claim;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return claim;
  char buf[512] = {};
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return claim;
  const std::string text(buf, size_t(n));
  claim.token = text.substr(0, text.find('\n'));
  if (const size_t at = text.find("\nserver "); at != std::string::npos) {
    const size_t from = at + 8;
    claim.server = text.substr(from, text.find('\n', from) - from);
  }
  return claim;
}
std::string ReadToken(const std::string& path) { return ReadClaim(path).token; }

// Seconds since the epoch, as file times count them.
double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Creates claim file `path` holding `token` and this process's `server` token, only if no claim
// has its name (O_EXCL): ABORTED when another server made it first.
absl::Status WriteClaim(const std::string& path, const std::string& token,
                        const std::string& server) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (errno == EEXIST) {
      return absl::AbortedError(absl::StrCat(
          storage::QuotePath(path),
          " was claimed by another server at the same moment: the module is being taken over "
          "there; retry"));
    }
    return absl::InternalError(
        absl::StrCat("cannot create ", storage::QuotePath(path), ": ", std::strerror(errno)));
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string text =
      absl::StrCat(token, "\nserver ", server, "\n", host, " pid ", ::getpid(), "\n");
  bool ok = ::write(fd, text.data(), text.size()) == ssize_t(text.size());
  ok = ::fsync(fd) == 0 && ok;
  ok = ::close(fd) == 0 && ok;
  if (!ok) {
    ::unlink(path.c_str());
    return absl::InternalError(absl::StrCat("cannot write ", storage::QuotePath(path)));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModuleState> ReadState(const std::string& path) {
  std::map<std::string, std::string> metadata;
  auto tensors = storage::ReadSafetensorsFile(path, &metadata);
  if (!tensors.ok()) {
    return absl::DataLossError(absl::StrCat(path, ": ", tensors.status().message()));
  }
  ModuleState state;
  try {
    if (metadata.at("format") != "gradwire-checkpoint") {
      return absl::DataLossError(absl::StrCat(path, " is not a gradwire checkpoint"));
    }
    state.module_id = metadata.at("module_id");
    if (auto t = metadata.find("tenant"); t != metadata.end()) state.tenant = t->second;
    state.weight_version = std::stoull(metadata.at("weight_version"));
    state.optimizer_steps = std::stoll(metadata.at("optimizer_steps"));
    state.spec = SpecFromJson(json::parse(metadata.at("spec")));
    for (const json& r : json::parse(metadata.at("scaling"))) {
      const std::vector<float> history = r.at("history");
      state.scaling.push_back(
          {r.at("role"), r.at("scale"), std::deque<float>(history.begin(), history.end())});
    }
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(path, ": bad checkpoint metadata: ", e.what()));
  }
  for (const StTensor& t : *tensors) {
    GW_ASSIGN_OR_RETURN(at::Tensor value, FromSt(t));
    if (t.name.rfind("param.", 0) == 0) {
      state.parameters.emplace_back(t.name.substr(6), value);
    } else if (t.name.rfind("slot.", 0) == 0) {
      state.optimizer_slots.emplace_back(t.name.substr(5), value);
    }
  }
  return state;
}

}  // namespace

Checkpointer::Checkpointer(std::string dir, int64_t every_steps)
    : dir_(std::move(dir)), every_steps_(every_steps), server_(RandomId128()) {}

Checkpointer::~Checkpointer() {
  if (lock_fd_ >= 0) ::close(lock_fd_);
}

std::string Checkpointer::FolderOf(const std::string& module_id) const {
  return (fs::path(dir_) / module_id).string();
}

std::string Checkpointer::StatePathOf(const std::string& module_id, int64_t epoch) const {
  return (fs::path(dir_) / module_id / absl::StrCat("state.", epoch, kSuffix)).string();
}

std::string Checkpointer::ClaimPathOf(const std::string& module_id, int64_t epoch) const {
  return (fs::path(dir_) / module_id / absl::StrCat("claim.", epoch)).string();
}

std::string Checkpointer::LegacyPathOf(const std::string& module_id) const {
  return (fs::path(dir_) / (module_id + kSuffix)).string();
}

std::string Checkpointer::ServerFolder(const std::string& server) const {
  return (fs::path(dir_) / kServersDir / server).string();
}

absl::Status Checkpointer::Prepare(bool shared) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_)) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint dir ", dir_, " cannot be created: ", ec.message()));
  }
  const std::string lock = (fs::path(dir_) / kLockFile).string();
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint dir ", dir_,
                                                      " is not writable: cannot open ", lock, ": ",
                                                      std::strerror(errno)));
  }
  if (::flock(fd, (shared ? LOCK_SH : LOCK_EX) | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint dir ", dir_, " is in use by another gradwire-server ",
          shared ? "that holds it alone" : "",
          ": servers that share a checkpoint directory must all be started with "
          "--checkpoint-shared, and a server without it must be the directory's only one"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cannot lock ", lock, ": ", std::strerror(err)));
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);
  lock_fd_ = fd;
  shared_ = shared;
  if (shared) {
    // Folders of servers that were killed long ago (a clean stop removes its own).
    std::error_code it_ec;
    fs::directory_iterator it(fs::path(dir_) / kServersDir, it_ec), end;
    for (; !it_ec && it != end; it.increment(it_ec)) {
      struct stat st;
      const std::string alive = (it->path() / kAliveFile).string();
      const bool stale = ::stat(alive.c_str(), &st) != 0 ||
                         WallSeconds() - double(st.st_mtim.tv_sec) > kForgetServerAfterS;
      std::error_code rm;
      if (stale) fs::remove_all(it->path(), rm);
    }
    std::error_code mk;
    fs::create_directories(ServerFolder(server_), mk);
    if (mk) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot create ", storage::QuotePath(ServerFolder(server_)), ": ", mk.message()));
    }
    Heartbeat();
  }
  return absl::OkStatus();
}

void Checkpointer::Heartbeat() const {
  const std::string alive = (fs::path(ServerFolder(server_)) / kAliveFile).string();
  if (::utimensat(AT_FDCWD, alive.c_str(), nullptr, 0) == 0) return;
  std::error_code ec;  // gone: made again (a server starting beside this one took it for stale)
  fs::create_directories(ServerFolder(server_), ec);
  const int fd = ::open(alive.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd >= 0) ::close(fd);
}

namespace {
// A hand-over request: DIR/.servers/<holder>/<module id>/<taker>, holding the epoch asked about.
struct Request {
  std::string path;
  int64_t epoch = 0;
  double age_s = 0;
};
}  // namespace

std::vector<std::string> Checkpointer::HandOverRequests() {
  std::vector<std::string> picked;
  if (!shared_) return picked;
  const double now = WallSeconds();
  std::error_code ec;
  fs::directory_iterator it(ServerFolder(server_), ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string id = it->path().filename().string();
    std::error_code type_ec;
    if (id.empty() || id[0] == '.' || !it->is_directory(type_ec)) continue;
    std::vector<Request> requests;
    std::error_code in_ec;
    fs::directory_iterator r(it->path(), in_ec);
    for (; !in_ec && r != end; r.increment(in_ec)) {
      Request q;
      q.path = r->path().string();
      struct stat st;
      const int fd = ::open(q.path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      char buf[32] = {};
      const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
      const bool stat_ok = ::fstat(fd, &st) == 0;
      ::close(fd);
      if (n <= 0 || !absl::SimpleAtoi(absl::StripAsciiWhitespace(buf), &q.epoch) || !stat_ok) {
        continue;
      }
      q.age_s = now - (double(st.st_mtim.tv_sec) + 1e-9 * st.st_mtim.tv_nsec);
      if (q.age_s > kStaleRequestS) {  // a taker that died waiting
        ::unlink(q.path.c_str());
        continue;
      }
      requests.push_back(std::move(q));
    }
    if (requests.empty()) {
      ::rmdir(it->path().c_str());  // empty: every taker is done with it
      continue;
    }
    bool take = false;
    int64_t epoch = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto held = held_.find(id);
      if (held != held_.end() && !held->second.handing_over) {
        epoch = held->second.epoch;
        for (const Request& q : requests) take = take || q.epoch == epoch;
        held->second.handing_over = take;
      }
    }
    if (!take) continue;  // not held here under the epoch asked about: left to its takers
    // Picked up: each taker asking about this epoch reads its request's removal as that.
    for (const Request& q : requests) {
      if (q.epoch == epoch) ::unlink(q.path.c_str());
    }
    picked.push_back(id);
  }
  return picked;
}

void Checkpointer::Release(const std::string& module_id) {
  Held held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = held_.find(module_id);
    // Only the holding that was picked up: a take-over of the module here since is a new one.
    if (it == held_.end() || !it->second.handing_over) return;
    held = it->second;
    held_.erase(it);
  }
  // Removed even when the hand-over's save failed, so that the taker does not wait: it then reads
  // the last state saved, and may claim this epoch again (under a token of its own, which keeps
  // this server fenced).
  const std::string claim = ClaimPathOf(module_id, held.epoch);
  if (ReadToken(claim) == held.token) ::unlink(claim.c_str());
}

void Checkpointer::Leave() {
  if (!shared_) return;
  std::map<std::string, Held> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    held.swap(held_);
  }
  // The claims of the modules saved under them go (a taker waiting on one goes on with that
  // state; the state file keeps the epoch from being claimed again), then its folder.
  struct stat st;
  for (const auto& [id, h] : held) {
    const std::string claim = ClaimPathOf(id, h.epoch);
    if (::stat(StatePathOf(id, h.epoch).c_str(), &st) == 0 && ReadToken(claim) == h.token) {
      ::unlink(claim.c_str());
    }
  }
  std::error_code ec;
  fs::remove_all(ServerFolder(server_), ec);
}

// The age of a server's heartbeat in seconds; a negative value when it has none (it stopped, or
// was never here).
double Checkpointer::HeartbeatAge(const std::string& server) const {
  struct stat st;
  const std::string alive = (fs::path(ServerFolder(server)) / kAliveFile).string();
  if (::stat(alive.c_str(), &st) != 0) return -1;
  return std::max(0.0, WallSeconds() - (double(st.st_mtim.tv_sec) + 1e-9 * st.st_mtim.tv_nsec));
}

void Checkpointer::AskHolder(const std::string& module_id, int64_t epoch) const {
  const std::string claim_path = ClaimPathOf(module_id, epoch);
  const Claim claim = ReadClaim(claim_path);
  if (claim.server.empty() || claim.server == server_ ||
      claim.server.find('/') != std::string::npos || claim.server[0] == '.') {
    return;
  }
  const auto alive = [&] {
    const double age = HeartbeatAge(claim.server);
    return age >= 0 && age <= kAliveWithinS;
  };
  if (!alive()) return;  // gone: killed (its heartbeat stopped), or stopped (its folder went)
  const std::string folder = (fs::path(ServerFolder(claim.server)) / module_id).string();
  if (::mkdir(folder.c_str(), 0755) != 0 && errno != EEXIST) return;
  const std::string request = (fs::path(folder) / server_).string();
  {
    const int fd = ::open(request.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return;
    const std::string text = absl::StrCat(epoch, "\n");
    const bool ok = ::write(fd, text.data(), text.size()) == ssize_t(text.size());
    ::close(fd);
    if (!ok) {
      ::unlink(request.c_str());
      return;
    }
  }
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const auto seconds = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  struct stat st;
  // Picked up when the holder removes the request (or, stopping, its claim); then handed over
  // when its claim goes. A holder whose heartbeat stops meanwhile is not waited for.
  bool picked = false;
  while (!picked) {
    if (::stat(request.c_str(), &st) != 0 || ::stat(claim_path.c_str(), &st) != 0) {
      picked = true;
    } else if (seconds() >= handover_wait_s_ || !alive()) {
      if (::unlink(request.c_str()) == 0) {  // else the holder picked it up just now
        ::rmdir(folder.c_str());
        spdlog::warn(
            "module {}: its holder (server {}) did not pick up a hand-over request within {:.1f} "
            "s (--checkpoint-handover-wait {} s){}; taking it over from its last checkpoint",
            module_id, claim.server, seconds(), handover_wait_s_,
            alive() ? "" : ", and its heartbeat stopped");
        return;
      }
      picked = true;
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  while (::stat(claim_path.c_str(), &st) == 0) {
    if (seconds() >= handover_wait_s_ + kReleaseWithinS || !alive()) {
      spdlog::warn(
          "module {}: its holder (server {}) picked up a hand-over request but did not release "
          "the module within {:.1f} s{}; taking it over from its last checkpoint",
          module_id, claim.server, seconds(), alive() ? "" : " (its heartbeat stopped)");
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  spdlog::info("module {}: handed over by its holder (server {}) in {:.1f} ms", module_id,
               claim.server, 1e3 * seconds());
}

absl::Status Checkpointer::ClaimNew(const std::string& module_id) {
  GW_RETURN_IF_ERROR(CheckFolderName(module_id));
  const std::string folder = FolderOf(module_id);
  const auto taken = [&] {
    return absl::AlreadyExistsError(absl::StrCat(
        "module_id ", module_id,
        " has a checkpoint in --checkpoint-dir already (a module of another server, or one not "
        "loaded here yet): choose another id"));
  };
  struct stat st;
  if (::stat(LegacyPathOf(module_id).c_str(), &st) == 0) return taken();
  if (::mkdir(folder.c_str(), 0755) != 0) {
    if (errno == EEXIST) return taken();
    return absl::InternalError(
        absl::StrCat("cannot create ", storage::QuotePath(folder), ": ", std::strerror(errno)));
  }
  const std::string token = RandomId128();
  GW_RETURN_IF_ERROR(WriteClaim(ClaimPathOf(module_id, 1), token, server_));
  std::lock_guard<std::mutex> lock(mu_);
  held_[module_id] = Held{1, token, true, false};
  return absl::OkStatus();
}

absl::StatusOr<Checkpointer::TakeOver> Checkpointer::Take(ModuleHost& host,
                                                          const std::string& module_id) {
  GW_RETURN_IF_ERROR(CheckFolderName(module_id));
  const std::string folder = FolderOf(module_id), legacy = LegacyPathOf(module_id);
  Scan before = ScanFolder(folder, legacy);
  if (!before.any_state()) {
    return absl::NotFoundError(
        absl::StrCat("module_id ", module_id, " has no checkpoint in ", dir_));
  }
  if (shared_ && handover_wait_s_ > 0 && before.max_claim() > 0) {
    const int64_t asked = before.max_claim();
    AskHolder(module_id, asked);
    before = ScanFolder(folder, legacy);  // the holder's last save and released claim
    if (!before.any_state()) {            // deleted there meanwhile
      return absl::NotFoundError(
          absl::StrCat("module_id ", module_id, " has no checkpoint in ", dir_));
    }
    if (before.max_claim() > asked) {  // another server took it over meanwhile: not asked yet
      return absl::AbortedError(absl::StrCat(
          "module ", module_id,
          " was taken over by another server while this one waited for its hand-over; retry"));
    }
  }
  std::error_code ec;
  fs::create_directories(folder, ec);
  TakeOver out;
  out.epoch = std::max(before.max_claim(), before.max_state()) + 1;
  const std::string token = RandomId128();
  GW_RETURN_IF_ERROR(WriteClaim(ClaimPathOf(module_id, out.epoch), token, server_));
  // The earlier holders' claims go: each of them is fenced from now on (CheckHeld).
  for (int64_t e : before.claims) {
    if (e < out.epoch) fs::remove(ClaimPathOf(module_id, e), ec);
  }
  // Scanned again after the claim: a state the last holder saved in between is the newest.
  const Scan after = ScanFolder(folder, legacy);
  out.from_epoch = std::max<int64_t>(after.max_state(), 0);
  const std::string path = after.states.empty() ? legacy : StatePathOf(module_id, out.from_epoch);
  GW_ASSIGN_OR_RETURN(ModuleState state, ReadState(path));
  if (state.module_id != module_id) {
    return absl::DataLossError(
        absl::StrCat(path, " holds module ", state.module_id, ", not module ", module_id));
  }
  if (auto s = host.ImportState(state); !s.ok()) {
    return absl::Status(
        s.code() == absl::StatusCode::kAlreadyExists ? s.code() : absl::StatusCode::kDataLoss,
        absl::StrCat(path, ": ", s.message()));
  }
  out.weight_version = state.weight_version;
  out.optimizer_steps = state.optimizer_steps;
  std::lock_guard<std::mutex> lock(mu_);
  held_[module_id] = Held{out.epoch, token, false, true};
  return out;
}

absl::Status Checkpointer::CheckHeld(const std::string& module_id, const Held& held) const {
  struct stat st;
  const bool mine = ReadToken(ClaimPathOf(module_id, held.epoch)) == held.token;
  if (mine && ::stat(ClaimPathOf(module_id, held.epoch + 1).c_str(), &st) != 0) {
    return absl::OkStatus();
  }
  return ModuleMovedError(
      module_id, absl::StrCat("this server held it under checkpoint epoch ", held.epoch,
                              ", and another server has claimed it since (or deleted it); this "
                              "server no longer serves or saves it. Behind a proxy, retry: the "
                              "call goes where the module is now"));
}

absl::StatusOr<Checkpointer::Held> Checkpointer::HeldOf(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(module_id);
  if (it == held_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("module ", module_id, " is not held by this server's checkpoints"));
  }
  return it->second;
}

absl::Status Checkpointer::CheckHeld(const std::string& module_id) const {
  GW_ASSIGN_OR_RETURN(const Held held, HeldOf(module_id));
  return CheckHeld(module_id, held);
}

bool Checkpointer::IsMoved(const absl::Status& status) { return IsModuleMoved(status); }

int64_t Checkpointer::EpochOf(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(module_id);
  return it == held_.end() ? 0 : it->second.epoch;
}

bool Checkpointer::TookOver(const std::string& module_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = held_.find(module_id);
  return it != held_.end() && it->second.took_over;
}

absl::Status Checkpointer::SaveState(const ModuleState& state, int64_t epoch) const {
  std::vector<StTensor> tensors;
  for (const auto& [name, t] : state.parameters) tensors.push_back(ToSt("param." + name, t));
  for (const auto& [name, t] : state.optimizer_slots) tensors.push_back(ToSt("slot." + name, t));
  json scaling = json::array();
  for (const RoleScaling& r : state.scaling) {
    scaling.push_back({{"role", r.role},
                       {"scale", r.scale},
                       {"history", std::vector<float>(r.history.begin(), r.history.end())}});
  }
  const std::map<std::string, std::string> metadata = {
      {"format", "gradwire-checkpoint"},
      {"format_version", std::to_string(kFormatVersion)},
      {"module_id", state.module_id},
      {"tenant", state.tenant},
      {"epoch", std::to_string(epoch)},
      {"weight_version", std::to_string(state.weight_version)},
      {"optimizer_steps", std::to_string(state.optimizer_steps)},
      {"spec", SpecToJson(state.spec).dump()},
      {"scaling", scaling.dump()}};
  return storage::WriteSafetensorsFile(StatePathOf(state.module_id, epoch), tensors, metadata);
}

absl::Status Checkpointer::Save(const ModuleHost& host, const std::string& module_id) {
  GW_ASSIGN_OR_RETURN(const Held held, HeldOf(module_id));
  GW_RETURN_IF_ERROR(CheckHeld(module_id, held));
  GW_ASSIGN_OR_RETURN(ModuleState state, host.ExportState(module_id));
  GW_RETURN_IF_ERROR(SaveState(state, held.epoch));
  if (held.superseded) return absl::OkStatus();
  // The first save under this epoch: the states it superseded go.
  std::error_code ec;
  for (int64_t e : ScanFolder(FolderOf(module_id), LegacyPathOf(module_id)).states) {
    if (e < held.epoch) fs::remove(StatePathOf(module_id, e), ec);
  }
  fs::remove(LegacyPathOf(module_id), ec);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = held_.find(module_id); it != held_.end() && it->second.epoch == held.epoch) {
    it->second.superseded = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Checkpointer::SaveAll(const ModuleHost& host) {
  int64_t saved = 0;
  for (const ModuleInfo& info : host.List()) {
    absl::Status s = Save(host, info.module_id);
    if (IsMoved(s)) {
      spdlog::warn("not saving module {}: {}", info.module_id, std::string(s.message()));
      continue;
    }
    GW_RETURN_IF_ERROR(s);
    ++saved;
  }
  return saved;
}

std::vector<std::pair<std::string, absl::Status>> Checkpointer::Lost() const {
  std::map<std::string, Held> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    held = held_;
  }
  std::vector<std::pair<std::string, absl::Status>> lost;
  for (const auto& [id, h] : held) {
    if (absl::Status s = CheckHeld(id, h); !s.ok()) lost.emplace_back(id, std::move(s));
  }
  return lost;
}

void Checkpointer::Forget(const std::string& module_id) {
  std::lock_guard<std::mutex> lock(mu_);
  held_.erase(module_id);
}

absl::Status Checkpointer::Remove(const std::string& module_id) {
  GW_RETURN_IF_ERROR(CheckFolderName(module_id));
  Forget(module_id);
  std::error_code ec;
  fs::remove_all(FolderOf(module_id), ec);
  if (!ec) fs::remove(LegacyPathOf(module_id), ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("cannot remove the checkpoint of module ", module_id, ": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Checkpointer::RestoreAll(ModuleHost& host) {
  std::set<std::string> ids;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name[0] == '.') continue;
    std::error_code dir_ec;
    if (entry.is_directory(dir_ec)) {
      ids.insert(name);
    } else if (EndsWith(name, kSuffix) && name.size() > strlen(kSuffix)) {
      ids.insert(name.substr(0, name.size() - strlen(kSuffix)));
    }  // else: temporary files of an interrupted write, or foreign files
  }
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot read checkpoint dir ", dir_, ": ", ec.message()));
  }
  int64_t restored = 0;
  for (const std::string& id : ids) {
    absl::StatusOr<TakeOver> took = Take(host, id);
    if (took.status().code() == absl::StatusCode::kNotFound) continue;  // a create cut short
    if (!took.ok()) return took.status();
    ++restored;
  }
  return restored;
}

}  // namespace gradwire::core
