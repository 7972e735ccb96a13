"""heterospec: HeteroSpec speculative decoding (entropy-adaptive EAGLE-3 draft trees).

Importing the package loads the compiled extension (``heterospec._C``, or the ops compiled on first
import; see ``heterospec._ext``), which registers the ``torch.ops.heterospec.*`` operators, then
``heterospec.ops`` (typed wrappers + fake kernels).
"""

import torch  # noqa: F401  (loads libtorch / libc10, which the ops library links against)

from ._ext import ensure_ops as _ensure_ops

# Registers torch.ops.heterospec.*: the extension built ahead of time (heterospec._C) or, after a plain
# `pip install .` (whose isolated build cannot see torch), the ops compiled against this torch on first
# import and cached (see heterospec/_ext.py).
_ensure_ops()

from . import ops  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Public API. Add engine / model exports below (only modules that exist).
# ---------------------------------------------------------------------------------------------
from .ops import (  # noqa: E402
    build_tree,
    compact_kv_,
    corpus_lookup,
    decoder_layer_,
    decoder_layers_,
    dense_tree_attention_mask,
    entropy_bin_policy,
    greedy_tokens,
    rms_norm,
    rope,
    rope_kv_write_,
    sample_tokens,
    select_tree_nodes,
    stream_linear,
    stream_linear_blocks,
    stream_linear_pack,
    stream_linear_pack_blocks,
    topk_entropy,
    tree_attention,
    tree_attention_mask,
    verify_greedy,
    verify_sampling,
)

from .config import SamplingParams, SpecConfig  # noqa: E402
from .entropy import EntropyBins  # noqa: E402
from .models import Eagle3Draft, KVCache, TargetModel  # noqa: E402
from .engine import Engine, GenerationResult, GenerationStats, RoundRecord  # noqa: E402
from .lookup import OutputHistory  # noqa: E402
from .datastore import CorpusIndex  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "RoundRecord",
    "OutputHistory",
    "CorpusIndex",
    "SpecConfig",
    "SamplingParams",
    "EntropyBins",
    "TargetModel",
    "Eagle3Draft",
    "KVCache",
    "ops",
    *ops.OP_NAMES,  # the op wrappers imported above
    "stream_linear_pack_blocks",
]
