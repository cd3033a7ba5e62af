"""BF16 parameters without a float32 master copy: the update applied with stochastic rounding.

A bfloat16 parameter has 8 significant bits: an Adam step of ``lr * ~1`` on a weight of size
``w`` is lost entirely by round-to-nearest once ``lr < 2**-9 * |w|`` (the weight stops
learning late in a cosine schedule). Stochastic rounding rounds ``p + u`` up with probability
equal to the distance from the value below, so each step is unbiased (``E[new] = p + u``) and
small steps accumulate in expectation. It needs no extra memory; compensated (Kahan) summation
would be exact but keeps a second bfloat16 buffer per parameter, the 2 bytes this option exists
to save.

The rounding is done by an optax transform placed last in the chain (:func:`stochastic_rounding`):
it returns ``u' = float32(SR(p + u)) - float32(p)``, so ``optax.apply_updates`` (which adds in
float32 and casts to the parameter's dtype) lands exactly on the stochastically rounded value.
(Exactly whenever ``p`` and the result are within 2**16 of each other in magnitude, so that
their float32 difference is exact; otherwise within float32's rounding of that difference.)
Float32 parameters pass through unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fp8jax.optim.hyperparams import check_int

__all__ = ["StochasticRoundingState", "round_to_bfloat16", "stochastic_rounding"]

_ROUNDED = (jnp.dtype(jnp.bfloat16),)
_PASSED = (jnp.dtype(jnp.float32),)


class StochasticRoundingState(NamedTuple):
    """State of :func:`stochastic_rounding`: the step count that draws each step's bits."""

    count: jax.Array


def round_to_bfloat16(x: jax.Array, bits: jax.Array) -> jax.Array:
    """``x`` (float32) stochastically rounded to bfloat16 with random ``bits`` (uint32, of
    which the low 16 are used): the low 16 bits of ``x`` are added to ``bits`` and cut off, so
    ``x`` rounds away from zero with probability (its distance from the bfloat16 value toward
    zero) / (the spacing there). Non-finite values stay as they are.

    >>> import jax.numpy as jnp
    >>> x = jnp.float32(1 + 2**-9)  # a quarter of the way from 1 to the next bfloat16
    >>> [float(round_to_bfloat16(x, jnp.uint32(b))) for b in (0, 0xBFFF, 0xC000)]
    [1.0, 1.0, 1.0078125]
    """
    x = jnp.asarray(x, jnp.float32)
    low = jnp.asarray(bits, jnp.uint32) & jnp.uint32(0xFFFF)
    up = (jax.lax.bitcast_convert_type(x, jnp.uint32) + low) & jnp.uint32(0xFFFF0000)
    y = jnp.where(jnp.isfinite(x), jax.lax.bitcast_convert_type(up, jnp.float32), x)
    return y.astype(jnp.bfloat16)


def check_param_dtypes(owner: str, params: Any, allowed: tuple[Any, ...]) -> None:
    """TypeError naming the first parameter whose dtype is not in ``allowed``."""
    for path, p in jax.tree_util.tree_leaves_with_path(params):
        dt = jnp.result_type(p)
        if dt not in allowed:
            names = ", ".join(str(a) for a in allowed)
            raise TypeError(
                f"{owner}: parameter {jax.tree_util.keystr(path)} has dtype {dt}; expected one "
                f"of {names}"
            )


def stochastic_rounding(seed: int = 0) -> optax.GradientTransformation:
    """An optax transform, last in a chain, that makes ``optax.apply_updates`` round each
    bfloat16 parameter's ``p + update`` stochastically (float32 parameters pass through).

    Args:
      seed: a Python or numpy int; the bits of step ``n`` are drawn from
        ``fold_in(key(seed), n)`` and the leaf's index, so a run (and its resumption from a
        checkpoint) is reproducible and the same on any number of devices.

    Returns:
      A ``GradientTransformation`` whose ``update`` needs ``params``.

    Raises:
      TypeError: a ``seed`` that is not a Python or numpy int (a jax array included: under
        ``optax.inject_hyperparams`` make it static); in ``init``/``update``, a parameter that is
        neither bfloat16 nor float32 (named by its path).
    """
    owner = "fp8jax.optim.stochastic_rounding"
    seed = check_int(owner, "seed", seed)

    def init(params: Any) -> StochasticRoundingState:
        check_param_dtypes(owner, params, (*_ROUNDED, *_PASSED))
        return StochasticRoundingState(count=jnp.zeros([], jnp.int32))

    def update(updates: Any, state: StochasticRoundingState, params: Any = None):
        if params is None:
            raise ValueError(f"{owner}: update needs params (the values being rounded)")
        check_param_dtypes(owner, params, (*_ROUNDED, *_PASSED))
        key = jax.random.fold_in(jax.random.key(seed), state.count)
        leaves, treedef = jax.tree.flatten(updates)
        ps = treedef.flatten_up_to(params)
        out = []
        for i, (u, p) in enumerate(zip(leaves, ps, strict=True)):
            if jnp.result_type(p) in _PASSED:
                out.append(u)
                continue
            wide = p.astype(jnp.float32)
            bits = jax.random.bits(jax.random.fold_in(key, i), jnp.shape(p), jnp.uint32)
            new = round_to_bfloat16(wide + jnp.asarray(u, jnp.float32), bits)
            out.append(new.astype(jnp.float32) - wide)
        count = optax.safe_increment(state.count)
        return treedef.unflatten(out), StochasticRoundingState(count=count)

    return optax.GradientTransformation(init, update)
