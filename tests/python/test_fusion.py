"""dear.DistributedOptimizer's fusion modes: "nearby" groups and "auto" (the threshold tuned
while training) train to the same parameters as local training (fp32, atol 1e-5), and so do
the all-gather windows of the forward pass other than the default; the tuner's trials are the
ones asked for, every rank chooses the same threshold, and bad options are refused naming the
argument."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import require_torch  # noqa: E402

require_torch()

import torch  # noqa: E402

import dear  # noqa: E402
from training import assert_same, make_model, train_dear, train_reference  # noqa: E402

STEPS = 20


def same_on_every_rank(value: float) -> bool:
    t = torch.tensor([value, -value], dtype=torch.float64)
    dear.all_reduce(t, op="max")
    return float(t[0]) == value and float(-t[1]) == value


def check_errors() -> None:
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs, words in (({"fusion": "bogus"}, "fusion"),
                          ({"policy": "wfbp", "fusion": "nearby"}, "fusion"),
                          ({"fusion": "nearby", "layers_per_group": 0}, "layers_per_group"),
                          ({"fusion": "auto", "tune_steps": 0}, "tune_steps"),
                          ({"fusion": "auto", "tune_range_mb": (4, 2)}, "tune_range_mb"),
                          ({"gather_window": 0}, "gather_window")):
        try:
            dear.DistributedOptimizer(sgd, model, **kwargs)
        except ValueError as e:
            assert words in str(e), (kwargs, str(e))
        else:
            raise AssertionError(f"{kwargs} was accepted")


def main() -> None:
    torch.set_num_threads(1)
    dear.init()
    n = dear.size()
    check_errors()
    for optimizer in ("sgd", "adam"):
        want = train_reference(optimizer, STEPS, n)
        for k in (1, 2, 3):
            model, opt = train_dear(optimizer, STEPS, "dear", fusion="nearby", layers_per_group=k)
            opt.synchronize()
            assert_same(f"nearby({k})/{optimizer}", model, want)
            if dear.rank() == 0:
                print(f"nearby({k})/{optimizer}: {opt.num_groups} groups, equal to local "
                      "training", flush=True)
        # All-gathers in flight during the forward pass: the reference's one, and all of them.
        # Small groups (nearby, 1 layer each), so that several are in flight at once.
        for window in (1, None):
            model, opt = train_dear(optimizer, STEPS, "dear", fusion="nearby", layers_per_group=1,
                                    gather_window=window)
            opt.synchronize()
            assert_same(f"gather_window={window}/{optimizer}", model, want)
            if dear.rank() == 0:
                print(f"gather_window={window}/{optimizer}: {opt.num_groups} groups, equal to "
                      "local training", flush=True)
        # Thresholds from 1 KiB to 64 KiB: the small model's groups differ between trials.
        # 4 trials of a warm-up step and 2 measured steps: tuned after 12 of the 20 steps.
        model, opt = train_dear(optimizer, STEPS, "dear", fusion="auto", tune_trials=4,
                                tune_steps=2, tune_range_mb=(1 / 1024, 64 / 1024))
        opt.synchronize()
        assert_same(f"auto/{optimizer}", model, want)
        trials = opt.tuning_trials
        assert not opt.tuning, "still tuning after 20 steps"
        assert len(trials) == 4, trials
        for threshold, ms in trials:
            assert 1 / 1024 <= threshold <= 64 / 1024 and ms > 0, trials
            assert same_on_every_rank(threshold) and same_on_every_rank(ms), trials
        assert len({t for t, _ in trials}) >= 3, f"the trials did not spread out: {trials}"
        # The threshold kept: the lowest mean over its trials (a repeated one is averaged),
        # the first measured of equal ones.
        means: dict = {}
        for threshold, ms in trials:
            means.setdefault(threshold, []).append(ms)
        best = min(means, key=lambda t: sum(means[t]) / len(means[t]))
        assert opt.fusion_threshold_mb == best, (opt.fusion_threshold_mb, trials)
        if dear.rank() == 0:
            print(f"auto/{optimizer}: trials {[(round(t * 1024, 1), round(ms, 2)) for t, ms in trials]}"
                  f" (KiB, ms); chose {best * 1024:.1f} KiB, {opt.num_groups} groups; equal to "
                  "local training", flush=True)
    print(f"rank {dear.rank()}/{n}: fusion modes agree", flush=True)


if __name__ == "__main__":
    main()
