// The ibverbs transport. The pure parts (connection attributes, GID choice, device names, the
// registration cache) run everywhere; the parts that need an RDMA device skip, with the
// reason unavailable_reason() gives, where there is none. The slot/credit protocol and the
// fragmenting verbs shares with fabric are tested in test_rma.cc (transport/rma/).
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "channel_exchange.h"
#include "dear/bootstrap.h"
#include "dear/error.h"
#include "harness.h"
#include "transport/rma/reg_cache.h"
#include "transport/verbs/qp_plan.h"
#include "transport/verbs/verbs_link.h"

namespace dear::testing {
namespace {

using namespace std::chrono_literals;
using transport::rma::RegistrationCache;
using transport::verbs::choose_gid_index;
using transport::verbs::ConnectionPlan;
using transport::verbs::Gid;
using transport::verbs::GidEntry;
using transport::verbs::GidType;
using transport::verbs::LinkLayer;
using transport::verbs::plan_connection;
using transport::verbs::QpEndpoint;
using transport::verbs::VerbsOptions;

QpEndpoint ib_end(std::uint16_t lid, std::uint32_t mtu, std::uint32_t qpn, std::uint32_t psn) {
  QpEndpoint e;
  e.link_layer = LinkLayer::kInfiniBand;
  e.lid = lid;
  e.mtu = mtu;
  e.qpn = qpn;
  e.psn = psn;
  e.gid = Gid{0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8};
  return e;
}

Gid ipv4_gid(std::uint8_t a, std::uint8_t b, std::uint8_t c, std::uint8_t d) {
  return Gid{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, b, c, d};
}

// ---- connection attributes
// ----------------------------------------------------------------

TEST(VerbsPlan, DefaultsOnInfiniBandWithinASubnet) {
  const ConnectionPlan p =
      plan_connection(ib_end(7, 4096, 100, 0x123456), ib_end(9, 4096, 200, 0xabcdef), 1, {});
  EXPECT_EQ(p.path_mtu, 4096u);
  EXPECT_EQ(p.dest_qpn, 200u);
  EXPECT_EQ(p.rq_psn, 0xabcdefu) << "the receive PSN is the peer's send PSN";
  EXPECT_EQ(p.sq_psn, 0x123456u);
  EXPECT_EQ(p.dlid, 9);
  EXPECT_FALSE(p.use_grh) << "same subnet, peer has a LID: no GRH";
  EXPECT_EQ(p.timeout, 18);
  EXPECT_EQ(p.retry_count, 7);
  EXPECT_EQ(p.rnr_retry, 7);
  EXPECT_EQ(p.min_rnr_timer, 12);
  EXPECT_EQ(p.max_rd_atomic, 1);
  EXPECT_EQ(p.max_dest_rd_atomic, 1);
  EXPECT_EQ(p.port, 1);
}

TEST(VerbsPlan, PathMtuIsTheSmallestOfBothPortsAndTheOption) {
  EXPECT_EQ(plan_connection(ib_end(1, 4096, 1, 1), ib_end(2, 2048, 2, 2), 1, {}).path_mtu, 2048u);
  EXPECT_EQ(plan_connection(ib_end(1, 1024, 1, 1), ib_end(2, 4096, 2, 2), 1, {}).path_mtu, 1024u);
  VerbsOptions o;
  o.mtu = 512;
  EXPECT_EQ(plan_connection(ib_end(1, 4096, 1, 1), ib_end(2, 4096, 2, 2), 1, o).path_mtu, 512u);
  o.mtu = 1500;
  EXPECT_THROW((void)plan_connection(ib_end(1, 4096, 1, 1), ib_end(2, 4096, 2, 2), 1, o), Error);
}

TEST(VerbsPlan, PsnsAreTwentyFourBits) {
  const auto p =
      plan_connection(ib_end(1, 4096, 1, 0xff000001), ib_end(2, 4096, 2, 0x1ffffff), 1, {});
  EXPECT_EQ(p.sq_psn, 1u);
  EXPECT_EQ(p.rq_psn, 0xffffffu);
}

TEST(VerbsPlan, OptionsAreCarriedAndCheckedWithTheirNames) {
  VerbsOptions o;
  o.timeout = 14;
  o.retry_count = 3;
  o.rnr_retry = 6;
  o.min_rnr_timer = 1;
  o.service_level = 5;
  const auto p = plan_connection(ib_end(1, 4096, 1, 1), ib_end(2, 4096, 2, 2), 2, o);
  EXPECT_EQ(p.timeout, 14);
  EXPECT_EQ(p.retry_count, 3);
  EXPECT_EQ(p.rnr_retry, 6);
  EXPECT_EQ(p.min_rnr_timer, 1);
  EXPECT_EQ(p.service_level, 5);
  EXPECT_EQ(p.port, 2);
  const auto rejects = [](VerbsOptions bad, const std::string& name) {
    try {
      (void)plan_connection(ib_end(1, 4096, 1, 1), ib_end(2, 4096, 2, 2), 1, bad, 0, 1);
      ADD_FAILURE() << name << " out of range was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  VerbsOptions b = o;
  b.timeout = 32;
  rejects(b, "timeout=32");
  b = o;
  b.retry_count = 8;
  rejects(b, "retry_count=8");
  b = o;
  b.rnr_retry = 9;
  rejects(b, "rnr_retry=9");
  b = o;
  b.service_level = 16;
  rejects(b, "service_level=16");
}

// The GPU flush's queue pair is connected to itself: the plan for an endpoint towards itself
// targets its own queue pair, LID or GID and sequence numbers, and allows the one RDMA READ the
// flush needs in flight.
TEST(VerbsPlan, AQueuePairConnectedToItselfTargetsItself) {
  const QpEndpoint ib = ib_end(7, 2048, 300, 0x42);
  ConnectionPlan p = plan_connection(ib, ib, 1, {});
  EXPECT_EQ(p.dest_qpn, 300u);
  EXPECT_EQ(p.dlid, 7);
  EXPECT_EQ(p.rq_psn, 0x42u);
  EXPECT_EQ(p.sq_psn, 0x42u);
  EXPECT_EQ(p.path_mtu, 2048u);
  EXPECT_FALSE(p.use_grh);
  EXPECT_GE(p.max_rd_atomic, 1);
  EXPECT_GE(p.max_dest_rd_atomic, 1);

  QpEndpoint roce = ib;
  roce.link_layer = LinkLayer::kEthernet;
  roce.gid = ipv4_gid(10, 0, 0, 7);
  roce.gid_index = 3;
  p = plan_connection(roce, roce, 1, {});
  EXPECT_TRUE(p.use_grh);
  EXPECT_EQ(p.dgid, roce.gid);
  EXPECT_EQ(p.sgid_index, 3);
  EXPECT_EQ(p.dest_qpn, 300u);
}

TEST(VerbsPlan, GlobalRoutingAcrossSubnetsWithoutALidAndAlwaysOnRoce) {
  QpEndpoint a = ib_end(1, 4096, 1, 1);
  QpEndpoint b = ib_end(2, 4096, 2, 2);
  b.gid[7] = 9;  // another subnet prefix
  a.gid_index = 3;
  auto p = plan_connection(a, b, 1, {});
  EXPECT_TRUE(p.use_grh);
  EXPECT_EQ(p.dgid, b.gid);
  EXPECT_EQ(p.sgid_index, 3);
  EXPECT_EQ(p.hop_limit, 255);
  b = ib_end(0, 4096, 2, 2);
  EXPECT_TRUE(plan_connection(a, b, 1, {}).use_grh) << "a peer without a LID is routed";

  QpEndpoint ra = a, rb = b;
  ra.link_layer = rb.link_layer = LinkLayer::kEthernet;
  ra.gid = ipv4_gid(10, 0, 0, 1);
  rb.gid = ipv4_gid(10, 0, 0, 2);
  VerbsOptions o;
  o.traffic_class = 106;
  p = plan_connection(ra, rb, 1, o);
  EXPECT_TRUE(p.use_grh);
  EXPECT_EQ(p.dlid, 0);
  EXPECT_EQ(p.dgid, rb.gid);
  EXPECT_EQ(p.traffic_class, 106);
  rb.gid = Gid{};
  try {
    (void)plan_connection(ra, rb, 1, {}, 0, 1);
    ADD_FAILURE() << "a RoCE peer without a GID was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMismatch);
    EXPECT_NE(std::string(e.what()).find("rank 1 sent no GID"), std::string::npos) << e.what();
  }
}

TEST(VerbsPlan, DifferentLinkLayersAreAMismatchNamingBothRanks) {
  QpEndpoint a = ib_end(1, 4096, 1, 1);
  QpEndpoint b = ib_end(2, 4096, 2, 2);
  b.link_layer = LinkLayer::kEthernet;
  try {
    (void)plan_connection(a, b, 1, {}, 3, 4);
    ADD_FAILURE() << "mixed link layers were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMismatch);
    EXPECT_NE(std::string(e.what()).find("rank 3's port is InfiniBand"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 4's is Ethernet"), std::string::npos) << e.what();
  }
}

TEST(VerbsPlan, MtuCodesMatchIbverbs) {
  // IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5.
  EXPECT_EQ(transport::verbs::mtu_bytes(1), 256u);
  EXPECT_EQ(transport::verbs::mtu_bytes(5), 4096u);
  EXPECT_EQ(transport::verbs::mtu_bytes(0), 0u);
  EXPECT_EQ(transport::verbs::mtu_bytes(6), 0u);
  EXPECT_EQ(transport::verbs::mtu_code(2048), 4);
  EXPECT_EQ(transport::verbs::mtu_code(1500), 0);
}

// ---- GID choice
// ----------------------------------------------------------------------------

TEST(VerbsGid, RocePrefersV2WithAnIpv4AddressThenV2ThenV1) {
  const Gid link_local{0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8};
  const Gid global6{0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  std::vector<GidEntry> table = {
      {0, GidType::kRoceV1, link_local},
      {1, GidType::kRoceV2, link_local},
      {2, GidType::kRoceV1, ipv4_gid(10, 0, 0, 1)},
      {3, GidType::kRoceV2, ipv4_gid(10, 0, 0, 1)},
      {4, GidType::kRoceV2, global6},
  };
  EXPECT_EQ(choose_gid_index(table, LinkLayer::kEthernet, -1), 3);
  table.erase(table.begin() + 3);
  EXPECT_EQ(choose_gid_index(table, LinkLayer::kEthernet, -1), 4) << "routable v2 next";
  table.pop_back();
  EXPECT_EQ(choose_gid_index(table, LinkLayer::kEthernet, -1), 1) << "any v2 before v1";
  table.erase(table.begin() + 1);
  EXPECT_EQ(choose_gid_index(table, LinkLayer::kEthernet, -1), 0) << "v1, lowest index";
}

TEST(VerbsGid, RequestedIndexMustExistAndAnEmptyRoceTableIsNamed) {
  const std::vector<GidEntry> table = {{0, GidType::kRoceV2, ipv4_gid(10, 0, 0, 1)},
                                       {5, GidType::kRoceV1, ipv4_gid(10, 0, 0, 1)}};
  EXPECT_EQ(choose_gid_index(table, LinkLayer::kEthernet, 5), 5) << "an explicit choice wins";
  try {
    (void)choose_gid_index(table, LinkLayer::kEthernet, 2);
    ADD_FAILURE() << "a missing index was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("gid_index=2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("5 (RoCE v1"), std::string::npos) << e.what();
  }
  try {
    (void)choose_gid_index({}, LinkLayer::kEthernet, -1);
    ADD_FAILURE() << "an empty RoCE table was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no usable RoCE GID"), std::string::npos) << e.what();
  }
  EXPECT_EQ(choose_gid_index({}, LinkLayer::kInfiniBand, -1), 0) << "IB works on LIDs";
}

TEST(VerbsGid, DeviceSpecsNameADeviceAndOptionallyAPort) {
  using transport::verbs::parse_device_spec;
  EXPECT_EQ(parse_device_spec("mlx5_0").name, "mlx5_0");
  EXPECT_EQ(parse_device_spec("mlx5_0").port, 0);
  EXPECT_EQ(parse_device_spec("mlx5_1:2").name, "mlx5_1");
  EXPECT_EQ(parse_device_spec("mlx5_1:2").port, 2);
  EXPECT_EQ(parse_device_spec("").name, "");
  EXPECT_THROW((void)parse_device_spec("mlx5_0:"), Error);
  EXPECT_THROW((void)parse_device_spec("mlx5_0:x"), Error);
  EXPECT_THROW((void)parse_device_spec("mlx5_0:0"), Error);
  EXPECT_THROW((void)parse_device_spec(":1"), Error);
}

// ---- registration cache
// --------------------------------------------------------------------

const char* at(std::uintptr_t a) { return reinterpret_cast<const char*>(a); }

TEST(VerbsRegCache, LookupFindsACoveringEntryOnly) {
  RegistrationCache c;
  EXPECT_FALSE(c.lookup(at(0x1000), 16));
  EXPECT_TRUE(c.insert(at(0x1000), 0x1000, 11).empty());
  EXPECT_TRUE(c.insert(at(0x4000), 0x2000, 22).empty());
  ASSERT_TRUE(c.lookup(at(0x1000), 0x1000));
  EXPECT_EQ(c.lookup(at(0x1800), 0x10)->handle, 11u);
  EXPECT_EQ(c.lookup(at(0x5fff), 1)->handle, 22u);
  EXPECT_FALSE(c.lookup(at(0x1800), 0x1000)) << "runs past the entry's end";
  EXPECT_FALSE(c.lookup(at(0x2000), 1)) << "just past the first entry";
  EXPECT_FALSE(c.lookup(at(0x3fff), 2)) << "straddles the second entry's start";
  EXPECT_FALSE(c.lookup(at(0x800), 0x900)) << "starts before the first entry";
  EXPECT_EQ(c.size(), 2u);
}

TEST(VerbsRegCache, InsertEvictsOverlappingEntriesAndInvalidateReturnsHandles) {
  RegistrationCache c;
  (void)c.insert(at(0x1000), 0x1000, 1);
  (void)c.insert(at(0x3000), 0x1000, 2);
  (void)c.insert(at(0x6000), 0x1000, 3);
  auto out = c.insert(at(0x1800), 0x2000, 4);  // overlaps 1 and 2, not 3
  std::sort(out.begin(), out.end());
  EXPECT_EQ(out, (std::vector<std::uint64_t>{1, 2}));
  EXPECT_EQ(c.size(), 2u);
  EXPECT_EQ(c.lookup(at(0x2000), 0x100)->handle, 4u);
  EXPECT_TRUE(c.invalidate(at(0x5000), 0x1000).empty()) << "touches nothing";
  EXPECT_EQ(c.invalidate(at(0x6fff), 1), (std::vector<std::uint64_t>{3}));
  EXPECT_TRUE(c.invalidate(at(0x3800), 0).empty());
  EXPECT_EQ(c.clear(), (std::vector<std::uint64_t>{4}));
  EXPECT_EQ(c.size(), 0u);
}

// Device sources (rma::DeviceSources, shared with libfabric): found only where a registration
// covers the whole range, overlaps seen for any byte in common, forgotten ones released through
// the send registrations once no send reads them, and every handle handed back at the end.
TEST(VerbsRegCache, DeviceSourcesAreFoundByRangeAndReleasedWhenForgotten) {
  transport::rma::DeviceSources d;
  std::vector<std::uint64_t> released;
  transport::rma::SendRegistrations sends([&](std::uint64_t h) { released.push_back(h); });
  d.add(at(0x1000), 0x1000, 7);
  d.add(at(0x4000), 0x2000, 8);
  EXPECT_EQ(d.find(at(0x1800), 0x800), std::optional<std::uint64_t>(7));
  EXPECT_EQ(d.find(at(0x1800), 0x801), std::nullopt) << "runs past the registration";
  EXPECT_EQ(d.find(at(0x5000), 0x100), std::optional<std::uint64_t>(8));
  EXPECT_TRUE(d.overlaps(at(0x1fff), 0x100));
  EXPECT_FALSE(d.overlaps(at(0x2000), 0x2000)) << "ends where the second begins";
  EXPECT_FALSE(d.overlaps(at(0x1000), 0)) << "no bytes";
  sends.hold();  // a send is reading registered memory: nothing is released yet
  d.forget(at(0x0), 0x1001, sends);
  EXPECT_EQ(d.find(at(0x1000), 0x10), std::nullopt);
  EXPECT_TRUE(released.empty());
  sends.done();
  EXPECT_EQ(released, (std::vector<std::uint64_t>{7}));
  EXPECT_EQ(d.take_all(), (std::vector<std::uint64_t>{8}));
  EXPECT_FALSE(d.overlaps(at(0x4000), 0x10));
}

TEST(VerbsRegCache, LeastRecentlyUsedGoesFirstBeyondCapacity) {
  RegistrationCache c(2);
  (void)c.insert(at(0x1000), 0x1000, 1);
  (void)c.insert(at(0x2000), 0x1000, 2);
  ASSERT_TRUE(c.lookup(at(0x1000), 1));  // 1 is now the more recent
  EXPECT_EQ(c.insert(at(0x8000), 0x1000, 3), (std::vector<std::uint64_t>{2}));
  EXPECT_TRUE(c.lookup(at(0x1000), 1));
  EXPECT_FALSE(c.lookup(at(0x2000), 1));
  EXPECT_THROW(RegistrationCache(0), Error);
  EXPECT_THROW((void)c.insert(at(0x9000), 0, 4), Error);
}

TEST(VerbsRegCache, PageSpanCoversTheRangeWithWholePages) {
  const auto s = RegistrationCache::page_span(at(0x1234), 0x100);
  EXPECT_EQ(s.begin, 0x1000u);
  EXPECT_EQ(s.end, 0x2000u);
  const auto t = RegistrationCache::page_span(at(0x1000), 0x2000);
  EXPECT_EQ(t.begin, 0x1000u);
  EXPECT_EQ(t.end, 0x3000u);
  const auto u = RegistrationCache::page_span(at(0x1ff0), 0x20);
  EXPECT_EQ(u.end, 0x3000u);
}

// ---- on a device
// ---------------------------------------------------------------------------

class VerbsDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto why = transport::verbs::unavailable_reason()) GTEST_SKIP() << *why;
  }
};

TEST(VerbsSetup, UnavailableReasonSaysWhy) {
  const auto why = transport::verbs::unavailable_reason();
  if (!why) GTEST_SKIP() << "an RDMA device is present: nothing to explain";
  if (!transport::verbs::built()) {
    EXPECT_NE(why->find("no ibverbs transport"), std::string::npos) << *why;
  } else if (transport::verbs::devices().empty()) {
    EXPECT_NE(why->find("no RDMA device found"), std::string::npos) << *why;
  }
  EXPECT_FALSE(transport::verbs::available());
}

TEST(VerbsSetup, ConnectWithoutADeviceFailsOnEveryRankNamingTheReason) {
  if (transport::verbs::available()) GTEST_SKIP() << "an RDMA device is present";
  const auto errors = run_bootstraps(
      2, [](Bootstrap& bs) { auto ring = transport::verbs::connect_ring(bs, 1, {}); });
  for (const auto& e : errors) {
    ASSERT_TRUE(e) << "connect succeeded without a device";
    EXPECT_EQ(code_of(e), ErrorCode::kInvalidArgument) << what_of(e);
    EXPECT_NE(what_of(e).find(*transport::verbs::unavailable_reason()), std::string::npos)
        << "connect names the same reason: " << what_of(e);
  }
}

TEST_F(VerbsDevice, UnknownDeviceIsNamedWithTheDevicesThereAre) {
  VerbsOptions o;
  o.device = "no-such-device";
  const auto why = transport::verbs::unavailable_reason(o);
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("'no-such-device'"), std::string::npos) << *why;
  EXPECT_NE(why->find(transport::verbs::devices().front()), std::string::npos) << *why;
}

// Ranks as threads over the first active port (loopback through the NIC): every rank joined
// to rank^1 and rank^2 exchanges messages of several sizes, one spanning many slots, both ways
// (tests/channel_exchange.h).
TEST_F(VerbsDevice, ConnectPeersExchangesBothWaysOnEveryChannel) {
  const auto failures = exchange_with_peers(4, [](Bootstrap& bs, const std::vector<int>& peers) {
    return transport::verbs::connect_peers(bs, peers, {});
  });
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// Direct writes (tests/channel_exchange.h): a message of 1 MiB written straight into the
// window the receiver opened, in four writes of 256 KiB, a small one through slots, every byte
// of the window checked.
TEST_F(VerbsDevice, DirectWritesLandInTheWindow) {
  const auto failures = write_into_window(
      [](Bootstrap& bs, const std::vector<int>& peers) {
        VerbsOptions o;
        o.direct_bytes = 4096;
        o.direct_write_bytes = 256 * 1024;
        return transport::verbs::connect_peers(bs, peers, o);
      },
      1 << 20);
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

}  // namespace
}  // namespace dear::testing
