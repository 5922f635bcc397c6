"""dear: DeAR's decoupled all-reduce for PyTorch, on dear's own collective engine.

    import dear
    dear.init()                       # dear-run, torchrun, Open MPI or Slurm environment
    dear.all_reduce(tensor, op="avg")
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)

Tensors are passed zero-copy: the library reads and writes their memory directly, so they must
be contiguous tensors of a supported dtype, and must not be touched until the operation
completes (the async forms return a `Handle` that keeps them alive until then). Collectives are
issued in the same order on every rank, as with NCCL and MPI. `split(color)` makes a child
communicator of some ranks; every call takes it as `comm=`.

CUDA tensors are accepted when dear was built with CUDA (`HAVE_CUDA`): the operation is ordered
after the work already queued on the tensor's current stream (as NCCL's are), and the
communicator stages device memory through pinned host buffers. Builds without CUDA reject them
with a ValueError. (Compiled, not yet run on a GPU by the tests.)
"""
from __future__ import annotations

import atexit
from typing import Iterable, List, Optional

import torch

from . import _dear
from ._dear import Error

__all__ = [
    "HAVE_CUDA", "Error", "Handle", "init", "is_initialized", "shutdown", "rank", "size",
    "all_reduce", "all_reduce_async", "reduce_scatter", "reduce_scatter_async",
    "all_gather", "all_gather_async", "broadcast", "broadcast_async", "reduce", "reduce_async",
    "gather", "gather_async", "scatter", "scatter_async", "all_to_all", "all_to_all_async",
    "all_to_all_v", "all_to_all_v_async", "all_gather_v", "all_gather_v_async", "gather_v",
    "gather_v_async", "send", "send_async", "recv", "recv_async",
    "split", "Communicator",
    "barrier", "barrier_async", "broadcast_parameters", "forget_memory", "DistributedOptimizer",
]

_DTYPES = {
    torch.float32: _dear.DataType.float32,
    torch.float64: _dear.DataType.float64,
    torch.float16: _dear.DataType.float16,
    torch.bfloat16: _dear.DataType.bfloat16,
    torch.int8: _dear.DataType.int8,
    torch.uint8: _dear.DataType.uint8,
    torch.int32: _dear.DataType.int32,
    torch.int64: _dear.DataType.int64,
}
_OPS = {
    "sum": _dear.ReduceOp.sum,
    "prod": _dear.ReduceOp.prod,
    "min": _dear.ReduceOp.min,
    "max": _dear.ReduceOp.max,
    "avg": _dear.ReduceOp.avg,
    "mean": _dear.ReduceOp.avg,
}

# True when this build takes CUDA tensors (dear compiled with CUDA).
HAVE_CUDA: bool = bool(_dear.HAVE_CUDA)

_comm: Optional[_dear.Communicator] = None

# Operations whose Handle was dropped before they completed, with their tensors: the engine
# still reads and writes that memory, so it must not be freed until they finish.
_orphans: list[tuple[_dear.Work, tuple[torch.Tensor, ...]]] = []


class Handle:
    """An operation in flight. Holds its tensors so that their memory outlives the operation,
    even when the handle itself is dropped early."""

    __slots__ = ("_work", "_tensors")

    def __init__(self, work: _dear.Work, *tensors: torch.Tensor) -> None:
        self._work = work
        self._tensors = tensors
        if _orphans:
            _orphans[:] = [o for o in _orphans if not o[0].test()]

    def __del__(self) -> None:
        if self._tensors and not self._work.test():
            _orphans.append((self._work, self._tensors))

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Blocks (GIL released) until done; False if `timeout` seconds passed first.

        Raises dear.Error if the operation failed.
        """
        done = self._work.wait(timeout)
        if done:
            self._tensors = ()
        return done

    def is_completed(self) -> bool:
        """True once the operation has finished, successfully or not. Never blocks."""
        return self._work.test()

    @property
    def seq(self) -> int:
        return self._work.seq

    @property
    def source(self) -> int:
        """A completed receive's sender (which rank a receive from any source took its
        message from); -1 for other operations and while pending."""
        return self._work.source


def init() -> None:
    """Joins the job described by the launcher's environment. Calling it again is a no-op."""
    global _comm
    if _comm is not None and not _comm.closed:
        return
    _comm = _dear.Communicator.from_env()


def is_initialized() -> bool:
    return _comm is not None and not _comm.closed


def shutdown() -> None:
    """Stops the engine; pending operations fail. Runs at exit, before the interpreter dies."""
    global _comm
    if _comm is not None:
        _comm.close()  # fails whatever is in flight, so nothing touches the orphans any more
        _comm = None
    _orphans.clear()


atexit.register(shutdown)


def _communicator(comm: Optional[_dear.Communicator] = None) -> _dear.Communicator:
    """`comm` where given (a split() child, a torch subgroup's), else the one of init()."""
    if comm is not None:
        if comm.closed:
            raise RuntimeError("the communicator is closed")
        return comm
    if _comm is None or _comm.closed:
        raise RuntimeError("dear is not initialised: call dear.init() first")
    return _comm


Communicator = _dear.Communicator


def split(color: int, key: Optional[int] = None) -> Optional[_dear.Communicator]:
    """Communicator::split of init()'s communicator: collective; the ranks passing one color
    (>= 0) form a child, ordered by `key` (default: their rank) then rank; -1 joins none and
    gets None. Pass the child as `comm=` to any call of this module."""
    comm = _communicator()
    return comm.split(color, comm.rank if key is None else key)


def rank() -> int:
    return _communicator().rank


def size() -> int:
    return _communicator().size


def _dtype(t: torch.Tensor, name: str) -> _dear.DataType:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.device.type == "cuda":
        if not HAVE_CUDA:
            # Copying silently would hide a device-to-host transfer per call.
            raise ValueError(f"{name} is on {t.device}, but this dear was built without CUDA "
                             "(rebuild with a CUDA toolkit, DEAR_CUDA=ON), so it takes CPU "
                             "tensors only")
    elif t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; dear takes CPU tensors"
                         + (" and CUDA tensors" if HAVE_CUDA else " only"))
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous; pass tensor.contiguous() and copy back")
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"{name} has dtype {t.dtype}, which dear does not support "
                        f"(supported: {', '.join(str(d) for d in _DTYPES)})")
    return dtype


def _op(op: str) -> _dear.ReduceOp:
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduction {op!r}; use one of {', '.join(_OPS)}") from None


def _same_dtype(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"output has dtype {a.dtype} but input has {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"output is on {a.device} but input is on {b.device}")


def _stream(t: torch.Tensor) -> int:
    """The tensor's current CUDA stream as an integer (cudaStream_t); 0 for CPU tensors."""
    if t.device.type != "cuda":
        return 0
    return torch.cuda.current_stream(t.device).cuda_stream


def all_reduce_async(tensor: torch.Tensor, op: str = "sum", priority: int = 0,
                     comm: Optional[_dear.Communicator] = None) -> Handle:
    """In place: every rank's `tensor` becomes `op` over all ranks' tensors."""
    dtype = _dtype(tensor, "tensor")
    work = _communicator(comm).all_reduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                          dtype, _op(op), priority, _stream(tensor))
    return Handle(work, tensor)


def reduce_scatter_async(output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                         priority: int = 0, comm: Optional[_dear.Communicator] = None) -> Handle:
    """`output` receives this rank's block of `op` over all ranks' `input`.

    input.numel() must be size() * output.numel(); block r is input's r-th slice of that size.
    """
    comm = _communicator(comm)
    dtype = _dtype(output, "output")
    _dtype(input, "input")
    _same_dtype(output, input)
    if input.numel() != output.numel() * comm.size:
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                         f"size() * output.numel() = {comm.size} * {output.numel()}")
    work = comm.reduce_scatter(input.data_ptr(), output.data_ptr(), output.numel(), dtype,
                               _op(op), priority, _stream(output))
    return Handle(work, output, input)


def all_gather_async(output: torch.Tensor, input: torch.Tensor, priority: int = 0,
                     comm: Optional[_dear.Communicator] = None) -> Handle:
    """`output` receives every rank's `input`, rank r's at slice r.

    output.numel() must be size() * input.numel().
    """
    comm = _communicator(comm)
    dtype = _dtype(output, "output")
    _dtype(input, "input")
    _same_dtype(output, input)
    if output.numel() != input.numel() * comm.size:
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                         f"size() * input.numel() = {comm.size} * {input.numel()}")
    work = comm.all_gather(input.data_ptr(), output.data_ptr(), input.numel(), dtype, priority,
                           _stream(output))
    return Handle(work, output, input)


def broadcast_async(tensor: torch.Tensor, root: int = 0, priority: int = 0,
                    comm: Optional[_dear.Communicator] = None) -> Handle:
    """In place: `root`'s tensor is copied into every rank's."""
    dtype = _dtype(tensor, "tensor")
    work = _communicator(comm).broadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                         dtype, root, priority, _stream(tensor))
    return Handle(work, tensor)


def reduce_async(tensor: torch.Tensor, root: int = 0, op: str = "sum",
                 priority: int = 0, comm: Optional[_dear.Communicator] = None) -> Handle:
    """In place on `root`: its tensor becomes `op` over all ranks' tensors; the other ranks'
    tensors are read, never written."""
    dtype = _dtype(tensor, "tensor")
    work = _communicator(comm).reduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(),
                                      dtype, _op(op), root, priority, _stream(tensor))
    return Handle(work, tensor)


def gather_async(output: Optional[torch.Tensor], input: torch.Tensor, root: int = 0,
                 priority: int = 0, comm: Optional[_dear.Communicator] = None) -> Handle:
    """On `root`, `output` receives every rank's `input`, rank r's at slice r
    (output.numel() == size() * input.numel()); elsewhere `output` is not used and may be None.
    """
    comm = _communicator(comm)
    dtype = _dtype(input, "input")
    if comm.rank != root:
        work = comm.gather(input.data_ptr(), 0, input.numel(), dtype, root, priority,
                           _stream(input))
        return Handle(work, input)
    if output is None:
        raise ValueError(f"gather: output is None on the root (rank {root})")
    _dtype(output, "output")
    _same_dtype(output, input)
    if output.numel() != input.numel() * comm.size:
        raise ValueError(f"gather: output has {output.numel()} elements, expected "
                         f"size() * input.numel() = {comm.size} * {input.numel()}")
    work = comm.gather(input.data_ptr(), output.data_ptr(), input.numel(), dtype, root, priority,
                       _stream(output))
    return Handle(work, output, input)


def scatter_async(output: torch.Tensor, input: Optional[torch.Tensor], root: int = 0,
                  priority: int = 0, comm: Optional[_dear.Communicator] = None) -> Handle:
    """`output` receives slice r of `root`'s `input` (input.numel() == size() * output.numel());
    elsewhere `input` is not used and may be None."""
    comm = _communicator(comm)
    dtype = _dtype(output, "output")
    if comm.rank != root:
        work = comm.scatter(0, output.data_ptr(), output.numel(), dtype, root, priority,
                            _stream(output))
        return Handle(work, output)
    if input is None:
        raise ValueError(f"scatter: input is None on the root (rank {root})")
    _dtype(input, "input")
    _same_dtype(output, input)
    if input.numel() != output.numel() * comm.size:
        raise ValueError(f"scatter: input has {input.numel()} elements, expected "
                         f"size() * output.numel() = {comm.size} * {output.numel()}")
    work = comm.scatter(input.data_ptr(), output.data_ptr(), output.numel(), dtype, root,
                        priority, _stream(output))
    return Handle(work, output, input)


def all_to_all_async(output: torch.Tensor, input: torch.Tensor, priority: int = 0,
                     comm: Optional[_dear.Communicator] = None) -> Handle:
    """Slice j of `input` goes to rank j, and slice j of `output` comes from rank j: both hold
    size() equal slices. `output` may be `input` (in place)."""
    comm = _communicator(comm)
    dtype = _dtype(output, "output")
    _dtype(input, "input")
    _same_dtype(output, input)
    if input.numel() != output.numel() or input.numel() % comm.size != 0:
        raise ValueError(f"all_to_all: input has {input.numel()} elements and output "
                         f"{output.numel()}; both must hold size() = {comm.size} equal slices")
    work = comm.all_to_all(input.data_ptr(), output.data_ptr(), input.numel() // comm.size,
                           dtype, priority, _stream(output))
    return Handle(work, output, input)


def _offsets(sizes: List[int]) -> List[int]:
    out, at = [], 0
    for s in sizes:
        out.append(at)
        at += s
    return out


def _check_splits(call: str, name: str, splits: List[int], t: torch.Tensor,
                  nranks: int) -> None:
    """`splits` (named `name`, e.g. "output_splits") has one entry per rank and its parts fit
    `t`, the tensor the name's first word names."""
    if len(splits) != nranks:
        raise ValueError(f"{call}: {name} has {len(splits)} entries, expected one per rank "
                         f"({nranks})")
    if any(s < 0 for s in splits) or sum(splits) > t.numel():
        raise ValueError(f"{call}: {name} {list(splits)} do not fit the {t.numel()} elements of "
                         f"{name.split('_')[0]}")


def all_to_all_v_async(output: torch.Tensor, input: torch.Tensor, output_splits: List[int],
                       input_splits: List[int], priority: int = 0,
                       comm: Optional[_dear.Communicator] = None) -> Handle:
    """`input` is cut into consecutive parts of input_splits[j] elements, part j going to rank
    j; `output` into parts of output_splits[j] elements, part j coming from rank j. A rank's
    input_splits[j] must equal rank j's output_splits[rank]. Out of place only."""
    comm = _communicator(comm)
    dtype = _dtype(output, "output")
    _dtype(input, "input")
    _same_dtype(output, input)
    _check_splits("all_to_all_v", "output_splits", output_splits, output, comm.size)
    _check_splits("all_to_all_v", "input_splits", input_splits, input, comm.size)
    work = comm.all_to_all_v(input.data_ptr(), list(input_splits), _offsets(input_splits),
                             output.data_ptr(), list(output_splits), _offsets(output_splits),
                             dtype, priority, _stream(output))
    return Handle(work, output, input)


def all_gather_v_async(output: torch.Tensor, input: torch.Tensor, output_splits: List[int],
                       priority: int = 0, comm: Optional[_dear.Communicator] = None) -> Handle:
    """Every rank's `input` on every rank: `output` is cut into consecutive parts of
    output_splits[j] elements, part j rank j's input (whose numel must be output_splits[j]).
    Out of place only."""
    comm = _communicator(comm)
    dtype = _dtype(output, "output")
    _dtype(input, "input")
    _same_dtype(output, input)
    _check_splits("all_gather_v", "output_splits", output_splits, output, comm.size)
    work = comm.all_gather_v(input.data_ptr(), input.numel(), output.data_ptr(),
                             list(output_splits), _offsets(output_splits), dtype, priority,
                             _stream(output))
    return Handle(work, output, input)


def all_gather_v(output: torch.Tensor, input: torch.Tensor, output_splits: List[int],
                 priority: int = 0, comm: Optional[_dear.Communicator] = None) -> torch.Tensor:
    all_gather_v_async(output, input, output_splits, priority, comm=comm).wait()
    return output


def gather_v_async(output: Optional[torch.Tensor], input: torch.Tensor,
                   output_splits: Optional[List[int]], root: int = 0, priority: int = 0,
                   comm: Optional[_dear.Communicator] = None) -> Handle:
    """all_gather_v into the root's `output` only; elsewhere `output` and `output_splits` are
    not used and may be None."""
    comm = _communicator(comm)
    dtype = _dtype(input, "input")
    if comm.rank != root:
        work = comm.gather_v(input.data_ptr(), input.numel(), 0, [], [], dtype, root, priority,
                             _stream(input))
        return Handle(work, input)
    if output is None or output_splits is None:
        raise ValueError(f"gather_v: output and output_splits are needed on the root (rank "
                         f"{root})")
    _dtype(output, "output")
    _same_dtype(output, input)
    _check_splits("gather_v", "output_splits", output_splits, output, comm.size)
    work = comm.gather_v(input.data_ptr(), input.numel(), output.data_ptr(), list(output_splits),
                         _offsets(output_splits), dtype, root, priority, _stream(output))
    return Handle(work, output, input)


def gather_v(output: Optional[torch.Tensor], input: torch.Tensor,
             output_splits: Optional[List[int]], root: int = 0, priority: int = 0,
             comm: Optional[_dear.Communicator] = None) -> Optional[torch.Tensor]:
    gather_v_async(output, input, output_splits, root, priority, comm=comm).wait()
    return output


def all_to_all_v(output: torch.Tensor, input: torch.Tensor, output_splits: List[int],
                 input_splits: List[int], priority: int = 0,
                 comm: Optional[_dear.Communicator] = None) -> torch.Tensor:
    all_to_all_v_async(output, input, output_splits, input_splits, priority, comm=comm).wait()
    return output


def send_async(tensor: torch.Tensor, peer: int, tag: int = 0,
               comm: Optional[_dear.Communicator] = None) -> Handle:
    """`tensor` to rank `peer`, whose receives from this rank of the same `tag` take this
    rank's sends to it in issue order (a count or dtype that differs fails both)."""
    dtype = _dtype(tensor, "tensor")
    work = _communicator(comm).send(tensor.data_ptr(), tensor.numel(), dtype, peer,
                                    _stream(tensor), tag)
    return Handle(work, tensor)


def recv_async(tensor: torch.Tensor, peer: Optional[int] = None, tag: int = 0,
               comm: Optional[_dear.Communicator] = None) -> Handle:
    """Rank `peer`'s next send of `tag` to this rank, into `tensor`. `peer=None` takes the
    first message of `tag` that any rank sends (MPI_ANY_SOURCE); the handle's `source` then
    names the sender."""
    dtype = _dtype(tensor, "tensor")
    work = _communicator(comm).recv(tensor.data_ptr(), tensor.numel(), dtype,
                                    _dear.ANY_SOURCE if peer is None else peer,
                                    _stream(tensor), tag)
    return Handle(work, tensor)


def send(tensor: torch.Tensor, peer: int, tag: int = 0,
         comm: Optional[_dear.Communicator] = None) -> None:
    send_async(tensor, peer, tag, comm=comm).wait()


def recv(tensor: torch.Tensor, peer: Optional[int] = None, tag: int = 0,
         comm: Optional[_dear.Communicator] = None) -> int:
    """As recv_async, waited for; returns the sender's rank (torch.distributed.recv's
    answer), which is `peer` unless that is None."""
    handle = recv_async(tensor, peer, tag, comm=comm)
    handle.wait()
    return handle.source


def barrier_async(priority: int = 0, comm: Optional[_dear.Communicator] = None) -> Handle:
    return Handle(_communicator(comm).barrier(priority))


def all_reduce(tensor: torch.Tensor, op: str = "sum", priority: int = 0,
               comm: Optional[_dear.Communicator] = None) -> torch.Tensor:
    all_reduce_async(tensor, op, priority, comm=comm).wait()
    return tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                   priority: int = 0, comm: Optional[_dear.Communicator] = None) -> torch.Tensor:
    reduce_scatter_async(output, input, op, priority, comm=comm).wait()
    return output


def all_gather(output: torch.Tensor, input: torch.Tensor, priority: int = 0,
               comm: Optional[_dear.Communicator] = None) -> torch.Tensor:
    all_gather_async(output, input, priority, comm=comm).wait()
    return output


def broadcast(tensor: torch.Tensor, root: int = 0, priority: int = 0,
              comm: Optional[_dear.Communicator] = None) -> torch.Tensor:
    broadcast_async(tensor, root, priority, comm=comm).wait()
    return tensor


def reduce(tensor: torch.Tensor, root: int = 0, op: str = "sum",
           priority: int = 0, comm: Optional[_dear.Communicator] = None) -> torch.Tensor:
    reduce_async(tensor, root, op, priority, comm=comm).wait()
    return tensor


def gather(output: Optional[torch.Tensor], input: torch.Tensor, root: int = 0,
           priority: int = 0, comm: Optional[_dear.Communicator] = None) -> Optional[torch.Tensor]:
    gather_async(output, input, root, priority, comm=comm).wait()
    return output


def scatter(output: torch.Tensor, input: Optional[torch.Tensor], root: int = 0,
            priority: int = 0, comm: Optional[_dear.Communicator] = None) -> torch.Tensor:
    scatter_async(output, input, root, priority, comm=comm).wait()
    return output


def all_to_all(output: torch.Tensor, input: torch.Tensor, priority: int = 0,
               comm: Optional[_dear.Communicator] = None) -> torch.Tensor:
    all_to_all_async(output, input, priority, comm=comm).wait()
    return output


def barrier(priority: int = 0, comm: Optional[_dear.Communicator] = None) -> None:
    barrier_async(priority, comm=comm).wait()


def forget_memory(tensor: torch.Tensor) -> None:
    """Tells dear that `tensor`'s memory is about to be freed or reused, after the operations
    that used it have completed: transports that cache registrations of callers' memory with
    the NIC drop those for it (Communicator::forget_memory). Nothing to do over TCP."""
    storage = tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else tensor.storage()
    _communicator().forget_memory(storage.data_ptr(), storage.nbytes())


def broadcast_parameters(model: torch.nn.Module | Iterable[torch.Tensor], root: int = 0) -> None:
    """Makes every rank's parameters and buffers equal to `root`'s (call before training).

    Takes a module (its state_dict: parameters and buffers) or an iterable of tensors.
    """
    if isinstance(model, torch.nn.Module):
        tensors = list(model.state_dict(keep_vars=True).values())
    else:
        tensors = list(model)
    handles = []
    seen: set[int] = set()
    with torch.no_grad():
        for t in tensors:
            data = t.detach()
            if data.data_ptr() in seen or data.numel() == 0:  # shared weights: once is enough
                continue
            seen.add(data.data_ptr())
            handles.append(broadcast_async(data, root))
        for h in handles:
            h.wait()


from .optimizer import DistributedOptimizer  # noqa: E402  (needs the collectives above)
