// dear::library_version(): the one source of the installed library of its own (the rest is the
// layers' archives, linked whole; see cmake/install.cmake).
#include "dear/version.h"

namespace dear {

const char* library_version() noexcept { return DEAR_VERSION_STRING; }

}  // namespace dear
