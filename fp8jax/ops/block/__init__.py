"""Block-scaled FP8 casts (Float8BlockScaling's 1 x 128 and 128 x 128 blocks, MXFP8's 1 x 32),
the ragged casts of a mixture of experts, and the row-wise casts and GEMM reference
(Float8RowwiseScaling: a row is one block as long as the row). Built on :mod:`fp8jax.ops.base` and
:mod:`fp8jax.ops.casts`.

Each module's ``__all__`` is re-exported here and by :mod:`fp8jax.ops`.
"""

from fp8jax.ops.block import block_scaling as _block_scaling
from fp8jax.ops.block import grouped_scaling as _grouped_scaling
from fp8jax.ops.block import rowwise as _rowwise
from fp8jax.ops.block.block_scaling import *
from fp8jax.ops.block.grouped_scaling import *
from fp8jax.ops.block.rowwise import *

__all__ = [*_block_scaling.__all__, *_grouped_scaling.__all__, *_rowwise.__all__]
