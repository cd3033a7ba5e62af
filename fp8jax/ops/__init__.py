"""fp8jax ops: each a pure-jnp reference beside its XLA FFI kernel binding. No Flax here.

:func:`implementation` chooses, per op family, the kernel or XLA's compilation of the reference;
:func:`gemm_options` how the FP8 GEMMs run on a GPU (autotuning, the MLP's fused epilogues, the
size below which a layer stays in high precision).
"""

# The families, lowest first (each imports only those before it: tests/test_import_layers.py).
# Each re-exports its modules' ``__all__``, and so does this package: a name added to a
# module's ``__all__`` is public here with no other edit.
from fp8jax.ops import attention, base, block, casts, fused, gemms
from fp8jax.ops.attention import *
from fp8jax.ops.base import *
from fp8jax.ops.block import *
from fp8jax.ops.casts import *
from fp8jax.ops.fused import *
from fp8jax.ops.gemms import *

__all__ = sorted(
    [
        *base.__all__,
        *casts.__all__,
        *block.__all__,
        *fused.__all__,
        *gemms.__all__,
        *attention.__all__,
    ]
)
