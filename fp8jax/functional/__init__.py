"""fp8jax's functional layers: each a ``jax.custom_vjp`` over the ops, built from one shared core.

- :func:`dense` (``dense.py``): an FP8 dense layer.
- :func:`dot_product_attention` (``attention.py``): attention with FP8 operands (``fp8_dpa``).
- :func:`context_parallel_attention` (``context_parallel.py``): attention over a sequence split
  along a mesh axis (all-gather or ring), with TE's batch reorder for causal load balancing
  (``load_balancing.py``).
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
from fp8jax.functional.context_parallel import CPStrategy, context_parallel_attention
from fp8jax.functional.dense import CHECKPOINT_NAMES, dense, dense_observed, save_fp8_operands
from fp8jax.functional.grouped_dense import grouped_dense, grouped_dense_observed, grouped_roles
from fp8jax.functional.layernorm import layernorm_dense, layernorm_dense_observed
from fp8jax.functional.load_balancing import (
    ReorderStrategy,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from fp8jax.functional.mlp import MLP_ROLES, layernorm_mlp, layernorm_mlp_observed
from fp8jax.functional.moe import MoEConfig, MoEOutput, moe, moe_roles

__all__ = [
    "ATTENTION_ROLES",
    "CHECKPOINT_NAMES",
    "MLP_ROLES",
    "CPStrategy",
    "MoEConfig",
    "MoEOutput",
    "ReorderStrategy",
    "context_parallel_attention",
    "dense",
    "dense_observed",
    "dot_product_attention",
    "dot_product_attention_observed",
    "grouped_dense",
    "grouped_dense_observed",
    "grouped_roles",
    "inverse_reorder_causal_load_balancing",
    "layernorm_dense",
    "layernorm_dense_observed",
    "layernorm_mlp",
    "layernorm_mlp_observed",
    "moe",
    "moe_roles",
    "reorder_causal_load_balancing",
    "save_fp8_operands",
]
