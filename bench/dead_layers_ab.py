"""The dead-layer stop (``Engine.stop_dead_layers``) on and off, interleaved in one process:
``bench/switch_ab.py --switch dead-layers`` (its docstring says what is measured).

    python bench/dead_layers_ab.py [--sets ...] [--n 4] [--max-new-tokens 128] [--dtype float32]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from switch_ab import main  # noqa: E402

if __name__ == "__main__":
    main(switch="dead-layers")
