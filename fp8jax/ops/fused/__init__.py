"""The ops a layer runs around its GEMMs, each fused with its FP8 cast where that saves a pass:
LayerNorm/RMSNorm (and their ``custom_vjp`` forms), the MLP's activations, and the block-scaled
fused casts. Built on the families below it (base, casts, block).

Each module's ``__all__`` is re-exported here and by :mod:`fp8jax.ops`.
"""

from fp8jax.ops.fused import activation as _activation
from fp8jax.ops.fused import block_fused as _block_fused
from fp8jax.ops.fused import norm as _norm
from fp8jax.ops.fused import norm_autodiff as _norm_autodiff
from fp8jax.ops.fused.activation import *
from fp8jax.ops.fused.block_fused import *
from fp8jax.ops.fused.norm import *
from fp8jax.ops.fused.norm_autodiff import *

__all__ = [*_norm.__all__, *_norm_autodiff.__all__, *_activation.__all__, *_block_fused.__all__]
