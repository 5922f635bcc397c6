"""dear.DistributedOptimizer against torch's DistributedDataParallel over Gloo: after K steps
on the same model, data and seeds, every policy's parameters equal DDP's (fp32, atol 1e-5),
with SGD momentum and with Adam."""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import require_torch  # noqa: E402

require_torch()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import dear  # noqa: E402
import dear.backend  # noqa: E402
from training import assert_same, make_model, train_dear, train_ddp  # noqa: E402

STEPS = 10
CONFIGS = [("dear", 25), ("dear", 0.002), ("wfbp", 25), ("bucket", 0.002)]


def main() -> None:
    torch.set_num_threads(1)
    start = time.monotonic()
    dear.backend.init_process_group()  # for its store; the comparison runs over Gloo
    gloo = dist.new_group(backend="gloo")
    for optimizer in ("sgd", "adam"):
        want = train_ddp(optimizer, STEPS, gloo)
        assert not torch.equal(want.fc1.weight, make_model().fc1.weight), "DDP did not train"
        for policy, threshold in CONFIGS:
            name = f"DistributedOptimizer {policy}(threshold {threshold} MB)/{optimizer}"
            model, opt = train_dear(optimizer, STEPS, policy, threshold)
            opt.synchronize()
            assert_same(f"{name} vs DDP/Gloo", model, want)
            if dear.rank() == 0:
                print(f"{name}: equal to DDP/Gloo", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {dear.rank()}/{dear.size()}: every policy agrees with DDP/Gloo "
          f"({time.monotonic() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
