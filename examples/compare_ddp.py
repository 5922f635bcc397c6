"""Throughput of one model trained three ways in the same job: torch DDP over Gloo, torch DDP
over dear's torch.distributed backend, and dear.DistributedOptimizer (DeAR policy).

    dear-run -n 2 /usr/bin/python3 examples/compare_ddp.py --model resnet18 --steps 20 --batch 16

Needs the dear package on PYTHONPATH (<build>/python). Models: ``resnet18`` (torchvision's,
10 classes, 3x32x32 inputs; needs torchvision, else use ``convnet``), ``convnet`` (a small
ResNet-style net defined here), ``bert`` (a small Transformer encoder from torch.nn with a
masked-token head, AdamW). Data are synthetic and the same for every mode. Each mode runs
``--warmup`` untimed steps, then ``--steps`` timed ones; the table reports the slowest rank's
mean iteration time and the samples/s that gives (``--batch`` samples per rank per step).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Dict, Tuple

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
except ImportError as e:  # 77: "skipped" to CTest, which runs a short version of this script
    print(f"{sys.executable} cannot import torch ({e}); use a Python with torch", flush=True)
    sys.exit(77)

import dear
import dear.backend

Batch = Tuple[torch.Tensor, torch.Tensor]


class Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm and a shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ConvNet(nn.Module):
    """ResNet-style, small enough for CPUs: 3 stages of 2 blocks (32, 64, 128 channels)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32),
                                  nn.ReLU())
        layers, cin = [], 32
        for cout, stride in ((32, 1), (64, 2), (128, 2)):
            layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class TinyBert(nn.Module):
    """BERT-style encoder: token + position embeddings, post-norm Transformer layers, and a
    masked-token head tied to the token embedding."""

    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(seq, dim)
        self.norm = nn.LayerNorm(dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab)
        self.head.weight = self.tokens.weight  # shared, as in BERT
        nn.init.normal_(self.tokens.weight, std=0.02)  # BERT's initialisation
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.norm(self.tokens(ids) + self.positions(pos))
        return self.head(self.encoder(x))


def build(args: argparse.Namespace) -> Tuple[Callable[[], nn.Module],
                                             Callable[[int, int], Batch],
                                             Callable[[nn.Module], torch.optim.Optimizer]]:
    """(model factory, batch(step, rank), optimizer factory) for --model."""
    if args.model == "bert":
        vocab, seq = 4096, args.seq

        def bert_batch(step: int, rank: int) -> Batch:
            g = torch.Generator().manual_seed(step * 1000 + rank)
            ids = torch.randint(0, vocab, (args.batch, seq), generator=g)
            return ids, ids.roll(1, 1)  # predict the previous token: learnable, cheap

        return (lambda: TinyBert(vocab, seq, dim=256, layers=4, heads=4), bert_batch,
                lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4))

    def image_batch(step: int, rank: int) -> Batch:
        g = torch.Generator().manual_seed(step * 1000 + rank)
        return (torch.randn(args.batch, 3, 32, 32, generator=g),
                torch.randint(0, 10, (args.batch,), generator=g))

    if args.model == "resnet18":
        import torchvision  # Debian: python3-torchvision

        def factory() -> nn.Module:
            return torchvision.models.resnet18(num_classes=10)
    else:
        factory = ConvNet
    return (factory, image_batch,
            lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9))


def loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def run(mode: str, args: argparse.Namespace, gloo) -> Tuple[float, float]:
    """Trains with `mode`; returns (mean seconds per timed step on the slowest rank, last
    loss averaged over ranks)."""
    make_model, batch, make_opt = build(args)
    torch.manual_seed(0)
    model = make_model()
    rank = dear.rank()
    if mode == "dear":
        dear.broadcast_parameters(model)
        opt = dear.DistributedOptimizer(make_opt(model), model, policy="dear",
                                        threshold_mb=args.threshold_mb)
        net = model
    else:
        group = gloo if mode == "ddp-gloo" else dist.group.WORLD
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        opt = make_opt(model)
    loss = torch.zeros(())
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dear.barrier()
            start = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(net, batch(step, rank))
        loss.backward()
        opt.step()
    if mode == "dear":
        opt.synchronize()  # the last update is deferred under DeAR: part of the work
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dear.all_reduce(elapsed, op="max")
    last = loss.detach().reshape(1).double()
    dear.all_reduce(last, op="avg")
    return float(elapsed) / args.steps, float(last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="convnet", choices=["resnet18", "convnet", "bert"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per mode")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--seq", type=int, default=64, help="bert: tokens per sample")
    parser.add_argument("--threshold-mb", type=float, default=25, help="dear: fusion threshold")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--modes", default="ddp-gloo,ddp-dear,dear")
    args = parser.parse_args()
    modes = args.modes.split(",")
    for m in modes:
        if m not in ("ddp-gloo", "ddp-dear", "dear"):
            parser.error(f"unknown mode {m!r}")

    torch.set_num_threads(args.threads)
    dear.backend.init_process_group()
    gloo = dist.new_group(backend="gloo") if "ddp-gloo" in modes else None
    ranks = dear.size()
    params = sum(p.numel() for p in build(args)[0]().parameters())
    results: Dict[str, Tuple[float, float]] = {m: run(m, args, gloo) for m in modes}
    if dear.rank() == 0:
        print(f"{args.model}: {params / 1e6:.2f} M parameters, {ranks} ranks, batch {args.batch}"
              f"/rank, {args.steps} timed steps after {args.warmup} warm-up, "
              f"{args.threads} thread(s)/rank")
        base = results.get("ddp-gloo", (None,))[0]
        print(f"{'mode':<10} {'iter (ms)':>10} {'samples/s':>10} {'vs gloo':>8} {'loss':>8}")
        for m, (t, loss) in results.items():
            rel = f"{base / t:7.2f}x" if base else "      -"
            print(f"{m:<10} {t * 1e3:10.1f} {args.batch * ranks / t:10.1f} {rel:>8} "
                  f"{loss:8.4f}")
        sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
