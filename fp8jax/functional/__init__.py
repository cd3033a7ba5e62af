"""fp8jax's functional layers: each a ``jax.custom_vjp`` over the ops, built from one shared core.

- :func:`dense` (``dense.py``): an FP8 dense layer.
- :func:`dot_product_attention` (``attention.py``): attention with FP8 operands (``fp8_dpa``).
- :func:`layernorm_dense` (``layernorm.py``): a norm fused into an FP8 dense layer.
- :func:`layernorm_mlp` (``mlp.py``): a whole Transformer MLP block.
- :func:`grouped_dense` (``grouped_dense.py``): a mixture of experts' ragged expert GEMM.
- :func:`moe` (``moe.py``): a mixture-of-experts block's routed experts.

Each file has the name its layer has in every tier (the spec in :mod:`fp8jax.layers`, the
Linen modules in :mod:`fp8jax.flax`, the NNX modules in :mod:`fp8jax.nnx`). The shared core
(setup, casts, GEMM forward and backward, custom_vjp wiring) is ``_core.py``; the norm's FP8
input path ``_norm.py``; expert parallelism's exchange ``_exchange.py``. The public names are
re-exported from :mod:`fp8jax` (``fp8jax.dense``, ...), where users find them.
"""

from fp8jax.functional.attention import (
    ATTENTION_ROLES,
    dot_product_attention,
    dot_product_attention_observed,
)
from fp8jax.functional.dense import CHECKPOINT_NAMES, dense, dense_observed, save_fp8_operands
from fp8jax.functional.grouped_dense import grouped_dense, grouped_dense_observed, grouped_roles
from fp8jax.functional.layernorm import layernorm_dense, layernorm_dense_observed
from fp8jax.functional.mlp import MLP_ROLES, layernorm_mlp, layernorm_mlp_observed
from fp8jax.functional.moe import MoEConfig, MoEOutput, moe, moe_roles

__all__ = [
    "ATTENTION_ROLES",
    "CHECKPOINT_NAMES",
    "MLP_ROLES",
    "MoEConfig",
    "MoEOutput",
    "dense",
    "dense_observed",
    "dot_product_attention",
    "dot_product_attention_observed",
    "grouped_dense",
    "grouped_dense_observed",
    "grouped_roles",
    "layernorm_dense",
    "layernorm_dense_observed",
    "layernorm_mlp",
    "layernorm_mlp_observed",
    "moe",
    "moe_roles",
    "save_fp8_operands",
]
