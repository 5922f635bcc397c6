// The registration list: one entry per back-end folder (transport/transport.h).
#include <string>

#include "dear/error.h"
#include "transport/transport.h"

// Each entry names a back-end folder whose <name>_transport.cc defines
// dear::transport::<name>::transport(). A new back-end adds itself here, and nowhere else
// outside its folder.
#define DEAR_TRANSPORTS(X) X(tcp) X(shm) X(fabric) X(verbs)

namespace dear::transport {

#define DEAR_DECLARE_TRANSPORT(n) \
  namespace n {                   \
  const Transport& transport();   \
  }
DEAR_TRANSPORTS(DEAR_DECLARE_TRANSPORT)
#undef DEAR_DECLARE_TRANSPORT

const std::vector<const Transport*>& transports() {
#define DEAR_LIST_TRANSPORT(n) &n::transport(),
  static const std::vector<const Transport*> all{DEAR_TRANSPORTS(DEAR_LIST_TRANSPORT)};
#undef DEAR_LIST_TRANSPORT
  return all;
}

const Transport& find_transport(std::string_view name, int rank, const std::string& what) {
  const Transport* found = nullptr;
  std::string built;
  std::string missing;
  for (const Transport* t : transports()) {
    if (auto why = t->missing()) {
      missing += (missing.empty() ? "" : "; ") + std::string(t->name()) + ": " + *why;
      continue;
    }
    built += (built.empty() ? "" : ", ") + std::string(t->name());
    if (t->name() == name) found = t;
  }
  if (found != nullptr) return *found;
  throw Error(ErrorCode::kInvalidArgument,
              what + "='" + std::string(name) + "' is not available in this build (available: " +
                  built + (missing.empty() ? "" : "; not built: " + missing) + ")",
              rank);
}

}  // namespace dear::transport
