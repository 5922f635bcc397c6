"""PyTorch training throughput per synchronisation policy: dear's DeAR, WFBP and bucketed
policies (dear.DistributedOptimizer) against torch DDP over Gloo, in one job.

    dear-run -n 2 /usr/bin/python3 bench/torch_train_bench.py --model mlp --batch 2
    scripts/torch-train-bench.sh --netns 1gbit -n 2 -- --model mlp --batch 2   # shaped hosts

Needs the dear package on PYTHONPATH (<build>/python). Every policy trains its own copy of the
same model on the same synthetic data; the copies live for the whole run, so each round only
needs a short warm-up. Policies are interleaved: round r runs them in the given order when r is
even and in reverse when r is odd (A B C D, D C B A, ...), so that drift in the machine's load
falls on all of them alike. Each (round, policy) segment runs --warmup untimed steps, lines the
ranks up with a Gloo barrier, then times --steps steps on every rank; the slowest rank's time is
the segment's. samples/s = --batch x ranks x steps / that time. A policy's ratio to DDP is taken
within each round (same load), then the median over rounds is printed.

Timing is steady-state: under DeAR, step() returns with the all-gathers of the update still in
flight (the next forward pass consumes them), so a segment starts with the previous step's
all-gathers pending and ends with its own pending, one step's worth each; synchronize() runs
after the clock stops. The other policies finish their communication inside step().

Policies: ``dear``, ``wfbp``, ``bucket`` (dear.DistributedOptimizer), ``dear-auto`` (DeAR with
``fusion="auto"``: its threshold is tuned before the timed rounds), ``ddp-gloo`` (torch DDP on
a Gloo group, default bucket size), ``ddp-dear`` (torch DDP on dear's torch.distributed
backend) and ``local`` (no communication at all: each rank trains alone; the compute-only bound
under the same CPU sharing).

Models: ``mlp`` (--depth Linear layers of --width x --width with ReLU: many parameters and little
compute per sample, so communication dominates on slow links at small batches) and ``convnet``
(a small ResNet-style CNN on 32x32 images, 0.70 M parameters: compute dominates).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

try:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
except ImportError as e:
    print(f"{sys.executable} cannot import torch ({e}); use a Python with torch", flush=True)
    sys.exit(77)

import dear
import dear.backend

# The ResNet-style model of examples/compare_ddp.py (the compute-bound case).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from compare_ddp import ConvNet  # noqa: E402  (needs the path above)

POLICIES = ("local", "dear", "dear-auto", "wfbp", "bucket", "ddp-gloo", "ddp-dear")
BASELINE = "ddp-gloo"
Batch = Tuple[torch.Tensor, torch.Tensor]


def mlp(width: int, depth: int) -> nn.Module:
    """`depth` Linear layers width -> width with ReLU, then a 10-class head."""
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def workload(args: argparse.Namespace) -> Tuple[Callable[[], nn.Module],
                                                Callable[[int, int], Batch]]:
    """(model factory, batch(step, rank)) for --model; data are synthetic and cheap to make."""
    shape = (args.width,) if args.model == "mlp" else (3, 32, 32)

    def batch(step: int, rank: int) -> Batch:
        g = torch.Generator().manual_seed(step * 1000 + rank)
        return (torch.randn(args.batch, *shape, generator=g),
                torch.randint(0, 10, (args.batch,), generator=g))

    if args.model == "mlp":
        return (lambda: mlp(args.width, args.depth)), batch
    return ConvNet, batch


def gather_window(args: argparse.Namespace):
    """--gather-window as DistributedOptimizer takes it (0: every all-gather at once)."""
    return None if args.gather_window == 0 else args.gather_window


class Trainer:
    """One policy's model copy, optimizer and step."""

    def __init__(self, policy: str, args: argparse.Namespace, gloo) -> None:
        make_model, self.batch = workload(args)
        torch.manual_seed(0)
        self.policy = policy
        self.model = make_model()
        base = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)
        self.dear_opt = None
        if policy in ("dear", "wfbp", "bucket"):
            dear.broadcast_parameters(self.model)
            self.dear_opt = dear.DistributedOptimizer(base, self.model, policy=policy,
                                                      threshold_mb=args.threshold_mb,
                                                      gather_window=gather_window(args))
            self.net, self.opt = self.model, self.dear_opt
        elif policy == "dear-auto":
            dear.broadcast_parameters(self.model)
            self.dear_opt = dear.DistributedOptimizer(
                base, self.model, policy="dear", threshold_mb=args.threshold_mb, fusion="auto",
                tune_trials=args.tune_trials, tune_steps=args.tune_steps,
                gather_window=gather_window(args))
            self.net, self.opt = self.model, self.dear_opt
        elif policy in ("ddp-gloo", "ddp-dear"):
            group = gloo if policy == "ddp-gloo" else dist.group.WORLD
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, process_group=group, bucket_cap_mb=args.ddp_bucket_mb)
            self.opt = base
        else:  # local: no communication
            self.net, self.opt = self.model, base
        self.steps = 0
        self.loss = float("nan")

    def step(self) -> None:
        x, y = self.batch(self.steps, dear.rank())
        self.opt.zero_grad()
        loss = F.cross_entropy(self.net(x), y)
        loss.backward()
        self.opt.step()
        self.steps += 1
        self.loss = float(loss.detach())

    def settle(self) -> None:
        """Outside the clock: applies DeAR's deferred update."""
        if self.dear_opt is not None:
            self.dear_opt.synchronize()


def segment(trainer: Trainer, args: argparse.Namespace, warmup: int, gloo) -> float:
    """Seconds for --steps steps on the slowest rank."""
    for _ in range(warmup):
        trainer.step()
    dist.barrier(group=gloo)
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.step()
    elapsed = time.perf_counter() - start
    trainer.settle()
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=gloo)
    return float(slowest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "convnet"])
    parser.add_argument("--width", type=int, default=2048, help="mlp: layer width")
    parser.add_argument("--depth", type=int, default=4, help="mlp: width x width layers")
    parser.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    parser.add_argument("--policies", default="dear,wfbp,bucket,ddp-gloo",
                        help=f"comma-separated, of: {', '.join(POLICIES)}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per segment")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps before each segment (the first round: at least 2)")
    parser.add_argument("--threshold-mb", type=float, default=25,
                        help="dear: fusion threshold / bucket size (MiB)")
    parser.add_argument("--gather-window", type=int, default=2,
                        help="dear, dear-auto: all-gathers in flight during the forward pass "
                             "(1: the reference DeAR; 0: all of them from step() on)")
    parser.add_argument("--ddp-bucket-mb", type=float, default=25, help="DDP bucket_cap_mb")
    parser.add_argument("--tune-trials", type=int, default=8,
                        help="dear-auto: threshold trials (run before the timed rounds)")
    parser.add_argument("--tune-steps", type=int, default=3,
                        help="dear-auto: measured steps per trial")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--link", default="loopback", help="label of the link, for the table")
    parser.add_argument("--json", help="rank 0 writes the results here")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless every communicating policy ends at the same loss "
                             "(they train the same steps on the same data from the same start)")
    args = parser.parse_args()
    policies = args.policies.split(",")
    for p in policies:
        if p not in POLICIES:
            parser.error(f"unknown policy {p!r}; use {', '.join(POLICIES)}")
    if args.gather_window < 0:
        parser.error(f"--gather-window must be >= 0, got {args.gather_window}")

    torch.set_num_threads(args.threads)
    dear.backend.init_process_group()
    gloo = dist.new_group(backend="gloo")
    rank, ranks = dear.rank(), dear.size()
    trainers: Dict[str, Trainer] = {p: Trainer(p, args, gloo) for p in policies}
    model = trainers[policies[0]].model
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"# {args.model}: {params / 1e6:.2f} M parameters ({params * 4 / 2**20:.0f} MiB of "
              f"fp32 gradients), {ranks} ranks, batch {args.batch}/rank, link {args.link}, "
              f"{args.rounds} rounds x {args.steps} timed steps, {args.threads} thread(s)/rank, "
              f"DeAR all-gather window {gather_window(args) or 'all'}",
              flush=True)

    # dear-auto tunes its fusion threshold before the timed rounds (its trials are steps too).
    for p in policies:
        opt = trainers[p].dear_opt
        while opt is not None and opt.tuning:
            trainers[p].step()
        if opt is not None and opt.fusion == "auto" and rank == 0:
            trials = ", ".join(f"{t:.3g} MiB {ms:.1f} ms" for t, ms in opt.tuning_trials)
            print(f"# {p}: tuned to {opt.fusion_threshold_mb:.3g} MiB ({opt.num_groups} groups) "
                  f"after trials {trials}", flush=True)

    rates: Dict[str, List[float]] = {p: [] for p in policies}
    for r in range(args.rounds):
        order = policies if r % 2 == 0 else policies[::-1]
        for p in order:
            warmup = max(args.warmup, 2) if r == 0 else args.warmup
            seconds = segment(trainers[p], args, warmup, gloo)
            rates[p].append(args.batch * ranks * args.steps / seconds)
            if rank == 0:
                print(f"round {r} {p:<9} {seconds / args.steps * 1e3:9.1f} ms/step "
                      f"{rates[p][-1]:9.2f} samples/s", flush=True)

    rows = []
    for p in policies:
        row = {"policy": p, "ranks": ranks, "link": args.link, "model": args.model,
               "params": params, "batch": args.batch, "samples_per_s": rates[p],
               "median_samples_per_s": statistics.median(rates[p])}
        if BASELINE in rates:
            ratios = [a / b for a, b in zip(rates[p], rates[BASELINE])]
            row["ratio_to_ddp_gloo"] = ratios
            row["median_ratio"] = statistics.median(ratios)
        if trainers[p].dear_opt is not None:
            row["groups"] = trainers[p].dear_opt.num_groups
        loss = torch.tensor([trainers[p].loss], dtype=torch.float64)
        dist.all_reduce(loss, group=gloo)
        row["last_loss"] = float(loss) / ranks
        rows.append(row)
    failed = False
    if rank == 0:
        print(f"{'policy':<9} {'ranks':>5} {'link':<10} {'samples/s (median, min-max)':>28} "
              f"{'vs ddp-gloo (median, min-max)':>30} {'loss':>7}")
        for row in rows:
            s = row["samples_per_s"]
            text = f"{row['median_samples_per_s']:.2f} ({min(s):.2f}-{max(s):.2f})"
            ratio = "-"
            if "ratio_to_ddp_gloo" in row:
                q = row["ratio_to_ddp_gloo"]
                ratio = f"{row['median_ratio']:.2f} ({min(q):.2f}-{max(q):.2f})"
            print(f"{row['policy']:<9} {ranks:>5} {args.link:<10} {text:>28} {ratio:>30} "
                  f"{row['last_loss']:7.4f}")
        # Not local (it does not communicate) nor dear-auto (its tuning trials were extra steps).
        synced = [row["last_loss"] for row in rows if row["policy"] not in ("local", "dear-auto")]
        spread = max(synced) - min(synced) if synced else 0.0
        agree = spread <= 1e-4 * max(1.0, abs(synced[0])) if synced else True
        print(f"# last loss: communicating policies {'agree' if agree else 'DISAGREE'} "
              f"(spread {spread:.2e})", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        sys.stdout.flush()
        if args.check and not agree:
            failed = True
    dist.barrier(group=gloo)
    dist.destroy_process_group()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
