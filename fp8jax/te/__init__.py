"""TransformerEngine's JAX API at its module paths, as far as fp8jax implements it.

``fp8jax.te.X`` mirrors ``transformer_engine.X``: :mod:`fp8jax.te.common.recipe`,
:mod:`fp8jax.te.jax` (``dense``, ``layernorm_dense``, ``layernorm_mlp``, ``quantize``,
``cpp_extensions``, ``sharding``, ``attention``, ``flax``), each a thin adapter over fp8jax's
own functions and modules. Names fp8jax does not implement exist and raise
``NotImplementedError`` when used. :func:`install` makes ``import transformer_engine`` resolve
to these (only where TransformerEngine is not installed). :func:`convert_te_state` and
:func:`to_te_state` convert TE's FP8 state in checkpoints to fp8jax's ``fp8_meta`` and back.
The table of what exists and what raises: docs/porting-from-te.md, "TE's low-level API
(fp8jax.te)".

>>> import fp8jax.te
>>> fp8jax.te.install()
>>> from transformer_engine.common import recipe
>>> recipe.DelayedScaling is fp8jax.DelayedScaling
True
>>> fp8jax.te.uninstall()
"""

from __future__ import annotations

from fp8jax.te import common, jax
from fp8jax.te.aliases import install, is_installed, uninstall
from fp8jax.te.convert import convert_te_state, to_te_state

__all__ = [
    "common",
    "convert_te_state",
    "install",
    "is_installed",
    "jax",
    "to_te_state",
    "uninstall",
]
