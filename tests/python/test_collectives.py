"""Collectives through the Python bindings, checked element by element against a reference
computed here from every rank's (reproducible) input. Run under dear-run on any rank count."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import require_torch  # noqa: E402

require_torch()

import torch  # noqa: E402

import dear  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64]
FLOATS = {torch.float32, torch.float64, torch.float16, torch.bfloat16}
SIZES = [0, 1, 7, 1000, 70001]  # empty, tiny, odd, several slices


def data(rank: int, count: int, dtype: torch.dtype, op: str = "sum") -> torch.Tensor:
    """Small integers, so that every dtype holds every partial result exactly."""
    g = torch.Generator().manual_seed(1000 * rank + count)
    if op == "prod":
        values = torch.randint(1, 3, (count,), generator=g)  # products up to 2**8
    elif dtype == torch.uint8:
        values = torch.randint(0, 4, (count,), generator=g)
    else:
        values = torch.randint(-3, 4, (count,), generator=g)
    return values.to(dtype)


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack([t.to(torch.float64) for t in inputs])
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        return stacked.mean(0)
    if op == "prod":
        return stacked.prod(0)
    if op == "min":
        return stacked.min(0).values
    return stacked.max(0).values


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    got64 = got.to(torch.float64)
    if not torch.equal(got64, want.to(torch.float64)):
        bad = (got64 != want).nonzero()
        i = int(bad[0]) if bad.numel() else -1
        raise AssertionError(f"rank {dear.rank()}: {name}: {bad.numel()} wrong elements, "
                             f"first at {i}: got {got64.flatten()[i]}, want {want.flatten()[i]}")


def main() -> None:
    dear.init()
    rank, n = dear.rank(), dear.size()
    checked = 0
    for dtype in DTYPES:
        ops = ["sum", "prod", "min", "max"] + (["avg"] if dtype in FLOATS else [])
        for count in SIZES:
            for op in ops:
                t = data(rank, count, dtype, op)
                dear.all_reduce(t, op=op)
                want = reference([data(r, count, dtype, op) for r in range(n)], op)
                check(f"all_reduce {dtype} {op} {count}", t, want)
                checked += 1
            # reduce_scatter: rank r's output is block r of the reduction
            inp = data(rank, count * n, dtype)
            out = torch.empty(count, dtype=dtype)
            dear.reduce_scatter(out, inp)
            full = reference([data(r, count * n, dtype) for r in range(n)], "sum")
            check(f"reduce_scatter {dtype} {count}", out, full[rank * count:(rank + 1) * count])
            # all_gather: block r of the output is rank r's input
            out = torch.empty(count * n, dtype=dtype)
            dear.all_gather(out, data(rank, count, dtype))
            check(f"all_gather {dtype} {count}", out,
                  torch.cat([data(r, count, dtype) for r in range(n)]))
            # broadcast from the last rank
            t = data(rank, count, dtype)
            dear.broadcast(t, root=n - 1)
            check(f"broadcast {dtype} {count}", t, data(n - 1, count, dtype))
            # reduce to a root that moves with the size: only it gets the result, the others
            # keep their input
            root = count % n
            t = data(rank, count, dtype, "max")
            dear.reduce(t, root=root, op="max")
            want = (reference([data(r, count, dtype, "max") for r in range(n)], "max")
                    if rank == root else data(rank, count, dtype, "max"))
            check(f"reduce {dtype} {count} root {root}", t, want)
            # gather to another moving root: only it has an output
            root = (count + 1) % n
            out = torch.empty(count * n, dtype=dtype) if rank == root else None
            dear.gather(out, data(rank, count, dtype), root=root)
            if rank == root:
                check(f"gather {dtype} {count} root {root}", out,
                      torch.cat([data(r, count, dtype) for r in range(n)]))
            checked += 4 + (rank == root)
            # scatter from the root of the gather
            out = torch.empty(count, dtype=dtype)
            whole = torch.cat([data(r, count, dtype) for r in range(n)]) if rank == root else None
            dear.scatter(out, whole, root=root)
            check(f"scatter {dtype} {count} root {root}", out, data(rank, count, dtype))
            # all_to_all: block j of the output is block `rank` of rank j's input; then in place
            inp = data(rank, count * n, dtype)
            out = torch.empty(count * n, dtype=dtype)
            dear.all_to_all(out, inp)
            want = torch.cat([data(r, count * n, dtype)[rank * count:(rank + 1) * count]
                              for r in range(n)])
            check(f"all_to_all {dtype} {count}", out, want)
            dear.all_to_all(inp, inp)
            check(f"all_to_all in place {dtype} {count}", inp, want)
            checked += 3

    # all_to_all_v: rank r sends (r + j) % 3 + 1 elements to rank j, of value 100 r + 10 j + k.
    def part(src: int, dst: int) -> torch.Tensor:
        return torch.arange((src + dst) % 3 + 1, dtype=torch.float64) + 100 * src + 10 * dst
    inp = torch.cat([part(rank, j) for j in range(n)])
    out = torch.full((sum((j + rank) % 3 + 1 for j in range(n)),), -1.0, dtype=torch.float64)
    dear.all_to_all_v(out, inp, [(j + rank) % 3 + 1 for j in range(n)],
                      [(rank + j) % 3 + 1 for j in range(n)])
    check("all_to_all_v", out, torch.cat([part(j, rank) for j in range(n)]))
    checked += 1

    # all_gather_v and gather_v: rank j contributes j + 1 elements (rank j's value).
    splits = [j + 1 for j in range(n)]
    want = torch.cat([torch.full((j + 1,), float(j), dtype=torch.float64) for j in range(n)])
    mine = torch.full((rank + 1,), float(rank), dtype=torch.float64)
    out = torch.full((sum(splits),), -1.0, dtype=torch.float64)
    dear.all_gather_v(out, mine, splits)
    check("all_gather_v", out, want)
    root = n - 1
    out = torch.full((sum(splits),), -1.0, dtype=torch.float64)
    dear.gather_v(out if rank == root else None, mine, splits if rank == root else None, root)
    if rank == root:
        check("gather_v", out, want)
    checked += 2

    # send/recv: a ring exchange, small then large (beyond the eager size), receives posted
    # before the sends.
    for count in (3, 50_000):
        inbox = torch.full((count,), -1, dtype=torch.int64)
        h = dear.recv_async(inbox, (rank - 1) % n)
        dear.send(torch.arange(count, dtype=torch.int64) * (rank + 1), (rank + 1) % n)
        h.wait()
        check(f"recv {count}", inbox, torch.arange(count, dtype=torch.int64) * ((rank - 1) % n + 1))
        checked += 1
    # From any source (peer=None): the only sender of tag 7 to this rank is the previous one,
    # which the receive names.
    if n > 1:
        inbox = torch.full((4,), -1, dtype=torch.int64)
        h = dear.recv_async(inbox, None, tag=7)
        dear.send(torch.full((4,), rank, dtype=torch.int64), (rank + 1) % n, tag=7)
        h.wait()
        assert h.source == (rank - 1) % n, (h.source, rank)
        check("recv from any source", inbox, torch.full((4,), (rank - 1) % n, dtype=torch.int64))
        checked += 1

    # split: even and odd ranks, keys reversed; each child all_reduces beside the world.
    child = dear.split(rank % 2, key=-rank)
    members = sorted((r for r in range(n) if r % 2 == rank % 2), reverse=True)
    assert child.size == len(members) and child.rank == members.index(rank), \
        (child.rank, child.size, members)
    t = torch.full((9,), float(rank + 1))
    w = torch.ones(5)
    handles = [dear.all_reduce_async(t, comm=child), dear.all_reduce_async(w)]
    for h in handles:
        h.wait()
    check("all_reduce on a split child", t, torch.full((9,), float(sum(r + 1 for r in members))))
    check("all_reduce on the world beside it", w, torch.full((5,), float(n)))
    assert child.name == f"world/{rank % 2}", child.name
    assert dear.split(-1) is None
    child.close()
    checked += 2

    # In place, through views of one buffer (the optimizer's usage).
    buf = data(rank, 12 * n, torch.float32)
    dear.reduce_scatter(buf[rank * 12:(rank + 1) * 12], buf, op="avg")
    want = reference([data(r, 12 * n, torch.float32) for r in range(n)], "avg")
    check("reduce_scatter in place", buf[rank * 12:(rank + 1) * 12],
          want[rank * 12:(rank + 1) * 12])
    dear.all_gather(buf, buf[rank * 12:(rank + 1) * 12])
    check("all_gather in place", buf, want)

    # Async operations with priorities: several in flight, waited in reverse order.
    tensors = [data(rank, 5000 + i, torch.float32) for i in range(6)]
    handles = [dear.all_reduce_async(t, op="max", priority=i) for i, t in enumerate(tensors)]
    for h in reversed(handles):
        assert h.wait(timeout=60), "async all_reduce timed out"
        assert h.is_completed()
    for i, t in enumerate(tensors):
        check(f"async all_reduce {i}", t,
              reference([data(r, 5000 + i, torch.float32) for r in range(n)], "max"))
    dear.barrier()
    assert dear.barrier_async().wait() is True

    # forget_memory between operations on the same buffer (its memory about to be reused):
    # nothing lost or reordered.
    t = data(rank, 3000, torch.float32)
    dear.all_reduce(t)
    dear.forget_memory(t)
    dear.forget_memory(t[100:200])
    dear.all_reduce(t)
    want = reference([data(r, 3000, torch.float32) for r in range(n)], "sum") * n
    check("all_reduce after forget_memory", t, want)

    # Argument errors are caught before anything is sent and name the problem.
    for bad, why in [(lambda: dear.all_reduce(torch.ones(4)[::2]), "contiguous"),
                     (lambda: dear.all_reduce(torch.ones(2, dtype=torch.complex64)), "dtype"),
                     (lambda: dear.all_reduce(torch.ones(2), op="median"), "median"),
                     (lambda: dear.all_gather(torch.ones(3), torch.ones(2)), "all_gather"),
                     (lambda: dear.reduce_scatter(torch.ones(2), torch.ones(2, dtype=torch.int32)),
                      "dtype")]:
        try:
            bad()
        except (ValueError, TypeError) as e:
            assert why in str(e), f"message {e!r} does not mention {why!r}"
        else:
            raise AssertionError(f"no error for a bad argument ({why})")
    # ... and the library's own errors become dear.Error with its message and fields.
    try:
        dear.broadcast(torch.ones(3), root=n)
    except dear.Error as e:
        assert isinstance(e, RuntimeError)
        assert e.code == "invalid argument", e.code
        assert "root" in str(e), str(e)
    else:
        raise AssertionError("broadcast to a root outside the job did not raise dear.Error")
    dear.barrier()
    print(f"rank {rank}/{n}: {checked} collectives correct", flush=True)


if __name__ == "__main__":
    main()
