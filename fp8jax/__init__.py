"""fp8jax: FP8 training and inference of Transformers in JAX and Flax.

Importing fp8jax needs no GPU, driver or cuBLAS: the compiled kernels are registered with XLA on
first use, for CPU always and for CUDA when JAX has a CUDA backend.

``fp8jax.flax`` (the Flax modules and the train step), ``fp8jax.nnx`` and ``fp8jax.optim`` (optax
transforms with FP8 optimizer state) are imported on first access, so that ``import fp8jax``
neither needs Flax or optax nor pays for importing them; ``import fp8jax.flax`` works too.
"""

import importlib as _importlib

from fp8jax import ops, sharding
from fp8jax._support import fp8_support
from fp8jax.autocast import autocast, fp8_autocast, get_recipe, is_fp8_enabled
from fp8jax.functional.attention import ATTENTION_ROLES, dot_product_attention
from fp8jax.functional.context_parallel import CPStrategy, context_parallel_attention
from fp8jax.functional.dense import CHECKPOINT_NAMES, dense, save_fp8_operands
from fp8jax.functional.grouped_dense import grouped_dense, grouped_roles
from fp8jax.functional.layernorm import layernorm_dense
from fp8jax.functional.load_balancing import (
    ReorderStrategy,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)
from fp8jax.functional.mlp import MLP_ROLES, layernorm_mlp
from fp8jax.functional.moe import moe, moe_roles
from fp8jax.ops.casts.quantize import cast_to_representable
from fp8jax.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    Format,
    MXFP8BlockScaling,
    Recipe,
)
from fp8jax.sharding import MeshResource
from fp8jax.state import (
    Fp8Meta,
    gemm_roles,
    init_fp8_meta,
    merge_observations,
    update_fp8_meta,
    update_fp8_metas,
)

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_ROLES",
    "CHECKPOINT_NAMES",
    "MLP_ROLES",
    "CPStrategy",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8RowwiseScaling",
    "Format",
    "Fp8Meta",
    "MXFP8BlockScaling",
    "MeshResource",
    "Recipe",
    "ReorderStrategy",
    "autocast",
    "cast_to_representable",
    "context_parallel_attention",
    "dense",
    "dot_product_attention",
    "fp8_autocast",
    "fp8_support",
    "gemm_roles",
    "get_recipe",
    "grouped_dense",
    "grouped_roles",
    "init_fp8_meta",
    "inverse_reorder_causal_load_balancing",
    "is_fp8_enabled",
    "layernorm_dense",
    "layernorm_mlp",
    "merge_observations",
    "moe",
    "moe_roles",
    "ops",
    "reorder_causal_load_balancing",
    "save_fp8_operands",
    "sharding",
    "update_fp8_meta",
    "update_fp8_metas",
]

# Submodules imported on first attribute access (PEP 562), with the optional packages each needs
# (the "flax" extra, for all three). Not in __all__: a star import would then import Flax.
_LAZY_SUBMODULES = {"flax": ("flax", "optax"), "nnx": ("flax", "optax"), "optim": ("optax",)}


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        try:
            # Importing the submodule also binds it as an attribute of this package, so this
            # hook runs once per name.
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            missing = (e.name or "").split(".")[0]
            if missing not in _LAZY_SUBMODULES[name]:
                raise
            raise ModuleNotFoundError(
                f"fp8jax.{name} needs the {missing!r} package: pip install 'fp8jax[flax]'",
                name=e.name,
            ) from e
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES})
