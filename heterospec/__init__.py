"""heterospec: HeteroSpec speculative decoding (entropy-adaptive EAGLE-3 draft trees).

Importing the package loads the compiled extension (``heterospec._C``), which registers the
``torch.ops.heterospec.*`` operators, then ``heterospec.ops`` (typed wrappers + fake kernels).
"""

import torch  # noqa: F401  (loads libtorch / libc10, which _C links against)

try:
    from . import _C  # noqa: F401  (registers torch.ops.heterospec.*)
except ImportError as _exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "heterospec's compiled extension (heterospec._C) could not be imported "
        f"({_exc}). Build it against the installed torch with:\n"
        "    pip install --no-build-isolation -e .\n"
        "(or `python setup.py build_ext --inplace` after a first editable install)."
    ) from _exc

from . import ops  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Public API. Add engine / model exports below (only modules that exist).
# ---------------------------------------------------------------------------------------------
from .ops import (  # noqa: E402
    build_tree,
    compact_kv_,
    dense_tree_attention_mask,
    entropy_bin_policy,
    select_tree_nodes,
    topk_entropy,
    tree_attention_mask,
    verify_greedy,
    verify_sampling,
)

from .config import SamplingParams, SpecConfig  # noqa: E402
from .entropy import EntropyBins  # noqa: E402
from .models import Eagle3Draft, KVCache, TargetModel  # noqa: E402
from .engine import Engine, GenerationResult, GenerationStats, RoundRecord  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "RoundRecord",
    "SpecConfig",
    "SamplingParams",
    "EntropyBins",
    "TargetModel",
    "Eagle3Draft",
    "KVCache",
    "ops",
    *ops.OP_NAMES,  # the op wrappers imported above
]
