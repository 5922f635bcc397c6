"""DistributedDataParallel over the "dear" torch.distributed backend: a few training steps give
the parameters of DDP over Gloo (same seeds, same data) and of a single process applying the
ranks' averaged gradients. Also torch.distributed's collectives through the backend, checked
element by element."""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import require_torch  # noqa: E402

require_torch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dear  # noqa: E402
import dear.backend  # noqa: E402
from training import assert_same, make_model, train_averaged, train_ddp  # noqa: E402

STEPS = 8


def check_collectives(rank: int, n: int) -> None:
    """dist.* on the default (dear) group, against values computed here for every rank."""
    def rank_data(r: int) -> torch.Tensor:
        return torch.arange(10, dtype=torch.float32) * (r + 1) - r

    t = rank_data(rank)
    dist.all_reduce(t)
    want = sum(rank_data(r) for r in range(n))
    assert torch.equal(t, want), f"all_reduce: {t} != {want}"

    t = rank_data(rank)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    want = torch.stack([rank_data(r) for r in range(n)]).max(0).values
    assert torch.equal(t, want), f"all_reduce max: {t} != {want}"

    t = rank_data(rank)
    dist.broadcast(t, src=n - 1)
    assert torch.equal(t, rank_data(n - 1)), f"broadcast: {t}"

    outs = [torch.empty(10) for _ in range(n)]
    dist.all_gather(outs, rank_data(rank))
    for r in range(n):
        assert torch.equal(outs[r], rank_data(r)), f"all_gather block {r}: {outs[r]}"

    out = torch.empty(10)
    dist.reduce_scatter(out, [rank_data(rank) + 100 * b for b in range(n)])
    want = sum(rank_data(r) + 100 * rank for r in range(n))
    assert torch.equal(out, want), f"reduce_scatter: {out} != {want}"

    # The flat forms (ZeRO/FSDP's): every dtype torch and dear share, several ops, async.
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                  torch.int64):
        part = (torch.arange(7) * (rank + 2) - 3 * rank).to(dtype)
        whole = torch.full((7 * n,), -1).to(dtype)
        dist.all_gather_into_tensor(whole, part)
        for r in range(n):
            want = (torch.arange(7) * (r + 2) - 3 * r).to(dtype)
            assert torch.equal(whole[7 * r:7 * (r + 1)], want), \
                f"all_gather_into_tensor {dtype} block {r}: {whole}"
        for op, combine in ((dist.ReduceOp.SUM, sum), (dist.ReduceOp.MAX, max),
                            (dist.ReduceOp.MIN, min)):
            def block(r: int, b: int) -> torch.Tensor:
                return ((torch.arange(5) + 10 * b) * (1 if r % 2 else -1) + r).to(dtype)
            inp = torch.cat([block(rank, b) for b in range(n)])
            out = torch.full((5,), 99).to(dtype)
            work = dist.reduce_scatter_tensor(out, inp, op=op, async_op=True)
            work.wait()
            for i in range(5):
                want = combine(block(r, rank)[i].item() for r in range(n))
                assert out[i].item() == want, \
                    f"reduce_scatter_tensor {dtype} {op} element {i}: {out[i].item()} != {want}"
    try:
        dist.all_gather_into_tensor(torch.empty(3), torch.empty(2))
    except ValueError as e:
        assert "all_gather" in str(e), e
    else:
        raise AssertionError("all_gather_into_tensor with a wrong output size did not raise")
    for dst in range(n):
        t = rank_data(rank)
        dist.reduce(t, dst=dst, op=dist.ReduceOp.MIN)
        want = (torch.stack([rank_data(r) for r in range(n)]).min(0).values if rank == dst
                else rank_data(rank))
        assert torch.equal(t, want), f"reduce to {dst}: {t} != {want}"
    for dst in range(n):
        gather_list = [torch.full((10,), -7.0) for _ in range(n)] if rank == dst else None
        dist.gather(rank_data(rank), gather_list, dst=dst)
        if rank == dst:
            for r in range(n):
                assert torch.equal(gather_list[r], rank_data(r)), \
                    f"gather to {dst} block {r}: {gather_list[r]}"
    for src in range(n):
        out = torch.full((10,), -7.0)
        parts = [rank_data(r) + 100 * src for r in range(n)] if rank == src else None
        dist.scatter(out, parts, src=src)
        assert torch.equal(out, rank_data(rank) + 100 * src), f"scatter from {src}: {out}"
    # all_to_all_single (flat, with and without equal split sizes) and all_to_all (lists):
    # row j of the output is row `rank` of rank j's input.
    def a2a_input(r: int) -> torch.Tensor:
        return torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) + 1000 * r
    want = torch.stack([a2a_input(r)[rank] for r in range(n)])
    for splits in (None, [1] * n):
        out = torch.full((n, 3), -7.0)
        dist.all_to_all_single(out, a2a_input(rank), output_split_sizes=splits,
                               input_split_sizes=splits)
        assert torch.equal(out, want), f"all_to_all_single splits {splits}: {out}"
    outs = [torch.full((3,), -7.0) for _ in range(n)]
    dist.all_to_all(outs, list(a2a_input(rank).unbind(0)))
    assert torch.equal(torch.stack(outs), want), f"all_to_all: {outs}"
    # Unequal splits: rank r sends r + j + 1 rows of two to rank j, row k of them
    # 1000 r + 10 j + k (all_to_all_v).
    def part(r: int, j: int) -> torch.Tensor:
        rows = torch.arange(r + j + 1, dtype=torch.float32) + 1000 * r + 10 * j
        return rows.unsqueeze(1).repeat(1, 2)
    splits_in = [rank + j + 1 for j in range(n)]
    inp = torch.cat([part(rank, j) for j in range(n)])
    out = torch.full((sum(splits_in), 2), -7.0)
    dist.all_to_all_single(out, inp, output_split_sizes=splits_in, input_split_sizes=splits_in)
    want_v = torch.cat([part(j, rank) for j in range(n)])
    assert torch.equal(out, want_v), f"all_to_all_single unequal splits: {out}"
    outs = [torch.full((j + rank + 1, 2), -7.0) for j in range(n)]
    dist.all_to_all(outs, [part(rank, j) for j in range(n)])
    for j in range(n):
        assert torch.equal(outs[j], part(j, rank)), f"all_to_all unequal from {j}: {outs[j]}"
    # send/recv around the ring, both ways, a small and a large message each (isend, irecv),
    # then blocking ones: what arrives is the sender's data.
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    big = 100_000  # 400 KB: beyond the eager size, so it waits for the receive
    reqs, got = [], []
    for size in (10, big):
        inbox = torch.full((size,), -1.0)
        reqs.append(dist.irecv(inbox, src=prv))
        got.append(inbox)
        reqs.append(dist.isend(torch.arange(size, dtype=torch.float32) + 1000 * rank, dst=nxt))
    for r in reqs:
        r.wait()
    for size, inbox in zip((10, big), got):
        assert torch.equal(inbox, torch.arange(size, dtype=torch.float32) + 1000 * prv), \
            f"irecv of {size} from {prv}: {inbox[:4]}"
    if rank % 2 == 0:
        dist.send(rank_data(rank), dst=prv)
        t = torch.empty(10)
        dist.recv(t, src=nxt)
    else:
        t = torch.empty(10)
        dist.recv(t, src=nxt)
        dist.send(rank_data(rank), dst=prv)
    assert torch.equal(t, rank_data(nxt)), f"recv from {nxt}: {t}"
    # Tags: two messages to the next rank, received in the other order by their tags.
    first, second = torch.full((4,), -1.0), torch.full((7,), -1.0)
    reqs = [dist.isend(torch.full((4,), 10.0 * rank), dst=nxt, tag=5),
            dist.isend(torch.full((7,), 20.0 * rank), dst=nxt, tag=9),
            dist.irecv(second, src=prv, tag=9), dist.irecv(first, src=prv, tag=5)]
    for r in reqs:
        r.wait()
    assert torch.equal(first, torch.full((4,), 10.0 * prv)), f"tag 5: {first}"
    assert torch.equal(second, torch.full((7,), 20.0 * prv)), f"tag 9: {second}"
    # Receives from any source: rank 0 takes one message from every other rank (tag 3) with
    # dist.recv(src=None), which returns the sender, then one more each with irecv(src=None)
    # (tag 4), whose Work names it; each payload is its sender's.
    if rank == 0:
        senders = []
        for _ in range(n - 1):
            t = torch.full((6,), -1.0)
            src = dist.recv(t, tag=3)
            assert torch.equal(t, torch.full((6,), 100.0 + src)), f"any source {src}: {t}"
            senders.append(src)
        inboxes = [torch.full((5,), -1.0) for _ in range(n - 1)]
        reqs = [dist.irecv(b, tag=4) for b in inboxes]
        for r, b in zip(reqs, inboxes):
            r.wait()
            src = r._source_rank()
            assert torch.equal(b, torch.full((5,), 200.0 + src)), f"irecv any {src}: {b}"
            senders.append(src)
        assert sorted(senders) == sorted(list(range(1, n)) * 2), senders
    else:
        dist.send(torch.full((6,), 100.0 + rank), dst=0, tag=3)
        dist.send(torch.full((5,), 200.0 + rank), dst=0, tag=4)

    # Several asynchronous operations in flight, waited for in reverse order.
    ts = [rank_data(rank) * (i + 1) for i in range(5)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in reversed(works):
        w.wait()
        assert w.is_completed()
    for i, t in enumerate(ts):
        assert torch.equal(t, sum(rank_data(r) for r in range(n)) * (i + 1)), f"async {i}"
    fut = dist.all_reduce(rank_data(rank), async_op=True).get_future()
    assert torch.equal(fut.wait()[0], sum(rank_data(r) for r in range(n))), "get_future value"
    dist.barrier()


def check_subgroups(rank: int, n: int) -> None:
    # dist.new_group on the dear backend (every rank calls it; only members get a group): the
    # first two ranks, and every rank but rank 0, each with a dear communicator of its own,
    # used one after the other and then both at once beside the world.
    first_two = dist.new_group([0, 1])
    all_but_0 = dist.new_group(list(range(1, n))) if n > 2 else None
    if rank in (0, 1):
        t = torch.full((6,), float(rank + 1))
        dist.all_reduce(t, group=first_two)
        assert torch.equal(t, torch.full((6,), 3.0)), f"subgroup [0, 1] all_reduce: {t}"
        assert dist.get_rank(first_two) == rank and dist.get_world_size(first_two) == 2
        assert dist.get_backend(first_two) == "dear", dist.get_backend(first_two)
        parts = [torch.empty(2) for _ in range(2)]
        dist.all_gather(parts, torch.full((2,), 10.0 * rank), group=first_two)
        assert torch.equal(torch.cat(parts), torch.tensor([0.0, 0, 10, 10])), f"{parts}"
    if all_but_0 is not None and rank > 0:
        m = n - 1
        t = torch.arange(4, dtype=torch.float64) * rank
        works = [dist.all_reduce(t, group=all_but_0, async_op=True),
                 dist.all_reduce(torch.ones(3), async_op=True)]  # the world, meanwhile
        for w in works:
            w.wait()
        want = torch.arange(4, dtype=torch.float64) * (m * (m + 1) // 2)
        assert torch.equal(t, want), f"subgroup [1..{n - 1}] all_reduce: {t} != {want}"
        out = torch.empty(m)
        dist.all_to_all_single(out, torch.full((m,), float(rank)), group=all_but_0)
        assert torch.equal(out, torch.arange(1, n, dtype=torch.float32)), f"a2a: {out}"
    elif all_but_0 is not None:
        dist.all_reduce(torch.ones(3))  # rank 0's part of the world's all_reduce above
    dist.barrier()


def main() -> None:
    torch.set_num_threads(1)
    start = time.monotonic()
    dear.backend.init_process_group()
    rank, n = dist.get_rank(), dist.get_world_size()
    assert (rank, n) == (dear.rank(), dear.size())
    assert dist.get_backend() == "dear", dist.get_backend()
    check_collectives(rank, n)
    check_subgroups(rank, n)

    dear_group = dist.group.WORLD
    gloo_group = dist.new_group(backend="gloo")
    for optimizer in ("sgd", "adam"):
        averaged = train_averaged(optimizer, STEPS, n)
        for cap in (25, 0.002):  # one bucket; several (DDP's reducer, its bucket order)
            name = f"DDP/{optimizer}/bucket_cap_mb={cap}"
            over_dear = train_ddp(optimizer, STEPS, dear_group, bucket_cap_mb=cap)
            over_gloo = train_ddp(optimizer, STEPS, gloo_group, bucket_cap_mb=cap)
            assert_same(f"{name}: gloo vs averaged-gradient reference", over_gloo, averaged)
            assert_same(f"{name}: dear vs averaged-gradient reference", over_dear, averaged)
            # Both sum the same per-rank gradients; tighter than against the reference.
            assert_same(f"{name}: dear vs gloo", over_dear, over_gloo, atol=1e-6)
            assert not torch.equal(over_dear.fc1.weight, make_model().fc1.weight), \
                f"{name}: training did not change the parameters"
            assert over_dear.unused.weight.grad is None, f"{name}: unused layer got a gradient"
            if rank == 0:
                print(f"{name}: dear == gloo == averaged-gradient reference", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}/{n}: DDP over dear agrees ({time.monotonic() - start:.1f} s)",
          flush=True)


if __name__ == "__main__":
    main()
