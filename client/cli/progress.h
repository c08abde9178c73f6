// A one-line progress bar on a terminal; periodic plain lines when the stream is not a terminal
// (logs, CI), so long work always shows it is moving.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace gradwire::cli {

class ProgressBar {
 public:
  ProgressBar(std::FILE* out, int64_t total, std::string label);
  // Shows `done` of total with a trailing note (e.g. the loss).
  void Update(int64_t done, const std::string& note);
  // Ends the line.
  void Finish(const std::string& note);

 private:
  std::FILE* out_;
  int64_t total_;
  std::string label_;
  bool tty_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_line_;
};

}  // namespace gradwire::cli
