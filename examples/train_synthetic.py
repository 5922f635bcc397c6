"""Data-parallel training of a small CNN on synthetic MNIST-like digits with dear.

    dear-run -n 4 /usr/bin/python3 examples/train_synthetic.py [--policy dear|wfbp|bucket]

Needs the dear package on PYTHONPATH (<build>/python). Each class is a fixed random 28x28
"glyph"; samples are noisy, shifted copies of their class's glyph, so the task is learnable and
accuracy climbs within a few hundred steps. Every rank draws a different shard of each global
batch from the same seeded stream, as a DistributedSampler would.
"""
from __future__ import annotations

import argparse
import sys
import time

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as e:  # 77: "skipped" to CTest, which runs a short version of this script
    print(f"{sys.executable} cannot import torch ({e}); use a Python with torch", flush=True)
    sys.exit(77)

import dear

CLASSES = 10


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.norm = nn.LayerNorm(128)
        self.fc2 = nn.Linear(128, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.norm(self.fc1(x.flatten(1))))
        return self.fc2(x)


class SyntheticDigits:
    """Noisy, shifted class glyphs; batch `step` is the same on every rank before sharding."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.glyphs = (torch.rand(CLASSES, 1, 28, 28, generator=g) > 0.7).float()
        self.seed = seed

    def batch(self, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        y = torch.randint(0, CLASSES, (size,), generator=g)
        x = self.glyphs[y]
        shift = torch.randint(-2, 3, (2,), generator=g).tolist()
        x = torch.roll(x, shifts=shift, dims=(2, 3))
        x = x + 0.5 * torch.randn(x.shape, generator=g)
        return (x - 0.3) / 0.6, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="dear", choices=["dear", "wfbp", "bucket"])
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--threshold-mb", type=float, default=25)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args()

    torch.set_num_threads(1)  # several ranks share the machine's cores
    dear.init()
    rank, ranks = dear.rank(), dear.size()
    torch.manual_seed(1234 + rank)  # different on purpose: broadcast_parameters aligns them
    model = SmallCNN()
    dear.broadcast_parameters(model, root=0)
    if args.optimizer == "sgd":
        base = torch.optim.SGD(model.parameters(), lr=args.lr or 0.05, momentum=0.9)
    else:
        base = torch.optim.Adam(model.parameters(), lr=args.lr or 1e-3)
    opt = dear.DistributedOptimizer(base, model, policy=args.policy,
                                    threshold_mb=args.threshold_mb)
    data = SyntheticDigits()
    shard = slice(rank * args.batch_size, (rank + 1) * args.batch_size)

    start = time.perf_counter()
    for step in range(args.steps):
        x, y = data.batch(step, args.batch_size * ranks)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[shard]), y[shard])
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % args.log_every == 0:
            elapsed = time.perf_counter() - start
            print(f"step {step + 1:4d}  loss {loss.item():.4f}  "
                  f"{(step + 1) * args.batch_size * ranks / elapsed:8.1f} samples/s", flush=True)
    opt.synchronize()  # the last update is deferred under DeAR
    elapsed = time.perf_counter() - start

    # Held-out accuracy, each rank on its own shard, summed over ranks.
    model.eval()
    correct = torch.zeros(2, dtype=torch.int64)
    with torch.no_grad():
        for i in range(4):
            x, y = data.batch(10_000_000 + i, args.batch_size * ranks)
            pred = model(x[shard]).argmax(1)
            correct += torch.tensor([int((pred == y[shard]).sum()), len(pred)])
    dear.all_reduce(correct)
    if rank == 0:
        print(f"{ranks} ranks, policy {args.policy}, {opt.num_groups} groups: "
              f"{args.steps * args.batch_size * ranks / elapsed:.1f} samples/s, "
              f"held-out accuracy {int(correct[0]) / int(correct[1]):.3f}", flush=True)


if __name__ == "__main__":
    main()
