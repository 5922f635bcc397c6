"""A small model and training loops shared by the optimizer tests.

The distributed run and the local reference see the same data: step s draws one global batch
from a generator seeded with s; rank r trains on its r-th slice, the reference on all of it.
With losses averaged over samples, the average over ranks of the ranks' gradients is the
reference's gradient, so the parameters must agree up to floating-point rounding.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import dear

BATCH_PER_RANK = 4
CLASSES = 10


class Net(nn.Module):
    """Conv, layer norms and linears; one weight shared by two modules, a parameter on the root
    module itself, a frozen layer and a layer that is never used (its gradients stay None)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1, 1, 8, 8))
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.LayerNorm([4, 8, 8])
        self.fc1 = nn.Linear(4 * 8 * 8, 16)
        self.ln = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 16)
        self.tied = nn.Linear(16, 16, bias=False)
        self.tied.weight = self.fc2.weight  # shared: gradients from both uses add up
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(3, 3)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm(self.conv(x * self.scale)))
        x = F.relu(self.ln(self.fc1(x.flatten(1))))
        x = F.relu(self.fc2(x))
        x = torch.tanh(self.tied(x)) + self.frozen(x)
        return self.head(x)


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def global_batch(step: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(BATCH_PER_RANK * ranks, 1, 8, 8, generator=g)
    y = torch.randint(0, CLASSES, (BATCH_PER_RANK * ranks,), generator=g)
    return x, y


def local_batch(step: int, rank: int, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, ranks)
    part = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    return x[part], y[part]


OPTIMIZERS: Dict[str, Callable[[List[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}


def train_reference(optimizer: str, steps: int, ranks: int, passes: int = 1) -> Net:
    """Non-distributed training on the concatenated batches."""
    model = make_model()
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    for step in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            x, y = global_batch(step * passes + micro, ranks)
            F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def train_dear(optimizer: str, steps: int, policy: str, threshold_mb: float = 25,
               passes: int = 1, set_to_none: bool = False,
               between_steps: Optional[Callable[[Net, int], None]] = None,
               **options: Any) -> tuple[Net, dear.DistributedOptimizer]:
    """`options` go to dear.DistributedOptimizer as they are (fusion=..., ...)."""
    model = make_model()
    dear.broadcast_parameters(model)
    opt = dear.DistributedOptimizer(OPTIMIZERS[optimizer](list(model.parameters())), model,
                                    policy=policy, threshold_mb=threshold_mb,
                                    backward_passes_per_step=passes, **options)
    rank, ranks = dear.rank(), dear.size()
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        for micro in range(passes):
            x, y = local_batch(step * passes + micro, rank, ranks)
            F.cross_entropy(model(x), y).backward()
        opt.step()
        if between_steps is not None:
            between_steps(model, step)
    return model, opt


def max_difference(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def assert_same(name: str, got: nn.Module, want: nn.Module, atol: float = 1e-5) -> None:
    for (pname, p), q in zip(got.named_parameters(), want.parameters()):
        diff = float((p.detach() - q.detach()).abs().max())
        if diff > atol:
            raise AssertionError(f"rank {dear.rank()}: {name}: parameter {pname} differs from "
                                 f"local training by {diff:.3g} (tolerance {atol})")


def train_averaged(optimizer: str, steps: int, ranks: int) -> Net:
    """Non-distributed training that does what data parallelism promises, literally: each
    rank's gradient computed on its own slice, their average applied. Independent of
    train_reference's "average of per-rank means = mean of the whole batch" argument."""
    model = make_model()
    params = list(model.parameters())
    opt = OPTIMIZERS[optimizer](params)
    for step in range(steps):
        total: List[Optional[torch.Tensor]] = [None] * len(params)
        for r in range(ranks):
            model.zero_grad(set_to_none=True)
            x, y = local_batch(step, r, ranks)
            F.cross_entropy(model(x), y).backward()
            for i, p in enumerate(params):
                if p.grad is not None:
                    total[i] = p.grad.clone() if total[i] is None else total[i] + p.grad
        for p, g in zip(params, total):
            p.grad = None if g is None else g / ranks
        opt.step()
    return model


def train_ddp(optimizer: str, steps: int, group, bucket_cap_mb: float = 25) -> Net:
    """torch's DistributedDataParallel over `group` (a torch.distributed process group)."""
    model = make_model()
    # The never-used layer and the frozen one need find_unused_parameters.
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                    bucket_cap_mb=bucket_cap_mb,
                                                    find_unused_parameters=True)
    opt = OPTIMIZERS[optimizer](list(model.parameters()))
    rank, ranks = group.rank(), group.size()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x, y = local_batch(step, rank, ranks)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    return model
