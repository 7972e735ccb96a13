"""Device-aware budgets: verification latency vs tree tokens on this device.

    python bench/verify_curve.py --sizes 1 2 4 8 16 32 64 --context 256

Same as ``heterospec verify-curve``. Writes ``bench/out/verify_curve.json`` and ``.png``.
"""

import sys

from heterospec.cli import main

if __name__ == "__main__":
    sys.exit(main(["verify-curve"] + sys.argv[1:]))
