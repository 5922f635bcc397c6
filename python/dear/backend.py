"""EXPERIMENTAL torch.distributed backend "dear" (torch 1.13): dear's engine under
torch.distributed.

    import dear.backend, torch.distributed as dist
    dear.backend.register()
    dist.init_process_group("dear", store=dist.FileStore(path, n), rank=r, world_size=n)

torch 1.13's Backend.register_backend accepts a creator that returns a Python subclass of c10d's
ProcessGroup, and its methods return Python subclasses of Work. dear rendezvous from the
launcher's environment itself; torch still needs a store that all ranks share for its own
start-up barrier, but not the env:// one: under dear-run, MASTER_PORT is dear's own listening
port, which env:// would try to bind a second time. Use a FileStore or a TCPStore elsewhere.

Status: torch.distributed's collectives called from Python (dist.all_reduce, broadcast, ...)
work. DistributedDataParallel does not yet: it hangs in its first C++-issued collective
(_verify_params_across_processes), which calls this class from C++; not investigated further.
Use dear.DistributedOptimizer for training.
"""
from __future__ import annotations

from datetime import timedelta
from typing import List

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ReduceOp, Work

import dear

_OPS = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "prod", ReduceOp.MIN: "min",
        ReduceOp.MAX: "max"}
if hasattr(ReduceOp, "AVG"):
    _OPS[ReduceOp.AVG] = "avg"


class _DearWork(Work):
    """A torch Work over dear Handles; its future completes when they all have."""

    def __init__(self, handles: List[dear.Handle], result: List[torch.Tensor],
                 after=None) -> None:
        super().__init__()
        self._handles = handles
        self._result = result
        self._after = after  # copies out of staging buffers once the operation is done
        self._done = False

    def _complete(self) -> None:
        if not self._done:
            for h in self._handles:
                h.wait()
            if self._after is not None:
                self._after()
            self._done = True

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        self._complete()
        return True

    def is_completed(self) -> bool:
        return self._done or all(h.is_completed() for h in self._handles)

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self) -> List[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future:
        # torch's callbacks expect a future; dear's handles have none, so completion is
        # awaited here (DDP waits for every bucket before the optimizer step anyway).
        self._complete()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future


def _op(opts) -> str:
    try:
        return _OPS[opts.reduceOp]
    except KeyError:
        raise ValueError(f"dear backend: unsupported reduction {opts.reduceOp}") from None


class ProcessGroupDear(ProcessGroup):
    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "dear"

    def name(self) -> str:
        return "dear"

    def allreduce(self, tensors: List[torch.Tensor], opts=None) -> Work:
        op = _op(opts) if opts is not None else "sum"
        return _DearWork([dear.all_reduce_async(t, op=op) for t in tensors], tensors)

    def broadcast(self, tensors: List[torch.Tensor], opts=None) -> Work:
        root = opts.rootRank if opts is not None else 0
        return _DearWork([dear.broadcast_async(t, root) for t in tensors], tensors)

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                  opts=None) -> Work:
        handles, copies = [], []
        for outputs, t in zip(output_lists, inputs):
            # torch hands separate output tensors; dear gathers into one contiguous buffer.
            flat = torch.empty(t.numel() * len(outputs), dtype=t.dtype)
            handles.append(dear.all_gather_async(flat, t.contiguous()))
            copies.append((flat, outputs))

        def scatter_out() -> None:
            for flat, outputs in copies:
                for out, part in zip(outputs, flat.chunk(len(outputs))):
                    out.copy_(part.view_as(out))
        return _DearWork(handles, [o for outs in output_lists for o in outs], scatter_out)

    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]],
                       opts=None) -> Work:
        op = _op(opts) if opts is not None else "sum"
        handles = []
        for out, inputs in zip(outputs, input_lists):
            flat = torch.cat([i.reshape(-1) for i in inputs])
            handles.append(dear.reduce_scatter_async(out, flat, op=op))
        return _DearWork(handles, outputs)

    def barrier(self, opts=None) -> Work:
        return _DearWork([dear.barrier_async()], [])


def _create(store, rank: int, size: int, timeout: timedelta) -> ProcessGroup:
    dear.init()
    if (dear.rank(), dear.size()) != (rank, size):
        raise RuntimeError(f"dear backend: torch says rank {rank} of {size}, the launcher's "
                           f"environment says {dear.rank()} of {dear.size()}")
    return ProcessGroupDear(rank, size)


def register() -> None:
    """Registers "dear" with torch.distributed (once)."""
    if "DEAR" not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend("dear", _create)
