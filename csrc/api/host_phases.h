// MSA_HOST_PHASES=1: per call of an instrumented host function, one stderr line with the host microseconds
// of its phases (the time from the previous mark to each mark; no device synchronisation, so this is the
// host's own cost: allocations, dispatcher calls, launches). Off (the default): one cached getenv, no clock.
#pragma once
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace msa::api {

class HostPhases {
 public:
  explicit HostPhases(const char* name) : name_(name), on_(enabled()) {
    if (on_) last_ = Clock::now();
  }
  HostPhases(const HostPhases&) = delete;
  HostPhases& operator=(const HostPhases&) = delete;
  void mark(const char* phase) {
    if (!on_) return;
    const auto now = Clock::now();
    const double us = std::chrono::duration<double, std::micro>(now - last_).count();
    char buf[64];
    std::snprintf(buf, sizeof(buf), " %s=%.1f", phase, us);
    line_ += buf;
    last_ = now;
  }
  ~HostPhases() {
    if (on_) std::fprintf(stderr, "msa host us %s:%s\n", name_, line_.c_str());
  }

 private:
  using Clock = std::chrono::steady_clock;
  static bool enabled() {
    static const bool on = [] {
      const char* v = std::getenv("MSA_HOST_PHASES");
      return v != nullptr && std::strcmp(v, "1") == 0;
    }();
    return on;
  }
  const char* name_;
  bool on_;
  Clock::time_point last_;
  std::string line_;
};

}  // namespace msa::api
