"""TransformerEngine's ``transformer_engine.common``: its :mod:`~fp8jax.te.common.recipe`."""

from __future__ import annotations

from fp8jax.te.common import recipe

__all__ = ["recipe"]
