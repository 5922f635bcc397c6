"""torch.distributed backend "dear" (torch 1.13): dear's engine under torch.distributed, and
under DistributedDataParallel.

    import dear.backend, torch.distributed as dist
    dear.backend.init_process_group()        # or, with a store of your own:
    # dear.backend.register(); dist.init_process_group("dear", store=..., rank=r, world_size=n)
    model = torch.nn.parallel.DistributedDataParallel(model)

torch 1.13's Backend.register_backend accepts a creator that returns a Python subclass of c10d's
ProcessGroup. dear rendezvous from the launcher's environment itself; torch still needs a store
that all ranks share (its start-up barrier, and other backends' groups made with
dist.new_group), but not the env:// one: under dear-run, MASTER_PORT is dear's own listening
port, which env:// would try to bind a second time. init_process_group() makes a TCPStore on a
port rank 0's system chooses and tells the other ranks over dear.

Why the Work objects are not Python subclasses: DDP calls this process group from C++
(parameter checks, broadcasts, the reducer's all-reduces) and keeps only the C++ half of the
Work it gets back. The Python half of a Python-subclassed Work dies as soon as the call returns,
and with it the overrides of wait() and get_future(): C++ then waits on c10d's base Work, which
nothing ever completes (DDP hung there, in _verify_params_across_processes). So every method
returns torch's own future-backed Work (_create_work_from_future), and one completion thread per
process group waits for dear's handles (the GIL released while it waits) and completes the
futures, in issue order, as Gloo's worker threads do. Callbacks chained on the futures (DDP's)
run on that thread.

Supported: allreduce (sum, product, min, max, avg), broadcast, allgather, reduce_scatter,
reduce, gather, scatter, barrier, each over a list of tensors; all_gather_into_tensor and
reduce_scatter_tensor (the flat forms, _allgather_base and _reduce_scatter_base, which run dear's
own all_gather and reduce_scatter without a copy); all_to_all and all_to_all_single, with and
without split sizes (dear's all_to_all, or all_to_all_v where the splits differ);
dist.new_group of any ranks (a dear communicator of its own, rendezvous through the group's
store); send and recv (isend, irecv) with tags, from a named rank or from any source
(dist.recv(t) returns the sender); DistributedDataParallel on CPU tensors. Timeouts are dear's
(DEAR_TIMEOUT), not the process group's.
"""
from __future__ import annotations

import atexit
import os
import queue
import socket
import threading
import weakref
from datetime import timedelta
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, ReduceOp, Work, _create_work_from_future

import dear

_OPS = {ReduceOp.SUM: "sum", ReduceOp.PRODUCT: "prod", ReduceOp.MIN: "min",
        ReduceOp.MAX: "max"}
if hasattr(ReduceOp, "AVG"):
    _OPS[ReduceOp.AVG] = "avg"


class _Completer:
    """Completes each Work's future once its dear handles are done, in issue order.

    Issue order is also the engine's completion order for operations of equal priority (all of
    this backend's), so waiting for the oldest first costs no latency.
    """

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Optional[tuple]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dear-backend-completer",
                                        daemon=True)
        self._thread.start()

    def submit(self, handles: List[dear.Handle], result: List[torch.Tensor],
               after: Optional[Callable[[], None]] = None) -> Work:
        future: torch.futures.Future = torch.futures.Future()
        self._queue.put((handles, result, after, future))
        return _create_work_from_future(future)

    def close(self, join: bool = False) -> None:
        self._queue.put(None)
        # Not from __del__: the last reference may be dropped on the thread itself.
        if join and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handles, result, after, future = item
            try:
                for h in handles:
                    h.wait()  # releases the GIL
                if after is not None:
                    after()
            except BaseException as e:  # noqa: BLE001 (every failure goes to the waiter)
                future.set_exception(e)
            else:
                future.set_result(result)


def _op(opts) -> str:
    try:
        return _OPS[opts.reduceOp]
    except KeyError:
        raise ValueError(f"dear backend: unsupported reduction {opts.reduceOp}") from None


class _AnySourceWork(Work):
    """recv_anysource's Work: torch's future-backed one, which also names the sender
    (dist.recv(src=None) asks _source_rank()). A Python subclass is safe here, unlike for the
    other calls: only torch.distributed's Python code calls recv_anysource and holds what it
    returns."""

    def __init__(self, inner: Work, handles: List[dear.Handle]) -> None:
        super().__init__()
        self._inner = inner
        self._handles = handles

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:  # noqa: B008
        return self._inner.wait() if not timeout else self._inner.wait(timeout)

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def get_future(self) -> torch.futures.Future:
        return self._inner.get_future()

    def _source_rank(self) -> int:
        return self._handles[0].source

    def source_rank(self) -> int:
        return self._source_rank()


# Completion threads still running. At exit they are stopped before the interpreter goes down
# (a thread completing a future while modules are torn down can crash it).
_completers: "weakref.WeakSet[_Completer]" = weakref.WeakSet()


def _stop_completers() -> None:
    dear.shutdown()  # fails whatever is still in flight, so no thread stays blocked on it
    for comm in list(_group_comms):
        comm.close()
    for completer in list(_completers):
        completer.close(join=True)


atexit.register(_stop_completers)  # runs before dear's own handler (registered earlier)


class ProcessGroupDear(ProcessGroup):
    def __init__(self, rank: int, size: int,
                 comm: Optional["dear.Communicator"] = None) -> None:
        """`comm`: a subgroup's communicator of its own; None for dear.init()'s."""
        super().__init__(rank, size)
        self._comm = comm
        self._completer = _Completer()
        _completers.add(self._completer)

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "dear"

    def name(self) -> str:
        return "dear"

    def allreduce(self, tensors: List[torch.Tensor], opts=None) -> Work:
        op = _op(opts) if opts is not None else "sum"
        return self._completer.submit(
            [dear.all_reduce_async(t, op=op, comm=self._comm) for t in tensors], tensors)

    def broadcast(self, tensors: List[torch.Tensor], opts=None) -> Work:
        root = opts.rootRank if opts is not None else 0
        return self._completer.submit(
            [dear.broadcast_async(t, root, comm=self._comm) for t in tensors], tensors)

    def allgather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                  opts=None) -> Work:
        handles, copies = [], []
        for outputs, t in zip(output_lists, inputs):
            if len(outputs) != self.size():
                raise ValueError(f"dear backend: allgather needs {self.size()} outputs per "
                                 f"input, got {len(outputs)}")
            # torch hands separate output tensors; dear gathers into one contiguous buffer.
            flat = torch.empty(t.numel() * len(outputs), dtype=t.dtype, device=t.device)
            handles.append(dear.all_gather_async(flat, t.contiguous(), comm=self._comm))
            copies.append((flat, outputs))

        def scatter_out() -> None:
            for flat, outputs in copies:
                for out, part in zip(outputs, flat.chunk(len(outputs))):
                    out.copy_(part.view_as(out))
        return self._completer.submit(handles, [o for outs in output_lists for o in outs],
                                      scatter_out)

    def reduce_scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]],
                       opts=None) -> Work:
        op = _op(opts) if opts is not None else "sum"
        handles, copies = [], []
        for out, inputs in zip(outputs, input_lists):
            if len(inputs) != self.size():
                raise ValueError(f"dear backend: reduce_scatter needs {self.size()} inputs per "
                                 f"output, got {len(inputs)}")
            flat = torch.cat([i.reshape(-1) for i in inputs])
            if out.is_contiguous():
                handles.append(dear.reduce_scatter_async(out, flat, op=op, comm=self._comm))
            else:
                staged = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
                handles.append(dear.reduce_scatter_async(staged, flat, op=op, comm=self._comm))
                copies.append((out, staged))

        def copy_out() -> None:
            for out, staged in copies:
                out.copy_(staged.view_as(out))
        return self._completer.submit(handles, outputs, copy_out if copies else None)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                        opts=None) -> Work:
        """dist.all_gather_into_tensor: dear's all_gather (it checks the shapes)."""
        return self._completer.submit([dear.all_gather_async(output, input, comm=self._comm)],
                                      [output])

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                             opts=None) -> Work:
        """dist.reduce_scatter_tensor: dear's reduce_scatter (it checks the shapes)."""
        op = _op(opts) if opts is not None else "sum"
        return self._completer.submit(
            [dear.reduce_scatter_async(output, input, op=op, comm=self._comm)], [output])

    def barrier(self, opts=None) -> Work:
        return self._completer.submit([dear.barrier_async(comm=self._comm)], [])

    # What dear does not run yet: an error naming the call and what to use meanwhile, instead
    # of c10d's generic "does not support".
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int = 0) -> Work:
        """dist.send / isend: dear's send, matched with dst's receives of the same tag from
        this rank in issue order."""
        return self._completer.submit(
            [dear.send_async(t.contiguous(), dst, tag, comm=self._comm) for t in tensors], [])

    def recv(self, tensors: List[torch.Tensor], src: int, tag: int = 0) -> Work:
        """dist.recv / irecv from one rank (src): dear's recv."""
        staged = [t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                  for t in tensors]

        def copy_out() -> None:
            for t, s in zip(tensors, staged):
                if s is not t:
                    t.copy_(s)
        return self._completer.submit(
            [dear.recv_async(s, src, tag, comm=self._comm) for s in staged], list(tensors),
            copy_out)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int = 0) -> Work:
        """dist.recv / irecv with src=None: dear's recv from any source; the Work names the
        sender (dist.recv returns it)."""
        if len(tensors) != 1:
            raise ValueError(f"dear backend: recv from any source takes one tensor, got "
                             f"{len(tensors)}")
        t = tensors[0]
        staged = t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        handles = [dear.recv_async(staged, None, tag, comm=self._comm)]

        def copy_out() -> None:
            if staged is not t:
                t.copy_(staged)
        return _AnySourceWork(self._completer.submit(handles, [t], copy_out), handles)

    def reduce(self, tensors: List[torch.Tensor], opts=None) -> Work:
        op = _op(opts) if opts is not None else "sum"
        root = opts.rootRank if opts is not None else 0
        return self._completer.submit(
            [dear.reduce_async(t, root, op=op, comm=self._comm) for t in tensors], tensors)

    def gather(self, output_lists: List[List[torch.Tensor]], inputs: List[torch.Tensor],
               opts=None) -> Work:
        root = opts.rootRank if opts is not None else 0
        if len(inputs) != 1:
            raise ValueError(f"dear backend: gather takes one input tensor, got {len(inputs)}")
        t = inputs[0].contiguous()
        if self.rank() != root:
            return self._completer.submit([dear.gather_async(None, t, root, comm=self._comm)], [])
        if len(output_lists) != 1 or len(output_lists[0]) != self.size():
            raise ValueError(f"dear backend: gather needs one list of {self.size()} outputs on "
                             f"the root, got {[len(o) for o in output_lists]}")
        outputs = output_lists[0]
        # torch hands separate output tensors; dear gathers into one contiguous buffer.
        flat = torch.empty(t.numel() * self.size(), dtype=t.dtype, device=t.device)

        def scatter_out() -> None:
            for out, part in zip(outputs, flat.chunk(self.size())):
                out.copy_(part.view_as(out))
        return self._completer.submit([dear.gather_async(flat, t, root, comm=self._comm)],
                                      list(outputs), scatter_out)

    def scatter(self, outputs: List[torch.Tensor], input_lists: List[List[torch.Tensor]],
                opts=None) -> Work:
        root = opts.rootRank if opts is not None else 0
        if len(outputs) != 1:
            raise ValueError(f"dear backend: scatter takes one output tensor, got {len(outputs)}")
        out = outputs[0]
        staged = out if out.is_contiguous() else torch.empty(out.numel(), dtype=out.dtype,
                                                             device=out.device)
        flat = None
        if self.rank() == root:
            if len(input_lists) != 1 or len(input_lists[0]) != self.size():
                raise ValueError(f"dear backend: scatter needs one list of {self.size()} inputs "
                                 f"on the root, got {[len(i) for i in input_lists]}")
            # torch hands separate input tensors; dear scatters from one contiguous buffer.
            flat = torch.cat([i.reshape(-1) for i in input_lists[0]])

        def copy_out() -> None:
            if staged is not out:
                out.copy_(staged.view_as(out))
        return self._completer.submit(
            [dear.scatter_async(staged, flat, root, comm=self._comm)], [out], copy_out)

    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                 opts=None) -> Work:
        """dist.all_to_all: inputs[j] goes to rank j, outputs[j] comes from rank j: dear's
        all_to_all where every tensor has one size, else its all_to_all_v."""
        n = self.size()
        if len(inputs) != n or len(outputs) != n:
            raise ValueError(f"dear backend: all_to_all needs {n} inputs and {n} outputs, got "
                             f"{len(inputs)} and {len(outputs)}")
        # torch hands separate tensors; dear exchanges one contiguous buffer each way.
        flat_in = torch.cat([t.reshape(-1) for t in inputs])
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=flat_in.dtype,
                               device=flat_in.device)
        in_sizes = [t.numel() for t in inputs]
        out_sizes = [t.numel() for t in outputs]
        if len(set(in_sizes + out_sizes)) == 1:
            handle = dear.all_to_all_async(flat_out, flat_in, comm=self._comm)
        else:
            handle = dear.all_to_all_v_async(flat_out, flat_in, out_sizes, in_sizes,
                                             comm=self._comm)

        def scatter_out() -> None:
            for out, part in zip(outputs, flat_out.split(out_sizes)):
                out.copy_(part.view_as(out))
        return self._completer.submit([handle], list(outputs), scatter_out)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                      output_split_sizes: List[int], input_split_sizes: List[int],
                      opts=None) -> Work:
        """dist.all_to_all_single: rows of the flat tensors, split evenly (no split sizes) by
        dear's all_to_all, else by its all_to_all_v."""
        n = self.size()
        sizes = []
        for name, splits, t in (("output", output_split_sizes, output),
                                ("input", input_split_sizes, input)):
            rows = t.size(0) if t.dim() > 0 else t.numel()
            if not splits:
                if rows % n != 0:
                    raise ValueError(f"dear backend: all_to_all_single {name} has {rows} rows, "
                                     f"which {n} ranks cannot split evenly; pass split sizes")
                splits = [rows // n] * n
            if len(splits) != n or sum(splits) != rows:
                raise ValueError(f"dear backend: all_to_all_single {name}_split_sizes "
                                 f"{list(splits)} need {n} entries adding up to its {rows} rows")
            row = t.numel() // rows if rows else 0
            sizes.append([s * row for s in splits])
        out_sizes, in_sizes = sizes
        src = input.contiguous()
        staged = output if output.is_contiguous() else torch.empty(
            output.shape, dtype=output.dtype, device=output.device)
        if len(set(in_sizes + out_sizes)) == 1 and output.numel() == input.numel():
            handle = dear.all_to_all_async(staged.view(-1), src.view(-1), comm=self._comm)
        else:
            handle = dear.all_to_all_v_async(staged.view(-1), src.view(-1), out_sizes,
                                             in_sizes, comm=self._comm)

        def copy_out() -> None:
            if staged is not output:
                output.copy_(staged)
        return self._completer.submit([handle], [output], copy_out)

    def __del__(self) -> None:
        completer = getattr(self, "_completer", None)
        if completer is not None:
            completer.close()


# Subgroups' communicators (dist.new_group), closed at exit with dear's own.
_group_comms: "weakref.WeakSet[dear.Communicator]" = weakref.WeakSet()


def _create(store, rank: int, size: int, timeout: timedelta) -> ProcessGroup:
    dear.init()
    if not dist.is_initialized():
        # The default group: dear.init()'s communicator.
        if (dear.rank(), dear.size()) != (rank, size):
            raise RuntimeError(f"dear backend: torch says rank {rank} of {size}, the "
                               f"launcher's environment says {dear.rank()} of {dear.size()}")
        return ProcessGroupDear(rank, size)
    # dist.new_group: only its members get here, each with the group's own store. Its rank 0
    # opens a rendezvous and leaves the address in the store; the members connect to it.
    key = "dear_unique_id"
    if rank == 0:
        store.set(key, dear._dear.new_unique_id(dear._communicator().advertise_host))
    uid = store.get(key).decode()
    comm = dear.Communicator.from_id(uid, rank, size,
                                     f"torch group of {size} (world rank {dear.rank()})")
    _group_comms.add(comm)
    return ProcessGroupDear(rank, size, comm)


def register() -> None:
    """Registers "dear" with torch.distributed (once)."""
    if "DEAR" not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend("dear", _create)


def _store(timeout: timedelta) -> dist.TCPStore:
    """A TCPStore served by rank 0 on a free port; its address travels over dear."""
    rank, size = dear.rank(), dear.size()
    server = None
    address = torch.zeros(256, dtype=torch.uint8)
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        server = dist.TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
        text = f"{host} {server.port}".encode()
        if len(text) > address.numel():
            raise RuntimeError(f"dear backend: store address {text!r} is too long")
        address[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    dear.broadcast(address, root=0)
    if server is not None:
        return server
    host, port = bytes(address.tolist()).rstrip(b"\0").decode().rsplit(" ", 1)
    return dist.TCPStore(host, int(port), size, False, timeout=timeout)


def init_process_group(timeout: timedelta = timedelta(minutes=5)) -> None:
    """dear.init(), then torch.distributed's default group on the "dear" backend.

    The store is a TCPStore that rank 0 serves (at MASTER_ADDR, or its host name); groups of
    other backends can be made next to it with dist.new_group(backend="gloo").
    """
    register()
    dear.init()
    dist.init_process_group("dear", store=_store(timeout), rank=dear.rank(),
                            world_size=dear.size(), timeout=timeout)
