"""The FP8 GEMMs, top of the ops' families: the per-tensor-scaled GEMM and its sharding rule, its
options, its GELU epilogues, the GEMM on a kernel with a fixed group dim (gated MLP, fused QKV),
the block-scaled and the row-wise scaled GEMMs and the ragged grouped GEMM of a mixture of experts.

Each module's ``__all__`` is re-exported here and by :mod:`fp8jax.ops`. Several modules are named
after their main function (``gemm``, ``grouped_gemm``, ``gemm_options``): this package's
attribute of that name is the function, so import such a module by its full path
(``from fp8jax.ops.gemms.gemm import ...``).
"""

from fp8jax.ops.gemms import _gemm_partition
from fp8jax.ops.gemms import blockwise as _blockwise
from fp8jax.ops.gemms import fixed_groups as _fixed_groups
from fp8jax.ops.gemms import gemm as _gemm
from fp8jax.ops.gemms import gemm_epilogue as _gemm_epilogue
from fp8jax.ops.gemms import gemm_options as _gemm_options
from fp8jax.ops.gemms import grouped_gemm as _grouped_gemm
from fp8jax.ops.gemms import rowwise_gemm as _rowwise_gemm
from fp8jax.ops.gemms._gemm_partition import *
from fp8jax.ops.gemms.blockwise import *
from fp8jax.ops.gemms.fixed_groups import *
from fp8jax.ops.gemms.gemm import *
from fp8jax.ops.gemms.gemm_epilogue import *
from fp8jax.ops.gemms.gemm_options import *
from fp8jax.ops.gemms.grouped_gemm import *
from fp8jax.ops.gemms.rowwise_gemm import *

__all__ = [
    *_gemm.__all__,
    *_gemm_partition.__all__,
    *_gemm_options.__all__,
    *_gemm_epilogue.__all__,
    *_fixed_groups.__all__,
    *_blockwise.__all__,
    *_rowwise_gemm.__all__,
    *_grouped_gemm.__all__,
]
