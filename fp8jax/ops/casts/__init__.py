"""Per-tensor FP8 casts: ``quantize``/``dequantize``, ``cast_transpose`` (with the bias
gradient) and the delayed-scaling state update. Built on :mod:`fp8jax.ops.base` only.

Each module's ``__all__`` is re-exported here and by :mod:`fp8jax.ops`.
"""

from fp8jax.ops.casts import cast_transpose as _cast_transpose
from fp8jax.ops.casts import quantize as _quantize
from fp8jax.ops.casts import scaling as _scaling
from fp8jax.ops.casts.cast_transpose import *
from fp8jax.ops.casts.quantize import *
from fp8jax.ops.casts.scaling import *

__all__ = [*_quantize.__all__, *_cast_transpose.__all__, *_scaling.__all__]
