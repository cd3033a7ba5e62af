"""AdamW with its moments stored in 8 bits (issue 39): 2 bytes per parameter instead of 8.

Each step dequantizes the two moments of a parameter to float32, updates them and computes
the update exactly as ``optax.scale_by_adam`` does, then re-quantizes them (the update uses the
float32 moments of this step; the next step reads their round trip). The first moment is kept
as FP8 E4M3 codes, the second as uint8 codes of its square root, each with one float32 inverse
scale per 128 elements along the parameter's last dim (:mod:`fp8jax.optim.moments`;
docs/numerics.md, "FP8 optimizer state", gives the measured errors and the reasons).

A non-finite moment stays non-finite through its storage (reserved codes in a flagged block,
:func:`~fp8jax.optim.quantize_moment`), so a NaN, inf or overflowing gradient has optax's
effect on later updates.

``fp8_moments=False`` keeps float32 moments: then :func:`adamw` is ``optax.adamw`` bit for
bit on float32 parameters (tested).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from fp8jax.optim.hyperparams import check_bool, check_int, check_scalar
from fp8jax.optim.moments import (
    BLOCK,
    BlockScaled,
    check_blocks,
    dequantize_moment,
    quantize_moment,
    scale_grid_shape,
    sharding_of,
)
from fp8jax.optim.rounding import check_param_dtypes, stochastic_rounding

__all__ = ["ScaleByAdamFp8State", "adamw", "scale_by_adam"]

#: The formats of the first and second moments (fp8jax.optim.moments).
MU_FORMAT, NU_FORMAT = "e4m3", "sqrt_uint8"
_CODE_DTYPES = {"e4m3": jnp.float8_e4m3fn, "sqrt_uint8": jnp.uint8}
_PARAM_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_ROUNDINGS = ("stochastic", "nearest")


class ScaleByAdamFp8State(NamedTuple):
    """State of :func:`scale_by_adam`.

    Attributes:
      count: int32 step count (for the bias correction).
      mu: the first moments: :class:`~fp8jax.optim.BlockScaled` (E4M3 codes and float32
        inverse scales), or a float32 params-like tree with ``fp8_moments=False``.
      nu: the second moments, as ``mu`` (uint8 codes of ``sqrt(nu)``).
    """

    count: jax.Array
    mu: Any
    nu: Any


def _check_adam(owner: str, b1: Any, b2: Any, eps: Any, eps_root: Any) -> None:
    check_scalar(owner, "b1", b1, 0.0, 1.0)
    check_scalar(owner, "b2", b2, 0.0, 1.0)
    check_scalar(owner, "eps", eps, 0.0)
    check_scalar(owner, "eps_root", eps_root, 0.0)


def _full(like: Any, shape: tuple[int, ...], value: float, dtype: Any) -> jax.Array:
    """``full(shape, value)`` sharded like ``like`` where its sharding is known (the same
    ``PartitionSpec``: a moment's codes and scale grid have the parameter's rank)."""
    sharding = sharding_of(like)
    if sharding is None:
        return jnp.full(shape, value, dtype)
    return jax.lax.full(shape, value, dtype, sharding=NamedSharding(sharding.mesh, sharding.spec))


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    fp8_moments: bool = True,
    block_size: int = BLOCK,
) -> optax.GradientTransformation:
    """``optax.scale_by_adam`` with its moments stored block-scaled in 8 bits: the first as
    FP8 E4M3 codes, the second as uint8 codes of its square root.

    Args:
      b1, b2: decay rates of the first and second moments, in ``[0, 1)``.
      eps, eps_root: as in ``optax.scale_by_adam`` (``>= 0``).
      fp8_moments: store the moments in 8 bits (default); ``False`` keeps them in float32
        (``optax.scale_by_adam``'s numerics, with float32 moments for any parameter dtype).
      block_size: elements per scale along each parameter's last dim (default 128).

    Returns:
      A ``GradientTransformation``; its updates are float32.

    Raises:
      ValueError: a hyperparameter out of range (Python, numpy or concrete jax scalars); in
        ``init``/``update``, a parameter whose last dim is split over devices in parts that
        are not whole blocks (named by its path).
      TypeError: a hyperparameter that is not a number (or, for ``block_size``, not an int;
        under ``optax.inject_hyperparams`` make it static); in ``init``, a parameter that is
        neither float32 nor bfloat16 (an integer one, say), named by its path.
    """
    owner = "fp8jax.optim.scale_by_adam"
    _check_adam(owner, b1, b2, eps, eps_root)
    block = check_int(owner, "block_size", block_size, 1)
    fp8_moments = check_bool(owner, "fp8_moments", fp8_moments)

    def check(params: Any) -> None:
        for path, p in jax.tree_util.tree_leaves_with_path(params):
            check_blocks(owner, jax.tree_util.keystr(path), p, block)

    def zeros(params: Any, fmt: str) -> Any:
        if not fp8_moments:
            return jax.tree.map(lambda p: _full(p, jnp.shape(p), 0.0, jnp.float32), params)
        dtype = _CODE_DTYPES[fmt]
        codes = jax.tree.map(lambda p: _full(p, jnp.shape(p), 0, dtype), params)
        scales = jax.tree.map(
            lambda p: _full(p, scale_grid_shape(jnp.shape(p), block), 1.0, jnp.float32), params
        )
        return BlockScaled(codes, scales)

    def init(params: Any) -> ScaleByAdamFp8State:
        check_param_dtypes(owner, params, _PARAM_DTYPES)
        if fp8_moments:
            check(params)
        count = jnp.zeros([], jnp.int32)
        return ScaleByAdamFp8State(count, zeros(params, MU_FORMAT), zeros(params, NU_FORMAT))

    def raw(moment: Any, treedef: Any) -> list[Any]:
        """Per parameter, what is stored: a float32 moment, or its (codes, scale_inv)."""
        if not fp8_moments:
            return treedef.flatten_up_to(moment)
        codes = treedef.flatten_up_to(moment.codes)
        return list(zip(codes, treedef.flatten_up_to(moment.scale_inv), strict=True))

    def read(stored: Any, fmt: str) -> jax.Array:
        return dequantize_moment(*stored, fmt, block=block) if fp8_moments else stored

    def write(value: jax.Array, fmt: str) -> Any:
        return quantize_moment(value, fmt, block=block) if fp8_moments else value

    def tree(values: list[Any], treedef: Any) -> Any:
        if not fp8_moments:
            return treedef.unflatten(values)
        return BlockScaled(
            treedef.unflatten([q for q, _ in values]), treedef.unflatten([s for _, s in values])
        )

    def update(updates: Any, state: ScaleByAdamFp8State, params: Any = None):
        if params is not None and fp8_moments:
            check(params)
        grads, treedef = jax.tree.flatten(updates)
        count = optax.safe_increment(state.count)
        # optax's bias correction: 1 - decay**count in float32, then divide
        c1 = (1 - b1**count).astype(jnp.float32)
        c2 = (1 - b2**count).astype(jnp.float32)
        mus, nus, outs = [], [], []
        done = None
        for g, m, v in zip(grads, raw(state.mu, treedef), raw(state.nu, treedef), strict=True):
            if fp8_moments and done is not None:
                # One parameter at a time: this one's inputs only once the previous one's
                # results exist, so XLA holds the float32 moments (written out before the
                # re-quantize's block maximum) of one parameter, not of all at once
                # (docs/performance.md, "Memory per parameter"). The same arithmetic.
                _, (g, m, v) = jax.lax.optimization_barrier((done, (g, m, v)))
            g = jnp.asarray(g, jnp.float32)
            m = (1 - b1) * g + b1 * read(m, MU_FORMAT)
            v = (1 - b2) * (g**2) + b2 * read(v, NU_FORMAT)
            outs.append((m / c1) / (jnp.sqrt(v / c2 + eps_root) + eps))
            if fp8_moments:
                # A gradient whose square is not finite makes v inf or NaN for good: every
                # later update of the element is 0 or NaN, as in optax (m / inf), whatever a
                # finite m is. Such a finite m (a 2e19 gradient's 2e18) is stored as 0, so
                # that it does not set its block's scale and flush its neighbours' m to 0.
                # (A test of g, not of v, keeps XLA:CPU from holding another float32 moment.)
                m = jnp.where(jnp.isfinite(g * g) | ~jnp.isfinite(m), m, np.float32(0))
            mus.append(write(m, MU_FORMAT))
            nus.append(write(v, NU_FORMAT))
            done = (outs[-1], mus[-1], nus[-1])
        new = ScaleByAdamFp8State(count, tree(mus, treedef), tree(nus, treedef))
        return treedef.unflatten(outs), new

    return optax.GradientTransformation(init, update)


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any = None,
    *,
    fp8_moments: bool = True,
    block_size: int = BLOCK,
    param_rounding: str = "stochastic",
    seed: int = 0,
) -> optax.GradientTransformation:
    """AdamW (``optax.adamw``'s arguments and numerics) with its moments stored in 8 bits
    (the first in FP8 E4M3, the second as uint8 codes of its square root).

    ``optax.chain(scale_by_adam(...), optax.add_decayed_weights(weight_decay, mask),
    optax.scale_by_learning_rate(learning_rate), stochastic_rounding(seed))``; the last
    transform touches only bfloat16 parameters.

    Memory per parameter: 2 bytes of codes plus 8 bytes of scales per 128 elements, 2.06
    bytes for both moments (``optax.adamw``: 8 with float32 parameters). With bfloat16
    parameters (2 bytes, no float32 master copy) the update is rounded stochastically
    (``param_rounding="stochastic"``, the default; ``"nearest"`` leaves it to
    ``optax.apply_updates``'s round to nearest, which loses small steps).

    >>> import jax.numpy as jnp, optax, fp8jax
    >>> tx = fp8jax.optim.adamw(1e-3)
    >>> params = {"w": jnp.ones((4, 256))}
    >>> state = tx.init(params)
    >>> state[0].mu.codes["w"].dtype, state[0].mu.scale_inv["w"].shape
    (dtype(float8_e4m3fn), (4, 2))
    >>> updates, state = tx.update({"w": jnp.full((4, 256), 0.5)}, state, params)
    >>> round(float(optax.apply_updates(params, updates)["w"][0, 0]), 7)  # 1 - lr * (1 + 1e-4)
    0.9989999

    A NaN or inf gradient, or one whose square overflows float32, makes the moments
    non-finite as in ``optax.adamw``, and they stay so through their 8-bit storage: that
    element's later updates are optax's (0 under an infinite ``v``, else NaN), its block's
    finite neighbours are stored as before (docs/numerics.md, "Non-finite moments").

    The numbers may be Python or numpy scalars or jax arrays; under
    ``optax.inject_hyperparams``, which turns every int into an array, name the two integers
    static (and ``"mask"`` too if it is a callable, as for ``optax.adamw``)::

        tx = optax.inject_hyperparams(fp8jax.optim.adamw, static_args=("block_size", "seed"))(
            learning_rate=1e-3, weight_decay=0.1)
        state = tx.init(params)
        state.hyperparams["learning_rate"] = 5e-4  # a new value, from the next update on

    With bfloat16 params add ``hyperparam_dtype=jnp.float32``: optax gives the hyperparameters
    the params' dtype, and ``b2 = 0.999`` in bfloat16 is 1 (refused in ``init``).

    Args:
      learning_rate: a number >= 0 or an optax schedule.
      b1, b2, eps, eps_root: as in ``optax.adamw``: b1 and b2 in ``[0, 1)``, the others
        ``>= 0``.
      weight_decay: decoupled weight decay (a number >= 0 or a schedule).
      mask: which parameters decay, as in ``optax.adamw``.
      fp8_moments: ``False`` keeps float32 moments (``optax.adamw`` bit for bit).
      block_size: elements per moment scale along each parameter's last dim (a Python or
        numpy int).
      param_rounding: ``"stochastic"`` or ``"nearest"``: how a bfloat16 parameter takes its
        update.
      seed: the stochastic rounding's seed (a Python or numpy int).

    Raises:
      TypeError: a hyperparameter of the wrong type (a string from a config file, a bool for
        a number, a float or jax array for an int), named; in ``init``, a parameter that is not
        float32 or bfloat16 (named by its path).
      ValueError: a hyperparameter out of range (numpy scalars and concrete jax scalars
        included; traced ones are not known while tracing); in ``init``, a parameter whose
        sharding would split a block (named by its path).
    """
    owner = "fp8jax.optim.adamw"
    check_scalar(owner, "learning_rate", learning_rate, 0.0, schedule=True)
    _check_adam(owner, b1, b2, eps, eps_root)
    check_scalar(owner, "weight_decay", weight_decay, 0.0, schedule=True)
    fp8_moments = check_bool(owner, "fp8_moments", fp8_moments)
    block_size = check_int(owner, "block_size", block_size, 1)
    seed = check_int(owner, "seed", seed)
    if not isinstance(param_rounding, str):
        raise TypeError(f"{owner}: param_rounding must be a str, got {param_rounding!r}")
    if param_rounding not in _ROUNDINGS:
        raise ValueError(
            f"{owner}: param_rounding must be one of {_ROUNDINGS}, got {param_rounding!r}"
        )
    parts = [
        scale_by_adam(b1, b2, eps, eps_root, fp8_moments=fp8_moments, block_size=block_size),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    ]
    if param_rounding == "stochastic":
        parts.append(stochastic_rounding(seed))
    return optax.chain(*parts)
