#include "transport/signals.h"

#include <dlfcn.h>

#include <csignal>
#include <cstring>
#include <mutex>

namespace dear::transport {
namespace {

// The shared objects whose handlers are undone: the PSM libraries libfabric depends on.
bool foreign(const char* path) {
  if (path == nullptr) return false;
  const char* base = std::strrchr(path, '/');
  base = base == nullptr ? path : base + 1;
  for (const char* name : {"libinfinipath.", "libpsm_infinipath.", "libpsm2."}) {
    if (std::strncmp(base, name, std::strlen(name)) == 0) return true;
  }
  return false;
}

void reset_once() {
  for (const int sig : {SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL, SIGABRT, SIGFPE}) {
    struct sigaction current {};
    if (::sigaction(sig, nullptr, &current) != 0) continue;
    const void* fn = (current.sa_flags & SA_SIGINFO) != 0
                         ? reinterpret_cast<const void*>(current.sa_sigaction)
                         : reinterpret_cast<const void*>(current.sa_handler);
    if (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN) continue;
    Dl_info info{};
    if (::dladdr(fn, &info) == 0 || !foreign(info.dli_fname)) continue;
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    ::sigaction(sig, &dfl, nullptr);
  }
}

}  // namespace

void reset_foreign_fatal_handlers() noexcept {
  static std::once_flag once;
  try {
    std::call_once(once, reset_once);
  } catch (...) {
    // call_once reports failures to start threads' bookkeeping only; nothing to undo.
  }
}

}  // namespace dear::transport
