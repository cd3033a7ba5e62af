"""The ``jax.custom_vjp`` wiring every FP8 layer shares (:func:`layer_vjp`), the other half of
the layer core (:mod:`fp8jax.functional._core`: the setup, the casts and the GEMMs): the probe
check, the observations out through the probe's cotangent, the cotangents typed as their
primals (their shardings under explicit sharding, their varying axes inside a ``shard_map``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops.base.partition import explicit_mesh, varying, varying_axes


def zero_cotangent(x: jax.Array) -> Any:
    """A zero cotangent for ``x``: zeros of its dtype, or ``float0`` ones for an integer array
    (a mixture of experts' group sizes)."""
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def zeros_if_symbolic(g: Any) -> jax.Array:
    """A cotangent as an array (``symbolic_zeros=True`` hands over ``SymbolicZero`` objects)."""
    if isinstance(g, jax.custom_derivatives.SymbolicZero):
        return jnp.zeros(g.shape, g.dtype)
    return g


def perturbed(tree: Any) -> bool:
    """Whether any ``CustomVJPPrimal`` in ``tree`` is being differentiated."""
    return any(p.perturbed for p in jax.tree.leaves(tree))


def probe_error(where: str) -> ValueError:
    """Differentiated without the probe under delayed scaling (see :func:`layer_vjp`)."""
    return ValueError(
        f"{where}: differentiated with FP8 DelayedScaling, but not with respect to its probe, "
        "so this step's amax observations would be dropped and the FP8 scales would never "
        "update. Differentiate the loss with respect to the fp8_probe collection too and fold "
        "its gradient into fp8_meta (fp8jax.flax.Fp8TrainState.apply_gradients or "
        "update_fp8_variables; for the functional layers: probe=jnp.zeros(n_roles) and "
        "fp8jax.update_fp8_meta). Under nn.scan, give fp8_probe a variable axis. Flax NNX: "
        "nnx.value_and_grad(..., argnums=fp8jax.nnx.diff_state()), then "
        "fp8jax.nnx.update_fp8_variables or apply_gradients. A gradient that must not update the "
        "state: differentiate the probe too and ignore its gradient."
    )


def primal_shardings(primals: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Under explicit sharding (``AxisType.Explicit``) the shardings of ``primals`` (``None``
    for an absent one): a custom_vjp cotangent must have its primal's type, sharding included.
    ``None`` otherwise."""
    if not explicit_mesh():
        return None
    return tuple(None if v is None else jax.typeof(v).sharding for v in primals)


def as_primals(shardings: tuple[Any, ...] | None, grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """``grads`` resharded to their primals' ``shardings`` (:func:`primal_shardings`): a GEMM
    picks its output's split from its operands', which need not be the primal's."""
    if shardings is None:
        return grads
    pairs = zip(grads, shardings, strict=True)
    return tuple(g if g is None or s is None else jax.sharding.reshard(g, s) for g, s in pairs)


class _Wiring(NamedTuple):
    cfg: Any  # the layer's static config, with the Fp8Setup as ``cfg.setup``
    shardings: tuple[Any, ...] | None  # primal_shardings of the params
    # inside a shard_map: the manual axes each of (params..., scale, probe) varies over
    varies: tuple[frozenset[str], ...]


def like_primal(ct: Any, axes: frozenset[str], reduce: Callable[..., Any]) -> Any:
    """A cotangent typed as its primal inside a ``shard_map``: a custom_vjp's cotangent must
    vary over exactly the manual ``axes`` its primal varies over. Where it varies over more
    (an invariant param or probe used on every device), the devices' contributions are
    combined with ``reduce`` over those axes (``psum`` for a gradient, ``pmax`` for amax
    observations); where over fewer, it is marked varying."""
    if ct is None or isinstance(ct, jax.custom_derivatives.SymbolicZero):
        return ct
    extra = tuple(sorted(varying_axes(ct) - axes))
    if extra:
        ct = reduce(ct, extra)
    return varying(ct, tuple(sorted(axes)))


def layer_vjp(forward: Callable[..., Any], backward: Callable[..., Any], name: str):
    """A layer's ``jax.custom_vjp``, called as ``call(cfg, params, scale, probe, extra=())``.

    ``forward(cfg, *params, scale, *extra) -> (outputs, residuals)``: the layer's forward (its
    outputs usually end with the forward observations, NaN for the output-grad roles);
    ``backward(cfg, residuals, cotangents) -> (one gradient per param, observed)``, ``observed``
    the ``float32[n_roles]`` amaxes of the step.
    ``cfg`` is the layer's static (hashable) config with its :class:`Fp8Setup` as
    ``cfg.setup``; ``params`` (``None`` for an absent one) are differentiated, ``extra`` (e.g.
    a dropout mask) is not (zero cotangents).

    The wiring every layer shares: the observed amaxes leave as the cotangent of ``probe`` (a
    zero ``float32[n_roles]`` the forward ignores; ``scale`` gets a zero cotangent);
    differentiating a param but not ``probe`` under delayed scaling is a :func:`probe_error`
    at trace time, since the state would silently stop updating; under explicit sharding each
    param's gradient is resharded to the param's sharding (:func:`as_primals`).
    """

    def primal(wiring: _Wiring, params, scale, probe, extra):
        del probe
        out, _ = forward(wiring.cfg, *params, scale, *extra)
        return out

    primal.__name__ = primal.__qualname__ = name
    fn = jax.custom_vjp(primal, nondiff_argnums=(0,))

    def fwd(wiring: _Wiring, params, scale, probe, extra):
        # symbolic_zeros=True: each argument arrives as a CustomVJPPrimal that says whether it
        # is being differentiated.
        setup = wiring.cfg.setup
        if not setup.current_scaling and not probe.perturbed and perturbed(params):
            raise probe_error(setup.where)
        params, scale, extra = jax.tree.map(lambda p: p.value, (params, scale, extra))
        out, res = forward(wiring.cfg, *params, scale, *extra)
        return out, (res, extra)

    def bwd(wiring: _Wiring, res, cts):
        res, extra = res
        grads, observed = backward(wiring.cfg, res, cts)
        *params_vary, scale_vary, probe_vary = wiring.varies
        grads = tuple(
            like_primal(g, v, jax.lax.psum) for g, v in zip(grads, params_vary, strict=True)
        )
        grads = as_primals(wiring.shardings, grads)
        zero = like_primal(jnp.zeros(observed.shape, jnp.float32), scale_vary, jax.lax.psum)
        observed = like_primal(observed, probe_vary, jax.lax.pmax)
        return grads, zero, observed, jax.tree.map(zero_cotangent, extra)

    fn.defvjp(fwd, bwd, symbolic_zeros=True)

    def call(cfg, params: tuple[Any, ...], scale, probe, extra: tuple[Any, ...] = ()):
        varies = tuple(
            frozenset() if v is None else varying_axes(v) for v in (*params, scale, probe)
        )
        wiring = _Wiring(cfg, primal_shardings(params), varies)
        return fn(wiring, tuple(params), scale, probe, tuple(extra))

    return call
