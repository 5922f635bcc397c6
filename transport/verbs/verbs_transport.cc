// transport "verbs": RC queue pairs over ibverbs (verbs_link.h). Registered in
// transport/registry.cc; compiled with or without rdma-core (verbs_stub.cc then answers).
#include "transport/rma/rma_transport.h"
#include "transport/verbs/verbs_link.h"

namespace dear::transport::verbs {
namespace {

VerbsOptions verbs_options(const TransportOptions& o) {
  VerbsOptions vo;
  vo.device = o.ib_device;
  vo.gid_index = o.ib_gid_index;
  vo.deadline = o.deadline;
  if (o.direct_bytes >= 0) vo.direct_bytes = static_cast<std::size_t>(o.direct_bytes);
  return vo;
}

class VerbsTransport final : public rma::RmaTransport {
 public:
  std::string_view name() const override { return "verbs"; }
  std::optional<std::string> missing() const override {
    if (built()) return std::nullopt;
    return unavailable_reason();
  }
  std::optional<std::string> unavailable(const TransportOptions& o) const override {
    return unavailable_reason(verbs_options(o));
  }

  Links connect(Bootstrap& bootstrap, const std::vector<int>& mesh_peers,
                const TransportOptions& o) const override;
};

}  // namespace

const Transport& transport() {
  static const VerbsTransport t;
  return t;
}

// One set of options for both: verbs sizes its ring and mesh slots alike.
Links VerbsTransport::connect(Bootstrap& bootstrap, const std::vector<int>& mesh_peers,
                              const TransportOptions& o) const {
  const VerbsOptions vo = verbs_options(o);
  auto c = verbs::connect(bootstrap, o.channels, mesh_peers, vo);
  return links_of(std::move(c.ring), std::move(c.mesh));
}

}  // namespace dear::transport::verbs
