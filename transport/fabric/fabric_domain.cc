#include "transport/fabric/fabric_domain.h"

#include <rdma/fi_errno.h>

#include <algorithm>

namespace dear::transport::fabric {

[[noreturn]] void throw_fi(const std::string& call, int rc, int rank, int peer) {
  throw Error(ErrorCode::kSystem, call + " failed: " + fi_text(rc), rank, peer, "fabric setup");
}

bool single_host(const std::string& prov) { return prov == "shm" || prov.rfind("shm;", 0) == 0; }

InfoPtr query(const std::string& provider, int* rc_out, bool writes, bool hmem) {
  InfoPtr hints = rdm_hints(provider, FI_THREAD_SAFE, writes, hmem);
  fi_info* info = nullptr;
  const int rc = fi_getinfo(kApiVersion, nullptr, nullptr, 0, hints.get(), &info);
  if (rc_out != nullptr) *rc_out = rc;
  return InfoPtr(rc == 0 ? info : nullptr);
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + ("'" + x + "'");
  return s.empty() ? "none" : s;
}

const fi_info* choose(const fi_info* list, const std::string& provider) {
  for (const fi_info* i = list; i != nullptr; i = i->next) {
    if (provider.empty() && single_host(i->fabric_attr->prov_name)) continue;
    return i;
  }
  return nullptr;
}

InfoPtr write_info(const fi_info* chosen, std::string* why, bool hmem) {
  const std::string prov = chosen->fabric_attr->prov_name;
  const char* domain = chosen->domain_attr->name;
  int rc = 0;
  InfoPtr list = query(prov, &rc, true, hmem);
  if (!list) {
    *why = "it offers no RMA writes with " + std::to_string(kWriteDataBytes) +
           " bytes of remote CQ data: " + fi_text(rc);
    return nullptr;
  }
  for (const fi_info* i = list.get(); i != nullptr; i = i->next) {
    if (prov != i->fabric_attr->prov_name) continue;
    if (domain != nullptr && i->domain_attr->name != nullptr &&
        std::strcmp(domain, i->domain_attr->name) != 0) {
      continue;
    }
    if ((i->caps & FI_RMA) == 0 || i->domain_attr->cq_data_size < kWriteDataBytes) {
      *why = "its remote CQ data holds " + std::to_string(i->domain_attr->cq_data_size) +
             " bytes, fewer than a sequence number's " + std::to_string(kWriteDataBytes);
      continue;
    }
    if (i->tx_attr->iov_limit < 1 || i->tx_attr->rma_iov_limit < 1) {
      *why = "its RMA writes take no gather entries";
      continue;
    }
    return InfoPtr(fi_dupinfo(i));
  }
  if (why->empty()) *why = "it offers RMA writes on other domains only";
  return nullptr;
}

std::vector<std::string> available_providers() {
  std::vector<std::string> out;
  InfoPtr info = query("", nullptr);
  for (const fi_info* i = info.get(); i != nullptr; i = i->next) {
    const std::string name = i->fabric_attr->prov_name;
    if (std::find(out.begin(), out.end(), name) == out.end()) out.push_back(name);
  }
  return out;
}

std::optional<std::string> unavailable_reason(const std::string& provider) {
  const auto all = available_providers();
  if (provider.empty()) {
    for (const auto& p : all) {
      if (!single_host(p)) return std::nullopt;
    }
    return "no libfabric provider offering reliable-datagram endpoints across "
           "hosts (available: " +
           join(all) + ")";
  }
  int rc = 0;
  InfoPtr info = query(provider, &rc);
  if (info) return std::nullopt;
  return "libfabric provider '" + provider + "' is not available here (" + fi_text(rc) +
         "; available: " + join(all) + ")";
}

std::optional<std::string> write_unavailable_reason(const std::string& provider) {
  if (auto why = unavailable_reason(provider)) return why;
  InfoPtr list = query(provider, nullptr);
  const fi_info* chosen = choose(list.get(), provider);
  if (chosen == nullptr) return "libfabric provider '" + provider + "' is not available here";
  std::string why;
  if (write_info(chosen, &why)) return std::nullopt;
  return "libfabric provider '" + std::string(chosen->fabric_attr->prov_name) +
         "' cannot take the write data path: " + why;
}

std::optional<std::string> hmem_unavailable_reason(const std::string& provider) {
  if (auto why = write_unavailable_reason(provider)) return why;
  InfoPtr list = query(provider, nullptr);
  const fi_info* chosen = choose(list.get(), provider);
  std::string why;
  if (write_info(chosen, &why, true)) return std::nullopt;
  return "libfabric provider '" + std::string(chosen->fabric_attr->prov_name) +
         "' offers no device memory (FI_HMEM) on the write data path: " + why;
}

FabricOptions fitted(const Domain& dom, const FabricOptions& options, int rank) {
  FabricOptions o = options;
  const std::size_t max_msg = dom.info->ep_attr->max_msg_size;
  if (max_msg < o.slot_bytes) o.slot_bytes = max_msg - max_msg % 64;
  if (o.slot_bytes < rma::kPrefix + sizeof(FrameHeader) + 64) {
    throw Error(ErrorCode::kInvalidArgument,
                "fabric: provider '" + dom.provider + "' limits messages to " +
                    std::to_string(max_msg) + " bytes, too small for a fragment",
                rank);
  }
  return o;
}

std::shared_ptr<Domain> open_domain(const FabricOptions& options, int rank, std::size_t endpoints) {
  auto dom = std::make_shared<Domain>();
  int rc = 0;
  InfoPtr list = query(options.provider, &rc);
  const fi_info* chosen = choose(list.get(), options.provider);
  if (chosen == nullptr) {
    const std::string asked =
        options.provider.empty() ? "the default" : "'" + options.provider + "'";
    throw Error(ErrorCode::kInvalidArgument,
                "fabric: libfabric provider " + asked + " is not available (" +
                    (rc != 0 ? fi_text(rc) : "only single-host ones") +
                    "); available: " + join(available_providers()) +
                    " (set CommOptions::fabric_provider or DEAR_FABRIC_PROVIDER)",
                rank);
  }
  // The provider is chosen by its messages, so that the data path does not change which one
  // the default is; then its RMA writes, where asked for or (auto) offered.
  dom->provider = chosen->fabric_attr->prov_name;
  InfoPtr writes;
  if (options.data_path != DataPath::kSend) {
    std::string why;
    writes = write_info(chosen, &why);
    if (!writes && options.data_path == DataPath::kWrite) {
      throw Error(ErrorCode::kInvalidArgument,
                  "fabric: libfabric provider '" + dom->provider +
                      "' cannot take the write data path (" + why +
                      "); ask for 'send' or 'auto' (CommOptions::fabric_data_path or "
                      "DEAR_FABRIC_DATA_PATH)",
                  rank);
    }
  }
  if (writes && options.hmem) {
    // Device memory too, where the provider offers it on this domain; otherwise device
    // operations pass through pinned host memory (open_device_window answers nullopt).
    std::string why;
    if (InfoPtr h = write_info(chosen, &why, true)) {
      writes = std::move(h);
      dom->hmem = true;
    }
  }
  dom->write = writes != nullptr;
  const fi_info* use = writes ? writes.get() : chosen;
  dom->info.reset(fi_dupinfo(use));
  dom->register_sends = options.register_in_place || (use->domain_attr->mr_mode & FI_MR_LOCAL) != 0;
  (void)fitted(*dom, options, rank);  // a provider whose messages are too small fails here
  fid_fabric* fabric = nullptr;
  rc = fi_fabric(dom->info->fabric_attr, &fabric, nullptr);
  if (rc != 0) throw_fi("fi_fabric(" + dom->provider + ")", rc, rank);
  dom->fabric.reset(fabric);
  fid_domain* domain = nullptr;
  rc = fi_domain(fabric, dom->info.get(), &domain, nullptr);
  if (rc != 0) throw_fi("fi_domain(" + dom->provider + ")", rc, rank);
  dom->domain.reset(domain);
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  av_attr.count = std::max<std::size_t>(1, endpoints);
  fid_av* av = nullptr;
  rc = fi_av_open(domain, &av_attr, &av, nullptr);
  if (rc != 0) throw_fi("fi_av_open(" + dom->provider + ")", rc, rank);
  dom->av.reset(av);
  return dom;
}

}  // namespace dear::transport::fabric
