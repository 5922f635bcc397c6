"""CUDA tensors through the bindings, the torch.distributed backend and DistributedOptimizer.

Runs only where dear was built with CUDA and torch sees a GPU; elsewhere it checks that device
tensors this build cannot take are refused with a clear error, then exits 77 (skipped) saying
which of the two is missing.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import SKIP, require_torch  # noqa: E402

require_torch()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dear  # noqa: E402


def check_refused() -> None:
    """A tensor on a device this build cannot read raises ValueError naming the device."""
    bad = torch.empty(4, device="meta")
    try:
        dear.all_reduce(bad)
    except ValueError as e:
        assert "meta" in str(e), str(e)
    else:
        raise AssertionError("a meta tensor was accepted")


def run_on_gpu(rank: int, n: int) -> None:
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)

    def rank_data(r: int, count: int = 70001) -> torch.Tensor:
        g = torch.Generator().manual_seed(r)
        return torch.randint(-3, 4, (count,), generator=g).float()

    want = sum(rank_data(r) for r in range(n))
    t = rank_data(rank).to(device)
    dear.all_reduce(t)
    assert torch.equal(t.cpu(), want), "all_reduce on CUDA tensors"
    # Ordered on the current stream: the input is written by a kernel queued just before.
    s = torch.cuda.Stream(device)
    with torch.cuda.stream(s):
        t = torch.zeros(70001, device=device)
        t.add_(rank_data(rank).to(device, non_blocking=True))
        h = dear.all_reduce_async(t)
    h.wait()
    s.synchronize()
    assert torch.equal(t.cpu(), want), "all_reduce ordered on a side stream"
    out = torch.empty(70001 * n, device=device)
    dear.all_gather(out, rank_data(rank).to(device))
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.cat([rank_data(r) for r in range(n)])), "all_gather"

    # DistributedOptimizer with CUDA parameters against local training on the whole batch.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    model.to(device)
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * n, 8, generator=g), torch.randint(0, 4, (4 * n,), generator=g)
        opt.zero_grad()
        part = slice(4 * rank, 4 * rank + 4)
        F.cross_entropy(model(x[part].to(device)), y[part].to(device)).backward()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    opt.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        diff = float((p.detach().cpu() - q.detach()).abs().max())
        assert diff < 1e-5, f"CUDA DistributedOptimizer differs from local training by {diff}"


def main() -> None:
    dear.init()
    check_refused()
    dear.barrier()  # ranks leave together, skipped or not
    if not dear.HAVE_CUDA:
        print("SKIP: dear was built without CUDA; CUDA tensors are refused (checked)", flush=True)
        sys.exit(SKIP)
    if not torch.cuda.is_available():
        print(f"SKIP: torch {torch.__version__} sees no CUDA device", flush=True)
        sys.exit(SKIP)
    run_on_gpu(dear.rank(), dear.size())
    print(f"rank {dear.rank()}: CUDA tensors correct", flush=True)


if __name__ == "__main__":
    main()
