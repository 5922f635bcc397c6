#pragma once
// Fatal-signal handlers that libraries below us install behind our back.

namespace dear::transport {

// libfabric pulls in the PSM libraries (Intel True Scale / Omni-Path), whose load-time
// constructor sets handlers for SIGINT, SIGTERM, SIGSEGV, SIGBUS, SIGILL, SIGABRT and SIGFPE
// that print a backtrace and call exit(). exit() from a signal handler, in whichever thread
// caught it, runs the process's exit handlers while dear's engine threads still run: a Ctrl-C
// can then hang or crash instead of ending the process. This puts back the default action
// for each of those signals whose handler lives in one of those libraries (the same as their
// own switch, IPATH_NO_BACKTRACE=1, set before they load) and leaves every other handler as
// it is. Idempotent and cheap after the first call; thread-safe.
void reset_foreign_fatal_handlers() noexcept;

}  // namespace dear::transport
