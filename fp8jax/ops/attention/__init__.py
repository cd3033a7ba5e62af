"""FP8 attention, the ops' last family: scaled dot-product attention on FP8 codes, cuDNN's fused
FP8 flash attention through XLA on a GPU and its ``jnp`` reference everywhere else.

Each module's ``__all__`` is re-exported here and by :mod:`fp8jax.ops`.
"""

from fp8jax.ops.attention import fp8_attention as _fp8_attention
from fp8jax.ops.attention.fp8_attention import *

__all__ = [*_fp8_attention.__all__]
