"""TransformerEngine's ``transformer_engine.jax.flax.module``: ``TransformerEngineBase``.

A Linen module subclassing :class:`TransformerEngineBase` calls
:meth:`~TransformerEngineBase.generate_quantizer_set` once per GEMM and passes the set to
:func:`fp8jax.te.jax.dense.dense` (or ``layernorm_dense``, ``layernorm_mlp``). Under delayed
scaling the set's state lives in the collection the caller names, per role
(``x``, ``kernel``, ``grad``): ``{role}{postfix}_scale`` ``float32[1]`` and
``{role}{postfix}_amax_history`` ``float32[amax_history_len]`` (TE's names; the history in
fp8jax's order, newest first). It is used in TE's convention: the train step differentiates
the loss with respect to ``params`` and that collection and takes the collection's gradient
as its next value (MaxText's ``_overwrite_with_gradient``); no probe collection is needed.
A state that two calls share (a module called twice per step, or broadcast over ``nn.scan``)
would get the sum of their next values, as in TE: give every call its own state.

The TE Linen layers fp8jax has are in :mod:`fp8jax.te.jax.flax` (fp8jax's own modules).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from fp8jax.autocast import get_recipe, is_fp8_enabled
from fp8jax.te.common.recipe import fp8jax_recipe
from fp8jax.te.jax.quantize import QuantizerFactory, QuantizerSet, noop_quantizer_set

__all__ = ["COLLECTION_NAME", "TransformerEngineBase"]

#: TE's default collection of the quantizers' state (``variable_collection=None``).
COLLECTION_NAME = "fp8_metas"

#: The quantizer-set roles and TE's variable prefix of each.
_PREFIXES = (("x", "x"), ("kernel", "kernel"), ("dgrad", "grad"))


class TransformerEngineBase(nn.Module):
    """Base class of TE's Linen modules: gives :meth:`generate_quantizer_set`."""

    def generate_quantizer_set(
        self,
        postfix: str = "",
        variable_collection: str | None = None,
        quantization_checkpoint_name: str | None = None,
        fp8_recipe: Any = None,
        n_groups: int | None = None,
    ) -> QuantizerSet:
        """The quantizer set of one GEMM of this module.

        Args:
          postfix: appended to the role in the state's variable names (one GEMM each).
          variable_collection: the collection of the state (default ``"fp8_metas"``).
          quantization_checkpoint_name: kept on the set; fp8jax names the quantized operands
            with its own checkpoint names (``fp8jax.CHECKPOINT_NAMES``, policy
            ``fp8jax.save_fp8_operands``).
          fp8_recipe: a recipe of :mod:`fp8jax.te.common.recipe` (or any fp8jax recipe);
            default: the enclosing :func:`fp8jax.autocast`'s, and the no-op set outside one.
          n_groups: grouped GEMMs; not implemented (``NotImplementedError``).
        """
        if n_groups is not None:
            raise NotImplementedError(
                f"generate_quantizer_set: n_groups={n_groups!r} (grouped GEMM quantizers) is "
                "not implemented by fp8jax.te; use fp8jax.grouped_dense or fp8jax.flax.MoEBlock"
            )
        if not isinstance(postfix, str):
            raise TypeError(f"generate_quantizer_set: postfix must be a str, got {postfix!r}")
        if variable_collection is None:
            variable_collection = COLLECTION_NAME
        if not isinstance(variable_collection, str) or not variable_collection:
            raise TypeError(
                "generate_quantizer_set: variable_collection must be a collection name (str), "
                f"got {variable_collection!r}"
            )
        if fp8_recipe is None:
            if not is_fp8_enabled():
                return noop_quantizer_set
            fp8_recipe = get_recipe()
        recipe = fp8jax_recipe(fp8_recipe, "generate_quantizer_set: fp8_recipe")
        metas = None
        if recipe.keeps_state:
            length = recipe.amax_history_len
            metas = {}
            for role, prefix in _PREFIXES:
                scale = self.variable(
                    variable_collection, f"{prefix}{postfix}_scale", jnp.ones, (1,), jnp.float32
                ).value
                hist = self.variable(
                    variable_collection,
                    f"{prefix}{postfix}_amax_history",
                    jnp.zeros,
                    (length,),
                    jnp.float32,
                ).value
                if jnp.shape(scale) != (1,) or jnp.shape(hist) != (length,):
                    raise ValueError(
                        f"generate_quantizer_set: {variable_collection}/{prefix}{postfix}_* has "
                        f"scale {jnp.shape(scale)} and amax_history {jnp.shape(hist)}; the "
                        f"recipe wants (1,) and ({length},) (amax_history_len={length}). Was it "
                        "initialised under another recipe? (Under nn.scan, give the collection "
                        "a variable axis.)"
                    )
                metas[role] = (scale, hist)
        return QuantizerFactory.create_set(
            fp8_recipe=recipe,
            quantize_meta_set=metas,
            checkpoint_name=quantization_checkpoint_name,
        )
