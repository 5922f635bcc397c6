#include "collectives/steps.h"

#include <algorithm>
#include <bit>
#include <stdexcept>
#include <string>
#include <utility>

namespace dear::collectives {
namespace {

// Ranks beyond the largest power of two are folded into their odd neighbours (see steps.h).
struct Fold {
  int n;
  int p;    // largest power of two <= n
  int rem;  // n - p: the first 2 * rem ranks pair up
  int levels;

  explicit Fold(int nranks)
      : n(nranks),
        p(static_cast<int>(std::bit_floor(static_cast<unsigned>(nranks)))),
        rem(nranks - p),
        levels(std::countr_zero(static_cast<unsigned>(p))) {}
  [[nodiscard]] bool folded(int r) const { return r < 2 * rem; }
  // Virtual rank of real rank r; -1 for the even ranks that hand their data over.
  [[nodiscard]] int vrank(int r) const {
    if (!folded(r)) return r - rem;
    return r % 2 == 1 ? r / 2 : -1;
  }
  [[nodiscard]] int real(int v) const { return v < rem ? 2 * v + 1 : v + rem; }
  // First real rank whose block virtual rank v holds (v = p gives n): contiguous and rising.
  [[nodiscard]] int first_block(int v) const { return v < rem ? 2 * v : v + rem; }
};

constexpr int kTagFoldIn = 0;
constexpr int kTagCore = 1;  // core step j carries tag kTagCore + j
[[nodiscard]] int tag_fold_out(const Fold& f) { return kTagCore + 2 * f.levels; }

struct Range {
  std::size_t offset;
  std::size_t bytes;
};

class Builder {
 public:
  explicit Builder(StepPlan& plan) : plan_(plan) {}

  void send(int tag, int peer, Range r) { add(tag, peer, r, -1, {0, 0}, false, false, false); }
  void recv(int tag, int peer, Range r, bool reduce, bool final = false) {
    add(tag, -1, {0, 0}, peer, r, reduce, final, false);
  }
  void exchange(int tag, int peer, Range out, Range in, bool reduce, bool final, bool wait_send) {
    add(tag, peer, out, peer, in, reduce, final, wait_send);
  }
  // all_to_all: sends read the input (Step::send_input), receives are copied into the output;
  // either peer may be -1 (a send-only or receive-only step).
  // `keep_empty`: the step stays even where a half is empty (all_to_all_v, whose ends do not
  // compute each other's sizes).
  void shift(int tag, int to, Range out, int from, Range in, bool keep_empty = false) {
    add(tag, to, to >= 0 ? out : Range{0, 0}, from, from >= 0 ? in : Range{0, 0}, false, false,
        false, true, keep_empty);
  }
  // Marks the last reducing step final (the tree's root).
  void finalize_last_reduce() {
    for (auto it = plan_.steps.rbegin(); it != plan_.steps.rend(); ++it) {
      if (it->reduce) {
        it->final = true;
        return;
      }
    }
  }

 private:
  void add(int tag, int send_peer, Range out, int recv_peer, Range in, bool reduce, bool final,
           bool wait_send, bool send_input = false, bool keep_empty = false) {
    // Both ends compute the same byte counts, so an empty half is dropped on both.
    if (out.bytes == 0 && !keep_empty) send_peer = -1;
    if (in.bytes == 0 && !keep_empty) recv_peer = -1;
    if (send_peer < 0 && recv_peer < 0) return;
    Step s;
    s.tag = tag;
    s.send_peer = send_peer;
    s.send_offset = send_peer >= 0 ? out.offset : 0;
    s.send_bytes = send_peer >= 0 ? out.bytes : 0;
    s.send_input = send_peer >= 0 && send_input;
    s.recv_peer = recv_peer;
    if (recv_peer >= 0) {
      s.recv_offset = in.offset;
      s.recv_bytes = in.bytes;
      s.reduce = reduce;
      s.final = reduce && final;
      s.wait_send = wait_send && send_peer >= 0;
      if (reduce) {
        s.stage_offset = plan_.stage_bytes;
        plan_.stage_bytes += in.bytes;
      }
    }
    plan_.steps.push_back(s);
  }

  StepPlan& plan_;
};

// Byte boundaries of the virtual ranks' parts of the work buffer: bound(v) .. bound(v + 1).
class Bounds {
 public:
  // all_reduce: the vector split into p nearly equal parts.
  static Bounds of_vector(const Fold& f, std::size_t count, std::size_t el) {
    return Bounds(f, count, el, false);
  }
  // reduce_scatter / all_gather: virtual rank v holds the blocks of real ranks
  // first_block(v) .. first_block(v + 1).
  static Bounds of_blocks(const Fold& f, std::size_t count, std::size_t el) {
    return Bounds(f, count, el, true);
  }
  [[nodiscard]] std::size_t at(int v) const {
    const auto uv = static_cast<std::size_t>(v);
    if (blocks_) return static_cast<std::size_t>(f_.first_block(v)) * count_ * el_;
    const auto p = static_cast<std::size_t>(f_.p);
    const std::size_t base = count_ / p;
    const std::size_t extra = count_ % p;
    return (uv * base + std::min(uv, extra)) * el_;
  }
  [[nodiscard]] Range range(int lo, int hi) const { return {at(lo), at(hi) - at(lo)}; }

 private:
  Bounds(const Fold& f, std::size_t count, std::size_t el, bool blocks)
      : f_(f), count_(count), el_(el), blocks_(blocks) {}
  Fold f_;
  std::size_t count_;
  std::size_t el_;
  bool blocks_;
};

// Recursive halving over the virtual ranks: each step keeps the half of the current range that
// holds this rank's part, sends the other half to the partner and reduces what it sends back.
void halving(Builder& b, const Fold& f, const Bounds& bounds, int v) {
  int lo = 0;
  int hi = f.p;
  for (int k = 0; k < f.levels; ++k) {
    const int d = f.p >> (k + 1);
    const int mid = lo + d;
    const bool low = v < mid;
    const Range keep = low ? bounds.range(lo, mid) : bounds.range(mid, hi);
    const Range give = low ? bounds.range(mid, hi) : bounds.range(lo, mid);
    b.exchange(kTagCore + k, f.real(v ^ d), give, keep, true, k == f.levels - 1, false);
    if (low) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
}

// Recursive doubling of ranges: after step k this rank holds its group of 2^(k+1) parts.
void doubling(Builder& b, const Fold& f, const Bounds& bounds, int v, int first_tag) {
  for (int k = 0; k < f.levels; ++k) {
    const int d = 1 << k;
    const int mine = (v / d) * d;
    const int theirs = ((v ^ d) / d) * d;
    b.exchange(first_tag + k, f.real(v ^ d), bounds.range(mine, mine + d),
               bounds.range(theirs, theirs + d), false, false, false);
  }
}

void plan_all_reduce(Builder& b, Schedule s, int r, int n, std::size_t count, std::size_t el) {
  const Range whole{0, count * el};
  if (s == Schedule::kTree) {
    // Binomial tree rooted at rank 0: reduce up, then broadcast down the same edges.
    const int levels = static_cast<int>(std::bit_width(static_cast<unsigned>(n - 1)));
    const int low = r == 0 ? levels : std::countr_zero(static_cast<unsigned>(r));
    for (int k = 0; k < low; ++k) {
      if (r + (1 << k) < n) b.recv(k, r + (1 << k), whole, true);
    }
    if (r == 0) {
      b.finalize_last_reduce();
    } else {
      b.send(low, r - (1 << low), whole);
      b.recv(levels + low, r - (1 << low), whole, false);
    }
    for (int k = low - 1; k >= 0; --k) {
      if (r + (1 << k) < n) b.send(levels + k, r + (1 << k), whole);
    }
    return;
  }
  const Fold f(n);
  if (f.folded(r) && r % 2 == 0) {
    b.send(kTagFoldIn, r + 1, whole);
    b.recv(tag_fold_out(f), r + 1, whole, false);
    return;
  }
  if (f.folded(r)) b.recv(kTagFoldIn, r - 1, whole, true);
  const int v = f.vrank(r);
  if (s == Schedule::kRecursiveDoubling) {
    for (int k = 0; k < f.levels; ++k) {
      b.exchange(kTagCore + k, f.real(v ^ (1 << k)), whole, whole, true, k == f.levels - 1, true);
    }
  } else {
    const Bounds bounds = Bounds::of_vector(f, count, el);
    halving(b, f, bounds, v);
    doubling(b, f, bounds, v, kTagCore + f.levels);
  }
  if (f.folded(r)) b.send(tag_fold_out(f), r - 1, whole);
}

// The path from rank 0 to `root` along the tree's edges (plan_reduce_tree, plan_gather_tree):
// every rank on it but rank 0, with the rank before it. r is on the path when it is the root with
// its lowest bits cleared; the hop that adds bit 2^j carries tag `first_tag` + j.
struct PathHop {
  int from = -1;  // -1: r receives nothing on the path
  int to = -1;    // -1: r sends nothing on the path
  int in_tag = 0;
  int out_tag = 0;
};
PathHop path_hop(int r, int root, int first_tag) {
  PathHop h;
  if (root == 0) return h;
  const int low = r == 0 ? 0 : std::countr_zero(static_cast<unsigned>(r));
  if (r != 0) {
    if ((root >> low << low) != r) return h;  // not on the path
    h.from = r & (r - 1);
    h.in_tag = first_tag + low;
  }
  if (r == root) return h;
  const int below = r == 0 ? root : root & ((1 << low) - 1);
  const int bit = static_cast<int>(std::bit_width(static_cast<unsigned>(below))) - 1;
  h.to = r | (1 << bit);
  h.out_tag = first_tag + bit;
  return h;
}

// Blocks [range.first, range.second) of `block` bytes each, as a byte range.
Range block_range(std::size_t block, std::pair<int, int> range) {
  return Range{static_cast<std::size_t>(range.first) * block,
               static_cast<std::size_t>(range.second - range.first) * block};
}

// Where the subtree of `rank` ends in the tree rooted at rank 0 (the one with a path): at the
// lower of n and the rank plus 2^(its lowest set bit).
int subtree_end(int rank, int n) {
  return rank == 0 ? n : std::min(n, rank + (1 << std::countr_zero(static_cast<unsigned>(rank))));
}

// The binomial tree of a reduce, gather or scatter. On a power of two of ranks it is rooted at the
// root itself: rank r sits at virtual rank r ^ root, so its tree edges (virtual v and v ^ 2^k) are
// still the mesh links r and r ^ 2^k, and no path is needed. Otherwise it is rooted at rank 0
// and the result goes on down the path to the root (path_hop).
struct RootedTree {
  int x;       // real rank = virtual rank ^ x
  int levels;  // the tree's height
  int v;       // this rank's virtual rank
  int low;     // v's lowest set bit (levels for the tree's root): r's subtree has 2^low ranks
  bool path;   // the result still goes from rank 0 to the root

  RootedTree(int r, int n, int root)
      : x(std::has_single_bit(static_cast<unsigned>(n)) ? root : 0),
        levels(static_cast<int>(std::bit_width(static_cast<unsigned>(n - 1)))),
        v(r ^ x),
        low(v == 0 ? levels : std::countr_zero(static_cast<unsigned>(v))),
        path(x == 0 && root != 0) {}
  [[nodiscard]] int real(int vr) const { return vr ^ x; }
  // The real ranks of virtual rank u's subtree of height h: an aligned range, clipped to n.
  [[nodiscard]] std::pair<int, int> subtree(int u, int h, int n) const {
    const int lo = real(u) & ~((1 << h) - 1);
    return {std::min(lo, n), std::min(lo + (1 << h), n)};
  }
};

// reduce (an all_reduce with a root, ops.h): the tree's reduction (RootedTree), each rank
// reducing its children's partial results and handing its own up, then, where the tree is
// rooted at rank 0, the result down a path of the tree's edges to the root: through the ranks
// whose bits are the root's highest ones (root 6 = 110: 0 -> 4 -> 6), each hop one bit, so
// every hop is a mesh link. No rank but those on the path receives the result.
void plan_reduce_tree(Builder& b, int r, int n, int root, std::size_t count, std::size_t el) {
  const Range whole{0, count * el};
  const RootedTree t(r, n, root);
  for (int k = 0; k < t.low; ++k) {
    if (t.real(t.v + (1 << k)) < n) b.recv(k, t.real(t.v + (1 << k)), whole, true);
  }
  if (t.v == 0) {
    b.finalize_last_reduce();
  } else {
    b.send(t.low, t.real(t.v - (1 << t.low)), whole);
  }
  if (!t.path) return;
  const PathHop h = path_hop(r, root, t.levels);
  if (h.from >= 0) b.recv(h.in_tag, h.from, whole, false);
  if (h.to >= 0) b.send(h.out_tag, h.to, whole);
}

// gather (an all_gather with a root, ops.h): the tree (RootedTree), each rank handing up the
// blocks of its subtree, then, where the tree is rooted at rank 0, rank 0's whole result down
// the path to the root as in plan_reduce_tree. A rank on the path holds its subtree's blocks
// already: it receives the rest, below and above them, in two messages (the second's tag
// `levels` above the first's).
void plan_gather_tree(Builder& b, int r, int n, int root, std::size_t count, std::size_t el) {
  const std::size_t block = count * el;
  const auto blocks = [block](std::pair<int, int> range) { return block_range(block, range); };
  const RootedTree t(r, n, root);
  for (int k = 0; k < t.low; ++k) {
    const int child = t.v + (1 << k);
    if (t.real(child) < n) b.recv(k, t.real(child), blocks(t.subtree(child, k, n)), false);
  }
  if (t.v != 0) b.send(t.low, t.real(t.v - (1 << t.low)), blocks(t.subtree(t.v, t.low, n)));
  if (!t.path) return;
  const PathHop h = path_hop(r, root, t.levels);
  if (h.from >= 0) {
    b.recv(h.in_tag, h.from, blocks({0, r}), false);
    b.recv(h.in_tag + t.levels, h.from, blocks({subtree_end(r, n), n}), false);
  }
  if (h.to >= 0) {
    b.send(h.out_tag, h.to, blocks({0, h.to}));
    b.send(h.out_tag + t.levels, h.to, blocks({subtree_end(h.to, n), n}));
  }
}

// scatter (a reduce_scatter with a root, ops.h): the gather's tree run downwards. Each rank
// receives its subtree's blocks from its parent and hands each child the child's subtree, the
// largest first. Where the tree is rooted at rank 0 (not a power of two of ranks), the blocks
// first come up the path from the root to rank 0 (the gather's path reversed), each hop
// carrying what the ranks behind it need: everything outside its sender's subtree, below and
// above it, in two messages. A rank on the path has its part then, and sends nothing down to the
// next rank on the path (that rank has its own part already).
void plan_scatter_tree(Builder& b, int r, int n, int root, std::size_t count, std::size_t el) {
  const std::size_t block = count * el;
  const auto blocks = [block](std::pair<int, int> range) { return block_range(block, range); };
  const RootedTree t(r, n, root);
  const PathHop h = t.path ? path_hop(r, root, t.levels) : PathHop{};
  const bool on_path = t.path && (r == 0 || h.from >= 0);
  if (on_path) {
    // Tags as the gather's path uses them, edge by edge.
    if (h.to >= 0) {
      b.recv(h.out_tag, h.to, blocks({0, h.to}), false);
      b.recv(h.out_tag + t.levels, h.to, blocks({subtree_end(h.to, n), n}), false);
    }
    if (h.from >= 0) {
      b.send(h.in_tag, h.from, blocks({0, r}));
      b.send(h.in_tag + t.levels, h.from, blocks({subtree_end(r, n), n}));
    }
  } else if (t.v != 0) {
    b.recv(t.low, t.real(t.v - (1 << t.low)), blocks(t.subtree(t.v, t.low, n)), false);
  }
  for (int k = t.low - 1; k >= 0; --k) {
    const int child = t.v + (1 << k);
    if (t.real(child) >= n || (on_path && t.real(child) == h.to)) continue;
    b.send(k, t.real(child), blocks(t.subtree(child, k, n)));
  }
}

void plan_reduce_scatter(Builder& b, int r, int n, std::size_t count, std::size_t el) {
  const Fold f(n);
  const std::size_t block = count * el;
  const Range whole{0, static_cast<std::size_t>(n) * block};
  const auto own = [&](int rank) { return Range{static_cast<std::size_t>(rank) * block, block}; };
  if (f.folded(r) && r % 2 == 0) {
    b.send(kTagFoldIn, r + 1, whole);
    b.recv(tag_fold_out(f), r + 1, own(r), false);
    return;
  }
  if (f.folded(r)) b.recv(kTagFoldIn, r - 1, whole, true);
  halving(b, f, Bounds::of_blocks(f, count, el), f.vrank(r));
  if (f.folded(r)) b.send(tag_fold_out(f), r - 1, own(r - 1));
}

void plan_all_gather(Builder& b, int r, int n, std::size_t count, std::size_t el) {
  const Fold f(n);
  const std::size_t block = count * el;
  const Range whole{0, static_cast<std::size_t>(n) * block};
  const auto own = [&](int rank) { return Range{static_cast<std::size_t>(rank) * block, block}; };
  if (f.folded(r) && r % 2 == 0) {
    b.send(kTagFoldIn, r + 1, own(r));
    b.recv(tag_fold_out(f), r + 1, whole, false);
    return;
  }
  if (f.folded(r)) b.recv(kTagFoldIn, r - 1, own(r - 1), false);
  doubling(b, f, Bounds::of_blocks(f, count, el), f.vrank(r), kTagCore);
  if (f.folded(r)) b.send(tag_fold_out(f), r - 1, whole);
}

// all_to_all: block j of the input goes to rank j, and block j of the output comes from rank j.
// Message k (1 <= k < n) goes from rank r to rank r + k and carries tag k, so the receiver
// knows it by its sender alone. kPairwise makes it step k: its send leaves once the message
// of step k - 1 has arrived, so each rank has one message in flight each way and the ranks
// move through the shifts together (the receiver of each send is ready for it). kScattered
// sends all n - 1 at once and then takes them as they come: one round of latency.
// `sent(j)` and `received(j)` are the ranges of the input and output that go to and come from
// rank j; all_to_all_v keeps empty messages (`keep_empty`).
template <typename Sent, typename Received>
void plan_shifts(Builder& b, Schedule s, int r, int n, Sent sent, Received received,
                 bool keep_empty) {
  for (int k = 1; k < n; ++k) {
    const int to = (r + k) % n;
    const int from = (r - k + n) % n;
    if (s == Schedule::kPairwise) {
      b.shift(k, to, sent(to), from, received(from), keep_empty);
    } else {
      b.shift(k, to, sent(to), -1, {}, keep_empty);
    }
  }
  if (s == Schedule::kScattered) {
    for (int k = 1; k < n; ++k) {
      const int from = (r - k + n) % n;
      b.shift(k, -1, {}, from, received(from), keep_empty);
    }
  }
}

void plan_all_to_all(Builder& b, Schedule s, int r, int n, std::size_t block) {
  const auto at = [block](int j) { return Range{static_cast<std::size_t>(j) * block, block}; };
  plan_shifts(b, s, r, n, at, at, false);
}

// Bruck's all_to_all: ceil(log2 N) rounds. Number the blocks by how far their destination is
// from this rank (block i goes to rank + i). In round k (distance d = 2^k) a rank sends to
// rank + d every block whose i has bit k set and receives the same i from rank - d; after its
// last round block i holds what rank - i sent this rank. A block still holds the input until
// the round of its lowest set bit, so that round reads it from the input (rank + i's block);
// its first receive lands it at the output's block rank - i, where later rounds read it and
// where it ends: no rotation before or after. Each round's message gathers its blocks (packed
// in the staging area) and scatters them on arrival; tags kBruckTag + k, apart from every other
// schedule's, so that ranks that chose differently fail instead of matching.
constexpr int kBruckTag = 128;

void plan_bruck(StepPlan& plan, int r, int n, std::size_t block) {
  if (block == 0) return;
  const auto at = [&](int rank) { return static_cast<std::size_t>((rank % n + n) % n) * block; };
  for (int k = 0, d = 1; d < n; ++k, d <<= 1) {
    Step s;
    s.tag = kBruckTag + k;
    s.send_peer = (r + d) % n;
    s.recv_peer = (r - d + n) % n;
    for (int i = 1; i < n; ++i) {
      if ((i & d) == 0) continue;
      const bool from_input = (i & (d - 1)) == 0;  // no lower bit: not received yet
      s.send_pieces.push_back({from_input ? at(r + i) : at(r - i), block, from_input});
      s.recv_pieces.push_back({at(r - i), block, false});
    }
    s.send_bytes = s.send_pieces.size() * block;
    s.recv_bytes = s.recv_pieces.size() * block;
    s.stage_offset = plan.stage_bytes;
    plan.stage_bytes += s.recv_bytes;
    s.pack_offset = plan.stage_bytes;
    plan.stage_bytes += s.send_bytes;
    plan.steps.push_back(std::move(s));
  }
}

// reduce, gather and scatter straight between the root and every other rank (kScattered over
// the mesh, one round): every other rank sends its input to the root (reduce, gather) or
// receives its block from it (scatter); the root takes or sends all N-1 messages at once, each
// tagged 0 (one per peer). A reduce's root reduces the vectors in the order of the ranks after
// it (they wait in the staging area until their turn), so each element is reduced N-1 times, the
// last time final; a gather's land in their blocks, and a scatter's root sends each block from
// its input (the others receive straight into their output: no work buffer).
void plan_direct(Builder& b, OpKind kind, int r, int n, int root, std::size_t count,
                 std::size_t el) {
  const std::size_t bytes = count * el;
  const auto block = [bytes](int j) { return Range{static_cast<std::size_t>(j) * bytes, bytes}; };
  if (kind == OpKind::kReduceScatter) {
    if (r != root) {
      b.recv(0, root, {0, bytes}, false);
      return;
    }
    for (int k = 1; k < n; ++k) b.send(0, (root + k) % n, block((root + k) % n));
    return;
  }
  if (r != root) {
    b.shift(0, root, {0, bytes}, -1, {});  // from the input
    return;
  }
  for (int k = 1; k < n; ++k) {
    const int from = (root + k) % n;
    if (kind == OpKind::kAllReduce) {
      b.recv(0, from, {0, bytes}, true, k == n - 1);
    } else {
      b.recv(0, from, block(from), false);
    }
  }
}

}  // namespace

bool is_log_step(Schedule s) noexcept {
  return s == Schedule::kRecursiveDoubling || s == Schedule::kHalvingDoubling ||
         s == Schedule::kTree || s == Schedule::kPairwise || s == Schedule::kScattered ||
         s == Schedule::kBruck;
}

bool log_step_supports(OpKind kind, Schedule s) noexcept {
  switch (kind) {
    case OpKind::kAllReduce:
      return s == Schedule::kRecursiveDoubling || s == Schedule::kHalvingDoubling ||
             s == Schedule::kTree;
    case OpKind::kAllToAll:
      return s == Schedule::kPairwise || s == Schedule::kScattered || s == Schedule::kBruck;
    case OpKind::kAllToAllV: return s == Schedule::kPairwise || s == Schedule::kScattered;
    case OpKind::kReduceScatter: return s == Schedule::kHalvingDoubling;
    case OpKind::kAllGather:
      return s == Schedule::kRecursiveDoubling || s == Schedule::kHalvingDoubling;
    default: return false;
  }
}

StepPlan plan_steps(OpKind kind, Schedule s, int rank, int nranks, std::size_t count,
                    std::size_t el, int root) {
  const bool rooted = is_rooted_result(kind, root) || is_scatter(kind, root);
  const bool rooted_tree = rooted && s == Schedule::kTree;
  const bool direct = rooted && s == Schedule::kScattered;
  if ((!log_step_supports(kind, s) && !rooted_tree && !direct) || nranks < 2 || rank < 0 ||
      rank >= nranks) {
    throw std::invalid_argument(std::string("plan_steps: ") + to_string(kind) + " with " +
                                to_string(s) + " on rank " + std::to_string(rank) + " of " +
                                std::to_string(nranks));
  }
  if (rooted && root >= nranks) {
    throw std::invalid_argument(std::string("plan_steps: ") + call_name(kind, root) + " to root " +
                                std::to_string(root) + " of " + std::to_string(nranks));
  }
  StepPlan plan;
  Builder b(plan);
  if (direct) {
    // The same size on every rank, which decides eagerness by it alike.
    plan.work_bytes =
        (kind == OpKind::kAllReduce ? 1 : static_cast<std::size_t>(nranks)) * count * el;
    plan_direct(b, kind, rank, nranks, root, count, el);
    return plan;
  }
  switch (kind) {
    case OpKind::kAllReduce:
      plan.work_bytes = count * el;
      if (rooted_tree) {
        plan_reduce_tree(b, rank, nranks, root, count, el);
      } else {
        plan_all_reduce(b, s, rank, nranks, count, el);
      }
      break;
    case OpKind::kReduceScatter:
      plan.work_bytes = static_cast<std::size_t>(nranks) * count * el;
      if (rooted_tree) {
        // The root sends from its input (ops.cc); the others collect their branch in scratch.
        plan.work_is_scratch = rank != root;
        plan_scatter_tree(b, rank, nranks, root, count, el);
      } else {
        plan.work_is_scratch = true;
        plan_reduce_scatter(b, rank, nranks, count, el);
      }
      break;
    case OpKind::kAllToAllV:
      throw std::invalid_argument("plan_steps: all_to_all_v is planned by plan_all_to_all_v");
    case OpKind::kAllToAll:
      plan.work_bytes = static_cast<std::size_t>(nranks) * count * el;
      if (s == Schedule::kBruck) {
        plan_bruck(plan, rank, nranks, count * el);
      } else {
        plan_all_to_all(b, s, rank, nranks, count * el);
      }
      break;
    default:
      plan.work_bytes = static_cast<std::size_t>(nranks) * count * el;
      if (rooted_tree) {
        plan_gather_tree(b, rank, nranks, root, count, el);
      } else {
        plan_all_gather(b, rank, nranks, count, el);
      }
      break;
  }
  return plan;
}

StepPlan plan_all_to_all_v(Schedule s, int rank, int nranks, const AllToAllLayout& layout) {
  const auto n = static_cast<std::size_t>(nranks);
  if ((s != Schedule::kPairwise && s != Schedule::kScattered) || nranks < 2 || rank < 0 ||
      rank >= nranks || layout.send_bytes.size() != n || layout.send_offset.size() != n ||
      layout.recv_bytes.size() != n || layout.recv_offset.size() != n) {
    throw std::invalid_argument(std::string("plan_all_to_all_v: ") + to_string(s) + " on rank " +
                                std::to_string(rank) + " of " + std::to_string(nranks));
  }
  StepPlan plan;
  for (std::size_t j = 0; j < n; ++j) {
    plan.work_bytes = std::max(plan.work_bytes, layout.recv_offset[j] + layout.recv_bytes[j]);
  }
  Builder b(plan);
  const auto sent = [&](int j) {
    const auto u = static_cast<std::size_t>(j);
    return Range{layout.send_offset[u], layout.send_bytes[u]};
  };
  const auto received = [&](int j) {
    const auto u = static_cast<std::size_t>(j);
    return Range{layout.recv_offset[u], layout.recv_bytes[u]};
  };
  if (layout.root >= 0 && layout.root < nranks) {
    // gather_v: each message keeps the tag of its shift in the full exchange (the root is k
    // ranks after the sender), empty ones included, so that a part the root expects and a
    // sender that has nothing still meet and compare sizes.
    const int root = layout.root;
    if (rank != root) {
      b.shift((root - rank + nranks) % nranks, root, sent(root), -1, {}, true);
      return plan;
    }
    for (int k = 1; k < nranks; ++k) {
      b.shift(k, -1, {}, (root - k + nranks) % nranks, received((root - k + nranks) % nranks),
              true);
    }
    return plan;
  }
  plan_shifts(b, s, rank, nranks, sent, received, true);
  return plan;
}

std::vector<int> step_peers(int rank, int nranks) {
  std::vector<int> peers;
  if (nranks <= kFullMeshMaxRanks) {
    // all_to_all exchanges with every rank.
    for (int p = 0; p < nranks; ++p) {
      if (p != rank) peers.push_back(p);
    }
    return peers;
  }
  // The tree's edges and the fold's pairs: rank ^ 2^k.
  for (int d = 1; d < nranks; d <<= 1) {
    if ((rank ^ d) < nranks) peers.push_back(rank ^ d);
  }
  // The core's partners among the virtual ranks.
  const Fold f(nranks);
  const int v = f.vrank(rank);
  if (v >= 0) {
    for (int d = 1; d < f.p; d <<= 1) peers.push_back(f.real(v ^ d));
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  return peers;
}

StepCost step_cost(OpKind kind, Schedule s, int nranks, std::size_t count, std::size_t el) {
  StepCost c;
  if (nranks < 2) return c;
  // The critical path runs through an odd folded rank (it waits for the fold, runs the core
  // and sends the result back) or, without folding and for the tree, through rank 0.
  const Fold f(nranks);
  const int r = s != Schedule::kTree && f.rem > 0 ? 1 : 0;
  const StepPlan plan = plan_steps(kind, s, r, nranks, count, el);
  for (const Step& st : plan.steps) {
    ++c.steps;
    c.wire_bytes += std::max(st.send_bytes, st.recv_bytes);
    if (st.reduce) {
      c.reduced_bytes += st.recv_bytes;
      // The operand lands in the staging area first (the ring reduces straight from the
      // socket): one more pass over it.
      c.copied_bytes += st.recv_bytes;
    }
    // Bruck: each message packed before it leaves and unpacked when its step comes.
    if (!st.send_pieces.empty()) c.copied_bytes += st.send_bytes + st.recv_bytes;
  }
  // Local copies: reduce_scatter's input into its work buffer and the result out of it;
  // all_gather's own block. all_reduce reads its input where the output is not yet written
  // (LogStepState::input_in_place): no copy.
  if (plan.work_is_scratch) {
    c.copied_bytes += plan.work_bytes + count * el;
  } else if (kind != OpKind::kAllReduce) {
    c.copied_bytes += count * el;
  }
  return c;
}

}  // namespace dear::collectives
