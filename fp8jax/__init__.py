"""fp8jax: FP8 training and inference of Transformers in JAX and Flax.

Importing fp8jax needs no GPU, driver or cuBLAS: the compiled kernels are registered with XLA on
first use, for CPU always and for CUDA when JAX has a CUDA backend.
"""

from fp8jax import ops
from fp8jax._support import fp8_support
from fp8jax.autocast import autocast, fp8_autocast, get_recipe, is_fp8_enabled
from fp8jax.recipe import DelayedScaling, Float8CurrentScaling, Format, Recipe

__version__ = "0.1.0"

__all__ = [
    "DelayedScaling",
    "Float8CurrentScaling",
    "Format",
    "Recipe",
    "autocast",
    "fp8_autocast",
    "fp8_support",
    "get_recipe",
    "is_fp8_enabled",
    "ops",
]
