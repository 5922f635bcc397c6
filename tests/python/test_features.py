"""DistributedOptimizer details: gradient accumulation, evaluation under torch.no_grad() on one
rank only, synchronize() and zero_grad(set_to_none=True); then dear.Error from a mismatch."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import require_torch  # noqa: E402

require_torch()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dear  # noqa: E402
from training import (OPTIMIZERS, assert_same, global_batch, local_batch, make_model,  # noqa: E402
                      max_difference, train_dear, train_reference)


def accumulation() -> None:
    n = dear.size()
    want = train_reference("adam", 6, n, passes=3)
    for policy in ("dear", "wfbp", "bucket"):
        model = make_model()
        opt = dear.DistributedOptimizer(OPTIMIZERS["adam"](list(model.parameters())), model,
                                        policy=policy, threshold_mb=0.002,
                                        backward_passes_per_step=3)
        for step in range(6):
            opt.zero_grad()
            for micro in range(3):
                x, y = local_batch(step * 3 + micro, dear.rank(), n)
                F.cross_entropy(model(x), y).backward()
                # No communication before the third pass.
                launched = [g for g in opt._groups if g.handle is not None and
                            g.state.name == "REDUCING"]
                assert (micro == 2) or not launched, f"{policy}: communicated in pass {micro}"
            opt.step()
        opt.synchronize()
        assert_same(f"accumulation/{policy}", model, want)
    # A fourth pass when three were declared is an error, not silent double counting.
    model = make_model()
    opt = dear.DistributedOptimizer(OPTIMIZERS["sgd"](list(model.parameters())), model,
                                    policy="wfbp", backward_passes_per_step=1)
    x, y = local_batch(0, dear.rank(), n)
    F.cross_entropy(model(x), y).backward()
    try:
        F.cross_entropy(model(x), y).backward()
    except RuntimeError as e:
        assert "backward_passes_per_step" in str(e), str(e)
    else:
        raise AssertionError("a second backward pass without step() was accepted")
    opt.remove_hooks()


def evaluation_and_synchronize() -> None:
    n, rank = dear.size(), dear.rank()
    reference = make_model()
    ref_opt = OPTIMIZERS["sgd"](list(reference.parameters()))
    probe, _ = global_batch(999, n)

    def between(model: torch.nn.Module, step: int) -> None:
        ref_opt.zero_grad()
        x, y = global_batch(step, n)
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        if step % 3 == 1 and rank == 0:  # not after the last step (9)
            # Evaluation on one rank only: the forward pre-hooks complete the pending update,
            # and no hook may start anything the other ranks would not.
            model.eval()
            with torch.no_grad():
                got = model(probe)
                want = reference(probe)
            model.train()
            diff = float((got - want).abs().max())
            assert diff < 1e-5, f"evaluation after step {step} differs by {diff}"

    model, opt = train_dear("sgd", 10, "dear", threshold_mb=0.002, set_to_none=True,
                            between_steps=between)
    # DeAR defers the last update to the next forward pass: until synchronize(), the
    # parameters are one step behind.
    assert max_difference(model, reference) > 1e-4, "the last update was not deferred"
    opt.synchronize()
    assert_same("synchronize", model, reference)
    opt.synchronize()  # nothing pending: a no-op
    assert_same("synchronize twice", model, reference)
    # Training continues normally after a flush.
    x, y = local_batch(10, rank, n)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.synchronize()
    between(reference, 10)
    assert_same("step after synchronize", model, reference)
    # The reference loop of train_dear agrees too (sanity check of the helpers).
    assert_same("reference", reference, train_reference("sgd", 11, n))


def mismatch_error() -> None:
    # Ranks that disagree about an operation all fail with the library's message. This leaves
    # the communicator unusable, so it runs last.
    t = torch.ones(3 + dear.rank())
    try:
        dear.all_reduce(t)
    except dear.Error as e:
        assert e.code == "mismatch between ranks", e.code
        assert "all_reduce" in str(e) or "all_reduce" in e.op, str(e)
        print(f"rank {dear.rank()}: dear.Error as expected: {e}", flush=True)
    else:
        raise AssertionError("mismatched all_reduce did not raise dear.Error")


def main() -> None:
    torch.set_num_threads(1)
    dear.init()
    accumulation()
    evaluation_and_synchronize()
    mismatch_error()
    print(f"rank {dear.rank()}/{dear.size()}: features correct", flush=True)


if __name__ == "__main__":
    main()
