"""Shared by the Python tests: skipping without torch, and the dear package import."""
from __future__ import annotations

import sys

SKIP = 77  # CTest's SKIP_RETURN_CODE for these tests


def require_torch() -> None:
    """Exits with SKIP, saying why, when this interpreter has no torch."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        print(f"SKIP: {sys.executable} cannot import torch ({e}); set DEAR_TORCH_PYTHON",
              flush=True)
        sys.exit(SKIP)
