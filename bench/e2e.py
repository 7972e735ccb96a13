"""End-to-end benchmark: autoregressive vs eagle3 vs heterospec, interleaved in one run.

    python bench/e2e.py --sets mtbench humaneval gsm alpaca cnndm --n 8 --max-new-tokens 128

Same as ``heterospec bench`` (see ``heterospec bench --help`` for every option). Writes
``bench/out/e2e.json``, ``e2e.md``, ``speedup.png`` and ``entropy_bins.png``; copy the table into
``bench/RESULTS.md`` together with the machine line it prints.
"""

import sys

from heterospec.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench"] + sys.argv[1:]))
