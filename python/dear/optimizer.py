"""dear.DistributedOptimizer: data-parallel gradient synchronisation driven by module hooks.

Policies (all average gradients over ranks, as DDP does):

- ``"dear"`` (default): DeAR's decoupled all-reduce. Parameters are fused into groups in forward
  order (dear's threshold planner). During backprop a group's gradients are copied into its
  buffer and reduce-scattered once all are ready. ``step()`` waits for the reduce-scatters and
  starts the all-gather of group 0; the update itself is deferred to the next forward pass:
  just before the first module of group g runs, AG(g) is waited for, the next all-gathers are
  launched (``gather_window``), and the wrapped optimizer updates group g's parameters only.
  ``gather_window`` all-gathers are in flight while the forward pass waits for one: with 1 (the
  reference DeAR) only AG(g) itself, and AG(g+1) is launched once it completes; with 2 (the
  default) AG(g+1) is already moving, so the link does not idle while the waiting thread wakes
  up and launches the next one; ``None`` launches every group's all-gather in step(), and the
  engine's priorities order them (group 0 first). ``synchronize()`` applies whatever is
  still pending (call it before evaluating, saving or comparing parameters).
  Fusion (``fusion=``): ``"threshold"`` (default) fills a group while it stays within
  ``threshold_mb``; ``"nearby"`` puts every ``layers_per_group`` neighbouring layers (modules
  owning parameters) in one group; ``"auto"`` tunes the threshold while training, as the
  reference DeAR does: Bayesian optimisation (dear's ThresholdTuner) over ``tune_range_mb``
  (by default from a 64th of the model, at most 1 MiB, to the whole model),
  ``tune_trials`` trials, each a warm-up step and then ``tune_steps`` measured steps at one
  threshold (the slowest rank's mean step time is what counts, so every rank makes the same
  choice); between trials the pending updates are applied and the groups planned again; after
  the last trial the fastest measured threshold stays. ``fusion_threshold_mb`` and
  ``tuning_trials`` tell what it chose and measured.
- ``"wfbp"``: one all-reduce per tensor as soon as its gradient is ready; update in step().
- ``"bucket"``: PyTorch DDP's buckets (reverse registration order, the first capped at 1 MB or
  ``threshold_mb`` if smaller, the rest at ``threshold_mb``), all-reduced in bucket order;
  update in step().

Each group buffer carries, after the gradients, one flag per parameter: 1 where this rank has a
gradient. The flags are averaged with the gradients, so a parameter that had no gradient on any
rank keeps ``grad = None`` and is skipped by the optimizer, exactly as in local training, at no
extra message.

Every rank must issue the same collectives in the same order: the backward pass must produce
gradients in the same order on every rank (true for the same model and graph). All-gathers are
always issued in group order, and all of them before any collective of the next step, whatever
each rank's forward pass looks like.
"""
from __future__ import annotations

import enum
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from . import _dear

_MB = 1024 * 1024
_FIRST_BUCKET_BYTES = 1 * _MB  # DDP caps its first bucket so that communication starts early


class _State(enum.Enum):
    IDLE = 0        # collecting gradients of the current step
    REDUCING = 1    # RS (dear) or all-reduce (wfbp, bucket) in flight
    GATHER_QUEUED = 2  # dear: reduced, AG not launched yet
    GATHERING = 3   # dear: AG in flight; update applied when it is consumed


class _Group:
    """Parameters that share one communication buffer."""

    def __init__(self, index: int, params: List[torch.nn.Parameter], ranks: int) -> None:
        self.index = index
        self.params = params
        self.offsets: List[int] = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        self.flags_at = total
        padded = -(-(total + len(params)) // ranks) * ranks
        self.shard = padded // ranks
        # On the parameters' device: CUDA parameters get a device buffer (builds with CUDA).
        self.buffer = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
        self.ready = 0
        self.state = _State.IDLE
        self.handle = None
        # Per param_group of the wrapped optimizer, this group's parameters in it (filled later).
        self.opt_params: List[List[torch.nn.Parameter]] = []

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


class _ParamInfo:
    __slots__ = ("group", "slot", "passes")

    def __init__(self, group: int, slot: int) -> None:
        self.group = group
        self.slot = slot
        self.passes = 0  # backward passes that reached this parameter since the last step


class DistributedOptimizer:
    """Wraps a torch.optim optimizer so that step() updates with gradients averaged over ranks.

    Args:
        optimizer: any torch.optim optimizer over (a subset of) ``model``'s parameters whose
            step() needs no closure (SGD, Adam, AdamW, ...).
        model: the module whose forward and backward passes drive communication.
        policy: "dear", "wfbp" or "bucket".
        threshold_mb: fusion threshold (dear) or bucket size (bucket), in MiB; with
            fusion="auto", the tuner's third trial (so that tuning never settles on a
            threshold measured slower than this one).
        backward_passes_per_step: gradient accumulation; communication starts only in the
            k-th backward pass since the last step.
        fusion: "threshold", "nearby" or "auto" (policy "dear" only; see the module's text).
        layers_per_group: fusion="nearby": neighbouring layers per group.
        gather_window: policy "dear": all-gathers in flight during the forward pass (>= 1, or
            None for all of them from step() on; see the module's text).
        tune_trials, tune_steps, tune_range_mb: fusion="auto": trials, measured steps per
            trial, and the (smallest, largest) threshold tried, in MiB (default: from a 64th
            of the model's gradient bytes, at most 1 MiB, to the whole model).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 policy: str = "dear", threshold_mb: float = 25,
                 backward_passes_per_step: int = 1, fusion: str = "threshold",
                 layers_per_group: int = 4, tune_trials: int = 10, tune_steps: int = 5,
                 tune_range_mb: Optional[Tuple[float, float]] = None,
                 gather_window: Optional[int] = 2) -> None:
        from . import size  # the package's communicator; dear.init() must have run

        if policy not in ("dear", "wfbp", "bucket"):
            raise ValueError(f"unknown policy {policy!r}; use 'dear', 'wfbp' or 'bucket'")
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        if fusion not in ("threshold", "nearby", "auto"):
            raise ValueError(f"unknown fusion {fusion!r}; use 'threshold', 'nearby' or 'auto'")
        if fusion != "threshold" and policy != "dear":
            raise ValueError(f"fusion={fusion!r} applies to policy 'dear' only, not {policy!r}")
        if layers_per_group < 1:
            raise ValueError(f"layers_per_group must be >= 1, got {layers_per_group}")
        if gather_window is not None and gather_window < 1:
            raise ValueError(f"gather_window must be >= 1 or None, got {gather_window}")
        if fusion == "auto":
            if tune_trials < 1 or tune_steps < 1:
                raise ValueError(f"tune_trials and tune_steps must be >= 1, got {tune_trials} "
                                 f"and {tune_steps}")
            if tune_range_mb is not None and not 0 < tune_range_mb[0] < tune_range_mb[1]:
                raise ValueError(f"tune_range_mb must be (smallest, largest) with "
                                 f"0 < smallest < largest, got {tune_range_mb}")
        self.optimizer = optimizer
        self.model = model
        self.policy = policy
        self.fusion = fusion
        self.backward_passes_per_step = backward_passes_per_step
        self._ranks = size()
        self._threshold = int(threshold_mb * _MB)
        self._layers_per_group = layers_per_group
        self._tuner = None
        # None: every all-gather from step() on (no plan has that many groups).
        self._gather_window = gather_window if gather_window is not None else 1 << 30
        self._tune_steps = tune_steps
        self._trial_start: Optional[float] = None  # end of the trial's warm-up step
        self._trial_steps = 0
        self._tuned_trials: List[Tuple[int, float]] = []  # the tuner's trials, once done

        # Parameters in registration order (the usual stand-in for forward order), each once
        # even when modules share it; frozen ones take no part.
        owners: Dict[torch.nn.Parameter, List[torch.nn.Module]] = {}
        layers: List[List[torch.nn.Parameter]] = []
        for module in model.modules():
            fresh = []
            for p in module.parameters(recurse=False):
                if not p.requires_grad:
                    continue
                if p not in owners:
                    owners[p] = []
                    fresh.append(p)
                owners[p].append(module)
            if fresh:
                layers.append(fresh)

        self._owners = owners
        self._layers = layers
        if fusion == "auto":
            if tune_range_mb is None:
                # From a 64th of the model (at most 1 MiB, at least 4 KiB: many groups) to the
                # whole model (one group).
                total = sum(p.numel() * p.element_size() for layer in layers for p in layer)
                lo = max(4096, min(_MB, total // 64))
                hi = max(2 * lo, total)
            else:
                lo, hi = int(tune_range_mb[0] * _MB), int(tune_range_mb[1] * _MB)
            self._tuner = _dear.ThresholdTuner(lo, hi, tune_trials,
                                               middle_bytes=min(max(self._threshold, lo), hi))
            self._threshold = self._tuner.next()
        self._hooks = []
        self._accumulators = []
        self._build()

    def _build(self) -> None:
        """Plans the groups and registers the hooks (again, after the threshold changed)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._accumulators = []
        optimizer = self.optimizer
        self._groups = [_Group(i, ps, self._ranks)
                        for i, ps in enumerate(self._plan(self._layers))]
        self._info: Dict[torch.nn.Parameter, _ParamInfo] = {}
        for g in self._groups:
            for slot, p in enumerate(g.params):
                self._info[p] = _ParamInfo(g.index, slot)

        # The wrapped optimizer's param_groups, restricted to each fusion group, so that a
        # deferred update touches (and advances the state of) that group's parameters only.
        for g in self._groups:
            members = set(g.params)
            g.opt_params = [[p for p in pg["params"] if p in members]
                            for pg in optimizer.param_groups]
        # Optimizer parameters the model does not own: updated locally in step().
        self._local_params = [[p for p in pg["params"] if p not in self._info]
                              for pg in optimizer.param_groups]
        self._has_local = any(self._local_params)
        self._model_params = [[p for p in pg["params"] if p in self._info]
                              for pg in optimizer.param_groups]

        self._next_bucket = 0   # bucket: buckets are all-reduced in index order
        self._next_gather = 0   # dear: all-gathers are launched in group order
        self._pending = False   # dear: updates of the last step not yet applied
        self._register_hooks(self._owners)

    # ----------------------------------------------------------------------------- planning

    def _plan(self, layers: List[List[torch.nn.Parameter]]) -> List[List[torch.nn.Parameter]]:
        if self.policy == "wfbp":
            return [[p] for layer in layers for p in layer]
        if self.policy == "bucket":
            return self._plan_buckets([p for layer in layers for p in layer][::-1])
        sizes = [[p.numel() for p in layer] for layer in layers]
        element_bytes = layers[0][0].element_size() if layers else 4
        if self.fusion == "nearby":
            ranges = _dear.plan_nearby(sizes, self._ranks, self._layers_per_group, element_bytes)
        else:
            ranges = _dear.plan_threshold(sizes, self._ranks, self._threshold, element_bytes)
        groups = []
        for first, last in ranges:
            groups.extend(_split_by_dtype([p for layer in layers[first:last + 1]
                                           for p in layer]))
        return groups

    def _plan_buckets(self, params: List[torch.nn.Parameter]) -> List[List[torch.nn.Parameter]]:
        buckets: List[List[torch.nn.Parameter]] = []
        current: List[torch.nn.Parameter] = []
        filled = 0
        for p in params:
            if current and p.dtype != current[0].dtype:
                buckets.append(current)
                current, filled = [], 0
            current.append(p)
            filled += p.numel() * p.element_size()
            cap = min(_FIRST_BUCKET_BYTES, self._threshold) if not buckets else self._threshold
            if filled >= cap:
                buckets.append(current)
                current, filled = [], 0
        if current:
            buckets.append(current)
        return buckets

    # -------------------------------------------------------------------------------- hooks

    def _register_hooks(self, owners: Dict[torch.nn.Parameter, List[torch.nn.Module]]) -> None:
        # The gradient accumulator's post-hook runs after the gradient is in p.grad, once per
        # backward pass even when the parameter is used several times (shared weights).
        with torch.enable_grad():
            for p in self._info:
                accumulator = p.expand_as(p).grad_fn.next_functions[0][0]
                self._hooks.append(accumulator.register_hook(self._make_grad_hook(p)))
                self._accumulators.append(accumulator)  # the hook lives as long as it does
        if self.policy != "dear":
            return
        groups_of: Dict[torch.nn.Module, set] = {}
        for p, modules in owners.items():
            for m in modules:
                groups_of.setdefault(m, set()).add(self._info[p].group)
        for m, groups in groups_of.items():
            self._hooks.append(m.register_forward_pre_hook(self._make_pre_hook(sorted(groups))))

    def _make_grad_hook(self, p: torch.nn.Parameter) -> Callable:
        def hook(*_unused) -> None:
            info = self._info[p]
            info.passes += 1
            if info.passes < self.backward_passes_per_step:
                return
            if info.passes > self.backward_passes_per_step:
                raise RuntimeError(
                    f"a gradient was computed {info.passes} times since the last step, but "
                    f"backward_passes_per_step is {self.backward_passes_per_step}; call step() "
                    "or raise backward_passes_per_step")
            self._gradient_ready(p)
        return hook

    def _make_pre_hook(self, groups: List[int]) -> Callable:
        def hook(_module, _inputs) -> None:
            # Also under torch.no_grad(): evaluation must see the updated parameters. This only
            # completes the last step's all-gathers; nothing new is communicated.
            if self._pending:
                for g in groups:
                    self._finish(self._groups[g])
        return hook

    # ----------------------------------------------------------------------- communication

    def _gradient_ready(self, p: torch.nn.Parameter) -> None:
        info = self._info[p]
        g = self._groups[info.group]
        if self._pending:
            # The next step's collectives must follow every all-gather of this one, on every
            # rank; and this group's buffer must be consumed before it is refilled.
            self._launch_gathers(len(self._groups) - 1)
            self._finish(g)
        if g.state is not _State.IDLE:
            raise RuntimeError("a gradient became ready while its group was being reduced; "
                               "call step() after each backward pass (or raise "
                               "backward_passes_per_step)")
        self._fill(g, info.slot)
        if g.ready == len(g.params):
            self._launch_reduce(g)

    def _fill(self, g: _Group, slot: int) -> None:
        p = g.params[slot]
        with torch.no_grad():
            if p.grad is None:
                g.view(slot).zero_()
                g.buffer[g.flags_at + slot] = 0
            else:
                g.view(slot).copy_(p.grad)
                g.buffer[g.flags_at + slot] = 1
        g.ready += 1

    def _launch_reduce(self, g: _Group) -> None:
        from . import all_reduce_async, reduce_scatter_async

        if self.policy == "dear":
            # Groups nearer the input are needed first by the next forward pass.
            priority = len(self._groups) - g.index
            shard = g.buffer[_rank() * g.shard:(_rank() + 1) * g.shard]
            g.handle = reduce_scatter_async(shard, g.buffer, op="avg", priority=priority)
            g.state = _State.REDUCING
        elif self.policy == "wfbp":
            g.handle = all_reduce_async(g.buffer, op="avg")
            g.state = _State.REDUCING
        else:
            g.state = _State.REDUCING  # ready; launched in bucket order
            while (self._next_bucket < len(self._groups)
                   and self._groups[self._next_bucket].state is _State.REDUCING):
                b = self._groups[self._next_bucket]
                b.handle = all_reduce_async(b.buffer, op="avg")
                self._next_bucket += 1

    def _launch_gathers(self, through: int) -> None:
        """Launches the queued all-gathers up to group `through`, in group order."""
        from . import all_gather_async

        while self._next_gather <= through and self._next_gather < len(self._groups):
            g = self._groups[self._next_gather]
            shard = g.buffer[_rank() * g.shard:(_rank() + 1) * g.shard]
            g.handle = all_gather_async(g.buffer, shard,
                                        priority=_dear.ALL_GATHER_PRIORITY - g.index)
            g.state = _State.GATHERING
            self._next_gather += 1

    def _finish(self, g: _Group) -> None:
        """dear: consumes group g's all-gather and applies its deferred update."""
        if g.state not in (_State.GATHER_QUEUED, _State.GATHERING):
            return
        self._launch_gathers(g.index + self._gather_window - 1)
        g.handle.wait()
        g.handle = None
        # Prefetch the next groups while this one computes.
        self._launch_gathers(g.index + self._gather_window)
        g.state = _State.IDLE
        self._apply(g)
        if all(x.state not in (_State.GATHER_QUEUED, _State.GATHERING) for x in self._groups):
            self._pending = False

    def _apply(self, g: _Group) -> None:
        """Runs the wrapped optimizer on group g's parameters with the averaged gradients."""
        flags = g.buffer[g.flags_at:g.flags_at + len(g.params)].tolist()
        saved = [p.grad for p in g.params]
        try:
            for i, p in enumerate(g.params):
                p.grad = g.view(i) if flags[i] != 0 else None
            self._step_on(g.opt_params)
        finally:
            # The user's gradients (zeroed or accumulating by now) are left as they were.
            for p, grad in zip(g.params, saved):
                p.grad = grad

    def _step_on(self, subsets: List[List[torch.nn.Parameter]]) -> None:
        param_groups = self.optimizer.param_groups
        originals = [pg["params"] for pg in param_groups]
        try:
            for pg, subset in zip(param_groups, subsets):
                pg["params"] = subset
            self.optimizer.step()
        finally:
            for pg, params in zip(param_groups, originals):
                pg["params"] = params

    # ------------------------------------------------------------------------------ public

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Averages the gradients over ranks and updates (dear: starts the deferred update)."""
        loss = closure() if closure is not None else None
        if self._pending:  # groups the forward pass did not reach
            self.synchronize()
        # Parameters whose gradient did not arrive through a hook (unused in this step's graph,
        # or fewer backward passes than declared): whatever p.grad holds now, maybe None.
        for g in self._groups:
            if g.state is _State.IDLE and g.ready < len(g.params):
                filled = {i for i, p in enumerate(g.params)
                          if self._info[p].passes >= self.backward_passes_per_step}
                for slot in range(len(g.params)):
                    if slot not in filled:
                        self._fill(g, slot)
                self._launch_reduce(g)
        for p in self._info:
            self._info[p].passes = 0
        for g in self._groups:
            g.ready = 0
        if self._has_local:
            self._step_on(self._local_params)

        if self.policy == "dear":
            # Wait in issue-independent order: every RS must complete before any AG starts
            # (the buffer is both), and AG(0) is what the next forward pass needs first.
            for g in self._groups:
                g.handle.wait()
                g.handle = None
                g.state = _State.GATHER_QUEUED
            self._next_gather = 0
            self._pending = bool(self._groups)
            self._launch_gathers(self._gather_window - 1)
            if self._tuner is not None:
                self._tune()
            return loss

        for g in self._groups:
            g.handle.wait()
            g.handle = None
            g.state = _State.IDLE
        self._next_bucket = 0
        flags_of = {g.index: g.buffer[g.flags_at:g.flags_at + len(g.params)].tolist()
                    for g in self._groups}
        with torch.no_grad():
            for g in self._groups:
                for i, p in enumerate(g.params):
                    if flags_of[g.index][i] == 0:
                        p.grad = None
                    elif p.grad is None:
                        p.grad = g.view(i).clone()
                    else:
                        p.grad.copy_(g.view(i))
        self._step_on(self._model_params)
        return loss

    def _tune(self) -> None:
        """fusion="auto": times the current trial; between trials plans with the next one."""
        now = time.perf_counter()
        if self._trial_start is None:  # the trial's warm-up step ends here
            self._trial_start, self._trial_steps = now, 0
            return
        self._trial_steps += 1
        if self._trial_steps < self._tune_steps:
            return
        from . import all_reduce

        # Every rank must report the same time, or the tuners would choose differently.
        mean_ms = torch.tensor([(now - self._trial_start) / self._trial_steps * 1e3],
                               dtype=torch.float64)
        all_reduce(mean_ms, op="max")
        self._tuner.report(self._threshold, float(mean_ms[0]))
        self._trial_start = None
        done = self._tuner.done()
        threshold = self._tuner.best() if done else self._tuner.next()
        if threshold != self._threshold:
            self.synchronize()
            self._threshold = threshold
            self._build()
        if done:
            self._tuned_trials = self._tuner.trials()
            self._tuner = None

    def synchronize(self) -> None:
        """Completes every pending all-gather and applies every pending update (dear), so that
        the parameters equal those of non-distributed training. A no-op for other policies."""
        if not self._pending:
            return
        self._launch_gathers(len(self._groups) - 1)
        for g in self._groups:
            self._finish(g)
        self._pending = False

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        """Detaches from the model (after synchronize()); the optimizer stays usable alone."""
        self.synchronize()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._accumulators.clear()

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def state_dict(self) -> dict:
        self.synchronize()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.synchronize()
        self.optimizer.load_state_dict(state_dict)

    @property
    def fusion_threshold_mb(self) -> float:
        """The fusion threshold in use (fusion="auto": the trial's, or the chosen one)."""
        return self._threshold / _MB

    @property
    def tuning_trials(self) -> List[Tuple[float, float]]:
        """fusion="auto": (threshold in MiB, slowest rank's mean step in ms) per trial so far."""
        trials = self._tuner.trials() if self._tuner is not None else self._tuned_trials
        return [(t / _MB, ms) for t, ms in trials]

    @property
    def tuning(self) -> bool:
        """fusion="auto": whether trials are still running."""
        return self._tuner is not None

    @property
    def num_groups(self) -> int:
        """Fusion groups (dear), tensors (wfbp) or buckets (bucket)."""
        return len(self._groups)


def _rank() -> int:
    from . import rank
    return rank()


def _split_by_dtype(params: Iterable[torch.nn.Parameter]) -> List[List[torch.nn.Parameter]]:
    """One buffer has one dtype and device: a fused run is cut where either changes."""
    runs: List[List[torch.nn.Parameter]] = []
    for p in params:
        if runs and runs[-1][0].dtype == p.dtype and runs[-1][0].device == p.device:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs
