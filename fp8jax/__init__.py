"""fp8jax: FP8 training and inference of Transformers in JAX and Flax.

Importing fp8jax needs no GPU, driver or cuBLAS: the compiled kernels are registered with XLA on
first use, for CPU always and for CUDA when JAX has a CUDA backend.
"""

from fp8jax import ops
from fp8jax._support import fp8_support
from fp8jax.autocast import autocast, fp8_autocast, get_recipe, is_fp8_enabled
from fp8jax.dense import CHECKPOINT_NAMES, dense
from fp8jax.ops.quantize import cast_to_representable
from fp8jax.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe
from fp8jax.state import (
    Fp8Meta,
    init_fp8_meta,
    merge_observations,
    update_fp8_meta,
    update_fp8_metas,
)

__version__ = "0.1.0"

__all__ = [
    "CHECKPOINT_NAMES",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Format",
    "Fp8Meta",
    "Recipe",
    "autocast",
    "cast_to_representable",
    "dense",
    "fp8_autocast",
    "fp8_support",
    "get_recipe",
    "init_fp8_meta",
    "is_fp8_enabled",
    "merge_observations",
    "ops",
    "update_fp8_meta",
    "update_fp8_metas",
]
