#include "progress.h"

#include <unistd.h>

namespace gradwire::cli {

ProgressBar::ProgressBar(std::FILE* out, int64_t total, std::string label)
    : out_(out),
      total_(total > 0 ? total : 1),
      label_(std::move(label)),
      tty_(isatty(fileno(out))),
      start_(std::chrono::steady_clock::now()),
      last_line_(start_) {}

void ProgressBar::Update(int64_t done, const std::string& note) {
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  if (tty_) {
    constexpr int kWidth = 30;
    const int filled = int(kWidth * done / total_);
    std::string bar(size_t(filled), '#');
    bar.resize(kWidth, '.');
    std::fprintf(out_, "\r%s [%s] %lld/%lld %5.1fs %s\033[K", label_.c_str(), bar.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total_), elapsed,
                 note.c_str());
    std::fflush(out_);
  } else if (now - last_line_ >= std::chrono::seconds(2)) {
    last_line_ = now;
    std::fprintf(out_, "%s %lld/%lld %.1fs %s\n", label_.c_str(), static_cast<long long>(done),
                 static_cast<long long>(total_), elapsed, note.c_str());
  }
}

void ProgressBar::Finish(const std::string& note) {
  if (tty_) {
    Update(total_, note);
    std::fprintf(out_, "\n");
    return;
  }
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::fprintf(out_, "%s %lld/%lld %.1fs %s\n", label_.c_str(), static_cast<long long>(total_),
               static_cast<long long>(total_), elapsed, note.c_str());
}

}  // namespace gradwire::cli
