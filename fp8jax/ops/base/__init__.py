"""The machinery every op is built on, lowest of the ops' families: the op definition
(:mod:`~fp8jax.ops.base.opdef`), the sharding of a custom call over a mesh
(:mod:`~fp8jax.ops.base.partition`), the kernel/XLA switch (:mod:`~fp8jax.ops.base.switch`) and
the argument checks the ops share (:mod:`~fp8jax.ops.base.checks`).

The families above it (casts < block < fused < gemms, tests/test_import_layers.py) import these
modules by name; what a module lists in ``__all__`` is also public in :mod:`fp8jax.ops`.
"""

from fp8jax.ops.base import checks as _checks
from fp8jax.ops.base import opdef as _opdef
from fp8jax.ops.base import partition as _partition
from fp8jax.ops.base import switch as _switch
from fp8jax.ops.base.checks import *
from fp8jax.ops.base.opdef import *
from fp8jax.ops.base.partition import *
from fp8jax.ops.base.switch import *

__all__ = [*_checks.__all__, *_opdef.__all__, *_partition.__all__, *_switch.__all__]
