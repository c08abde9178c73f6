// The real gradwire-server binary as a child process, for end-to-end tests.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace gradwire::testing {

// A gradwire-server child process; its log goes to a file.
class ServerProcess {
 public:
  // Starts the server with --listen 127.0.0.1:0 and `flags`; its log goes to `log_dir`.
  ServerProcess(const std::string& log_dir, const std::vector<std::string>& flags) {
    // The test process id keeps parallel test processes (ctest -j) off each other's logs.
    log_ =
        log_dir + "/server-" + std::to_string(getpid()) + "-" + std::to_string(++starts_) + ".log";
    std::vector<std::string> args = {GRADWIRE_SERVER_BIN, "--listen", "127.0.0.1:0"};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    EXPECT_EQ(posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&actions);
    for (int i = 0; i < 200 && address_.empty(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      const std::string text = Log();
      const auto at = text.find("listening on ");
      if (at != std::string::npos) {
        address_ = text.substr(at + 13, text.find('\n', at) - at - 13);
      }
    }
    EXPECT_FALSE(address_.empty()) << Log();
  }
  ~ServerProcess() {
    if (pid_ > 0) Signal(SIGKILL);
  }
  // Sends `sig` and returns the exit status (or 128 + signal).
  int Signal(int sig) {
    Send(sig);
    return Wait();
  }
  // Sends `sig` without waiting for the exit.
  void Send(int sig) { kill(pid_, sig); }
  // Waits for the exit; returns the exit status (or 128 + signal).
  int Wait() {
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  std::string Log() const {
    std::ifstream in(log_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  const std::string& address() const { return address_; }
  pid_t pid() const { return pid_; }

 private:
  static inline int starts_ = 0;
  pid_t pid_ = -1;
  std::string log_;
  std::string address_;
};

}  // namespace gradwire::testing
