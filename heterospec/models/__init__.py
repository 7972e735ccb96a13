"""Target (our own Llama over a static KV cache) and EAGLE-3 draft models (docs/design.md, "Models")."""

from .draft import DraftConfig, DraftTreeState, Eagle3Draft, TrainOutput
from .kv_cache import KVCache
from .target import TargetConfig, TargetModel, default_aux_layers

__all__ = [
    "DraftConfig", "DraftTreeState", "Eagle3Draft", "KVCache", "TargetConfig", "TargetModel", "TrainOutput",
    "default_aux_layers",
]
