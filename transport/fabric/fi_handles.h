// Owning handles and the endpoint hints shared by the libfabric transport and the programs
// that measure libfabric next to it (bench/fabric_stream.cc), so that both ask the provider
// for the same kind of endpoint. Needs libfabric's headers (builds with DEAR_HAVE_FABRIC).
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_errno.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "dear/error.h"

namespace dear::transport::fabric {

inline constexpr std::uint32_t kApiVersion = FI_VERSION(1, 9);

inline std::string fi_text(long rc) { return fi_strerror(static_cast<int>(rc < 0 ? -rc : rc)); }

// Closes any libfabric object (endpoint, domain, CQ, MR, AV, fabric) through its fid.
template <class T>
struct FidCloser {
  void operator()(T* p) const {
    if (p != nullptr) fi_close(&p->fid);
  }
};
template <class T>
using FidPtr = std::unique_ptr<T, FidCloser<T>>;

struct InfoDeleter {
  void operator()(fi_info* i) const { fi_freeinfo(i); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

// Bytes of remote CQ data a write must carry: a fragment's 32-bit sequence number.
inline constexpr std::size_t kWriteDataBytes = 4;

// The eager buffer size dear gives the rxm provider (FI_OFI_RXM_BUFFER_SIZE) unless the user
// set one. rxm allocates, and clears, two pools of 1024 such buffers per endpoint as it is
// enabled; at its own default (16 KiB) that is 34 MB per endpoint: here, half a second of page
// faults to create a 2-rank communicator, and 250 MB per rank. dear's traffic over rxm is
// 64-byte control messages, RMA writes, and fragments of up to a slot (about 1 MiB), which rxm
// sends eagerly only up to this size; docs/transports.md, "libfabric transport", has the
// measurements.
inline constexpr const char* kRxmBufferSize = "4096";

// Sets the provider parameters above where the environment does not already; called before
// every fi_getinfo, so before libfabric reads them (once per process, as its providers load).
inline void set_provider_defaults() {
  static std::once_flag once;
  std::call_once(once, [] { ::setenv("FI_OFI_RXM_BUFFER_SIZE", kRxmBufferSize, 0); });
}

// Reliable-datagram endpoints with messages (FI_EP_RDM, FI_MSG), operation contexts the
// provider may use (FI_CONTEXT, FI_CONTEXT2), and the registration modes dear handles
// (local, virtual addresses, allocated memory, provider keys). `provider` empty: any.
// `writes`: also RMA writes to and from this endpoint with remote CQ data (FI_RMA, FI_WRITE,
// FI_REMOTE_WRITE), accepting that such a write consumes a posted receive (FI_RX_CQ_DATA) and
// that registrations belong to an endpoint (FI_MR_ENDPOINT): the write data path handles both.
inline InfoPtr rdm_hints(const std::string& provider, fi_threading threading, bool writes = false,
                         bool hmem = false) {
  set_provider_defaults();
  InfoPtr hints(fi_allocinfo());
  if (!hints) throw Error(ErrorCode::kSystem, "fi_allocinfo failed: out of memory");
  hints->ep_attr->type = FI_EP_RDM;
  // Tagged messages: the channels of one communicator share one endpoint, and each receives
  // only what is tagged with its number there (fabric_domain.h, Hub).
  hints->caps = FI_MSG | FI_TAGGED;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  if (writes) {
    hints->caps |= FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
    hints->mode |= FI_RX_CQ_DATA;
    hints->domain_attr->mr_mode |= FI_MR_ENDPOINT;
    hints->domain_attr->cq_data_size = kWriteDataBytes;
  }
  if (hmem) {
    hints->caps |= FI_HMEM;
    hints->domain_attr->mr_mode |= FI_MR_HMEM;
  }
  hints->domain_attr->threading = threading;
  if (!provider.empty()) hints->fabric_attr->prov_name = ::strdup(provider.c_str());
  return hints;
}

// Registers [p, p + n) with `domain` for `access`, as the domain's registration mode
// (`mr_mode`, from its fi_info) asks: the provider picks the key under FI_MR_PROV_KEY, else
// `key` (unique in the domain) is requested; under FI_MR_ENDPOINT the registration is bound to
// `ep` (then required) and enabled. Returns the fi_* code, 0 on success (then *out is set).
inline int register_region(fid_domain* domain, std::uint64_t mr_mode, const void* p, std::size_t n,
                           std::uint64_t access, std::uint64_t key, fid_ep* ep, fid_mr** out) {
  if ((mr_mode & FI_MR_ENDPOINT) != 0 && ep == nullptr) return -FI_EINVAL;
  fid_mr* mr = nullptr;
  int rc = fi_mr_reg(domain, p, n, access, 0, (mr_mode & FI_MR_PROV_KEY) != 0 ? 0 : key, 0, &mr,
                     nullptr);
  if (rc != 0) return rc;
  if ((mr_mode & FI_MR_ENDPOINT) != 0) {
    rc = fi_mr_bind(mr, &ep->fid, 0);
    if (rc == 0) rc = fi_mr_enable(mr);
    if (rc != 0) {
      fi_close(&mr->fid);
      return rc;
    }
  }
  *out = mr;
  return 0;
}

// register_region() for CUDA device memory on `cuda_device` (a domain opened with FI_HMEM):
// fi_mr_regattr with FI_HMEM_CUDA. Compiled, not run with device memory.
inline int register_hmem(fid_domain* domain, std::uint64_t mr_mode, const void* p, std::size_t n,
                         std::uint64_t access, std::uint64_t key, int cuda_device, fid_mr** out) {
  if ((mr_mode & FI_MR_ENDPOINT) != 0) return -FI_EINVAL;  // no endpoint to bind it to
  iovec iov{const_cast<void*>(p), n};
  fi_mr_attr attr{};
  attr.mr_iov = &iov;
  attr.iov_count = 1;
  attr.access = access;
  attr.requested_key = (mr_mode & FI_MR_PROV_KEY) != 0 ? 0 : key;
  attr.iface = FI_HMEM_CUDA;
  attr.device.cuda = cuda_device;
  return fi_mr_regattr(domain, &attr, 0, out);
}

}  // namespace dear::transport::fabric
