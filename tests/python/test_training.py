"""20 training steps with every policy and two optimizers: after synchronize() the parameters
equal those of local training on the concatenated batches (fp32, atol 1e-5)."""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import require_torch  # noqa: E402

require_torch()

import torch  # noqa: E402

import dear  # noqa: E402
from training import assert_same, make_model, train_dear, train_reference  # noqa: E402

STEPS = 20

# (policy, threshold_mb): dear with one fused group and with one group per layer or so;
# bucket with buckets small enough that there are several.
CONFIGS = [("dear", 25), ("dear", 0.002), ("wfbp", 25), ("bucket", 0.002)]


def main() -> None:
    torch.set_num_threads(1)
    dear.init()
    n = dear.size()
    start = time.monotonic()
    for optimizer in ("sgd", "adam"):
        want = train_reference(optimizer, STEPS, n)
        untouched = make_model()
        for policy, threshold in CONFIGS:
            name = f"{policy}(threshold {threshold} MB)/{optimizer}"
            model, opt = train_dear(optimizer, STEPS, policy, threshold)
            opt.synchronize()
            assert_same(name, model, want)
            # The never-used layer had no gradient anywhere: the optimizer must skip it.
            assert torch.equal(model.unused.weight, untouched.unused.weight), name
            assert model.tied.weight is model.fc2.weight
            if dear.rank() == 0:
                print(f"{name}: {opt.num_groups} groups, equal to local training", flush=True)
    print(f"rank {dear.rank()}/{n}: all policies agree ({time.monotonic() - start:.1f} s)",
          flush=True)


if __name__ == "__main__":
    main()
