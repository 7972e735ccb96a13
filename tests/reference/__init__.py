"""Pure-PyTorch references of every heterospec op: simple, obviously-correct loops.

The CPU and CUDA kernels are both checked against these (tests/test_ops_*.py).
"""

from .entropy_ref import entropy_bin_policy_ref, topk_entropy_ref
from .glue_ref import rms_norm_ref, rope_kv_write_ref, rope_ref, tree_attention_ref
from .kv_ref import compact_kv_ref
from .linear_ref import (blocks_layout_ref, quantize_q4_1_ref, quantize_q8_0_ref, stream_linear_pack_ref,
                         stream_linear_ref)
from .tree_ref import build_tree_ref, dense_tree_attention_mask_ref, select_tree_nodes_ref, tree_attention_mask_ref
from .verify_ref import verify_greedy_ref, verify_sampling_ref

__all__ = [
    "topk_entropy_ref",
    "entropy_bin_policy_ref",
    "select_tree_nodes_ref",
    "build_tree_ref",
    "tree_attention_mask_ref",
    "dense_tree_attention_mask_ref",
    "verify_greedy_ref",
    "verify_sampling_ref",
    "compact_kv_ref",
    "stream_linear_pack_ref",
    "blocks_layout_ref",
    "quantize_q4_1_ref",
    "quantize_q8_0_ref",
    "stream_linear_ref",
    "rms_norm_ref",
    "rope_ref",
    "rope_kv_write_ref",
    "tree_attention_ref",
]
