"""The core every FP8 layer is built from (:func:`fp8jax.dense`, :func:`fp8jax.layernorm_dense`,
:func:`fp8jax.layernorm_mlp`): resolving FP8 on/off and the recipe, the cast of a tensor for a
GEMM, one FP8 GEMM's forward and backward on already-cast operands and the checkpoint names of
what the backward reads. The ``jax.custom_vjp`` wiring of a layer (``layer_vjp``: the probe
check, the observations out through the probe's cotangent, cotangents typed as their primals
under explicit sharding) is the other half of the core, :mod:`fp8jax.functional._vjp`.

Block-scaled recipes (``Float8BlockScaling``, ``MXFP8BlockScaling``) run through the same
pieces: :func:`cast_t` casts with the role's blocks (:func:`block_cast`: both layouts, a pair of
scale grids; fused as the per-tensor casts are, with the bias gradient, the MLP's activation and
its gradient; :func:`block_norm_cast` with the norm) and each GEMM is the block-scaled one
(``_gemm``). The row-wise recipe (``Float8RowwiseScaling``) too, on the unfused paths of current
scaling: :func:`cast_t` casts per row (:func:`rowwise_cast`) and each GEMM scales its float32
result by the outer product of its operands' row scales; with its high-precision wgrad, an
input's and a gradient's second copy is the high-precision transpose, and the wgrad a plain dot.

A layer with ``G`` GEMMs has ``3 G`` tensor roles (:func:`fp8jax.state.gemm_roles`); each GEMM's
forward here takes its input already in FP8 (from a fused norm or activation kernel, or from
``cast_transpose``), casts its kernel, and keeps, as ``uint8`` codes with the checkpoint names of
:data:`CHECKPOINT_NAMES`, exactly what its two backward GEMMs read.

FP8 tensors travel as their ``uint8`` codes (the GEMMs view them as FP8 on each device): for
every floating-point residual that the forward also uses, ``jax.checkpoint`` inserts
``reduce_precision(x, finfo(x.dtype))``, which XLA applies with IEEE rules (E4M3FN codes of 256
and above become NaN, subnormals are flushed), so FP8 residuals would change the forward pass
under remat; codes are left alone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from fp8jax.autocast import current_state
from fp8jax.ops.base.partition import explicit_matmul_spec, explicit_mesh
from fp8jax.ops.base.switch import get_implementation
from fp8jax.ops.block.block_scaling import (
    block_cast_transpose,
    mxfp8_cast_transpose,
)
from fp8jax.ops.block.rowwise import rowwise_quantize
from fp8jax.ops.casts.cast_transpose import (
    cast_transpose,
    cast_transpose_dbias,
    grouped_cast_transpose_dbias,
)
from fp8jax.ops.casts.quantize import quantize
from fp8jax.ops.fused.block_fused import (
    activation_block_cast_transpose,
    activation_mxfp8_cast_transpose,
    block_cast_transpose_dbias,
    dactivation_block_cast_transpose_dbias,
    dactivation_mxfp8_cast_transpose_dbias,
    mxfp8_cast_transpose_dbias,
    norm_block_cast_transpose,
    norm_mxfp8_cast_transpose,
)
from fp8jax.ops.gemms import fixed_groups
from fp8jax.ops.gemms.blockwise import block_gemm
from fp8jax.ops.gemms.gemm import gemm_codes
from fp8jax.ops.gemms.rowwise_gemm import rowwise_gemm
from fp8jax.recipe import (
    DelayedScaling,
    Format,
    Recipe,
    Scaling,
    check_recipe,
    fp8_max,
    is_fp8_dtype,
)
from fp8jax.state import DENSE_ROLES, Fp8Meta

#: Checkpoint names of everything an FP8 GEMM layer saves for its backward pass, for
#: ``jax.checkpoint_policies.save_only_these_names``: the FP8 input and kernel in both layouts
#: (row-wise for the forward GEMM, transposed for the backward ones), their inverse scales and
#: their amaxes. Saving all of them means no cast is recomputed under ``jax.checkpoint``.
CHECKPOINT_NAMES: tuple[str, ...] = (
    "fp8jax_input_fp8",  # input, transposed (K-major for the wgrad GEMM)
    "fp8jax_kernel_fp8",  # kernel, row-wise (the dgrad GEMM)
    "fp8jax_input_fp8_fwd",  # input, row-wise (the forward GEMM)
    "fp8jax_kernel_fp8_fwd",  # kernel, transposed (the forward GEMM; FSDP's gathered copy)
    "fp8jax_scale_inv",  # inverse scales of the input and the kernel
    "fp8jax_amax",  # amaxes of the input and the kernel (the forward observations)
)

#: A ``jax.checkpoint`` policy that saves the FP8 operands of every fp8jax GEMM (and their
#: scales) and recomputes everything else: ``jax.checkpoint(f, policy=save_fp8_operands)`` or
#: ``nn.remat(Block, policy=save_fp8_operands)``. A forward GEMM whose output the backward needs
#: (e.g. the input of an activation) is recomputed from the saved FP8 operands, with no cast.
save_fp8_operands = jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES)

#: The dtypes a layer computes in and casts from directly (others are converted first).
WIDE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class LayerOutput(NamedTuple):
    """What a functional layer returns to the modules built on it: its output, the norm's
    output (``None`` without one, or when not asked for) and the forward observations
    (``float32[n_roles]`` amaxes, NaN for the output-gradient roles, which the forward cannot
    see; ``None`` with FP8 off)."""

    out: jax.Array
    ln_out: jax.Array | None
    observed: jax.Array | None


class Fp8Setup(NamedTuple):
    """Static FP8 settings of one layer call (hashable: part of a custom_vjp's config)."""

    fwd_dtype: Any
    bwd_dtype: Any
    current_scaling: bool
    margin: int
    # fp8jax.ops.implementation per family, read when the layer is called, so that a backward
    # traced later (jax.vjp's function called elsewhere) runs the same ones.
    impl: tuple[tuple[str, str], ...]
    # Who is calling, for error messages ("fp8jax.dense", "DenseGeneral at 'Dense_0'", ...).
    where: str
    # Block scaling (Float8BlockScaling, MXFP8BlockScaling), else None: per role ("x", "w",
    # "grad") its block, power-of-two flag and amax epsilon. Block-scaled layers take the
    # unfused paths of current scaling (current_scaling is True with it).
    blocks: tuple[tuple[str, tuple[int, int], bool, float], ...] | None = None
    mxfp8: bool = False
    # Row-wise scaling (Float8RowwiseScaling), else None: per role its power-of-two flag and
    # amax epsilon. It takes the unfused paths of current scaling too (current_scaling True).
    rowwise: tuple[tuple[str, bool, float], ...] | None = None
    # The wgrad as a plain dot of the high-precision operands (Recipe.fp8_gemm("wgrad") False)
    hp_wgrad: bool = False
    recipe_name: str = ""  # for error messages

    def implementation(self, family: str) -> str:
        return dict(self.impl)[family]

    def rows(self, role: str) -> tuple[bool, float]:
        """``(power_2_scale, amax_epsilon)`` of ``role`` under row-wise scaling."""
        for name, pow2, eps in self.rowwise or ():
            if name == role:
                return pow2, eps
        raise ValueError(f"{self.where}: no row-wise scaling for role {role!r}")

    def block(self, role: str) -> tuple[tuple[int, int], bool, float]:
        """``(block, power_2_scale, amax_epsilon)`` of ``role`` under block scaling."""
        for name, block, pow2, eps in self.blocks or ():
            if name == role:
                return block, pow2, eps
        raise ValueError(f"{self.where}: no block scaling for role {role!r}")


def _meta_hint(n_roles: int) -> str:
    extra = "" if n_roles == len(DENSE_ROLES) else f", n_roles={n_roles}"
    return f"fp8jax.init_fp8_meta(recipe{extra})"


def resolve(
    where: str,
    recipe: Recipe | None,
    enabled: bool | None,
    fp8_meta: Fp8Meta | None,
    probe: jax.Array | None,
    n_roles: int,
    families: tuple[str, ...] = (),
) -> tuple[Fp8Setup | None, jax.Array | None, jax.Array | None]:
    """FP8 on or off, with which recipe, scales and probe: an explicit ``enabled`` decides;
    otherwise an explicit ``recipe`` turns FP8 on (a recipe given by hand is never silently
    ignored); otherwise the enclosing autocast (off outside any). The recipe is the one given,
    else the autocast's. Returns ``(setup, scale, probe)``; ``setup`` is ``None`` with FP8 off.
    ``families``: the op families besides ``cast`` and ``gemm`` whose implementation the layer
    reads (:meth:`Fp8Setup.implementation`)."""
    state = current_state()
    if enabled is None:
        enabled = True if recipe is not None else state.enabled
    if not enabled:
        return None, None, None
    if recipe is None:
        recipe = state.recipe if state.recipe is not None else DelayedScaling()
    recipe = check_recipe(recipe, f"{where}: recipe")
    if recipe.fp8_format is Format.E5M2:
        raise ValueError(
            f"{where}: Format.E5M2 cannot run GEMMs (FP8 tensor cores have no E5M2 x E5M2 "
            "matmul); use Format.HYBRID or Format.E4M3"
        )
    current = not recipe.keeps_state
    if current:
        scale = jnp.ones((n_roles,), jnp.float32)
    else:
        if not isinstance(fp8_meta, Fp8Meta):
            raise TypeError(
                f"{where}: DelayedScaling needs fp8_meta (an Fp8Meta with {n_roles} roles, from "
                f"{_meta_hint(n_roles)}), got {type(fp8_meta).__name__}"
            )
        if fp8_meta.scale.shape != (n_roles,):
            raise ValueError(
                f"{where}: fp8_meta must have {n_roles} roles, got scale {fp8_meta.scale.shape}"
            )
        scale = jax.lax.stop_gradient(fp8_meta.scale)
    if probe is None:
        probe = jnp.zeros((n_roles,), jnp.float32)
    elif jnp.shape(probe) != (n_roles,) or jnp.result_type(probe) != jnp.float32:
        raise ValueError(f"{where}: probe must be float32[{n_roles}], got {jnp.shape(probe)}")
    setup = Fp8Setup(
        fwd_dtype=recipe.fwd_dtype,
        bwd_dtype=recipe.bwd_dtype,
        current_scaling=current,
        margin=getattr(recipe, "margin", 0),
        impl=tuple((f, get_implementation(f)) for f in ("cast", "gemm", *families)),
        where=where,
        blocks=_blocks(recipe) if recipe.block_scaled else None,
        mxfp8=recipe.scaling is Scaling.MXFP8,
        rowwise=_row_qparams(recipe) if recipe.scaling is Scaling.ROWWISE else None,
        hp_wgrad=_hp_wgrad(where, recipe),
        recipe_name=type(recipe).__name__,
    )
    return setup, scale, probe


def _row_qparams(recipe: Recipe):
    """Fp8Setup.rowwise of a row-wise recipe."""
    qs = {r: recipe.qparams(r) for r in ("x", "w", "grad")}
    return tuple((r, q.power_2_scale, q.amax_epsilon) for r, q in qs.items())


def _hp_wgrad(where: str, recipe: Recipe) -> bool:
    """Whether the recipe runs the wgrad in high precision (:meth:`Recipe.fp8_gemm`): only the
    wgrad, and only under row-wise scaling, can leave FP8 (a ValueError otherwise)."""
    hp = [g for g in ("fprop", "dgrad", "wgrad") if not recipe.fp8_gemm(g)]
    if hp and (hp != ["wgrad"] or recipe.scaling is not Scaling.ROWWISE):
        raise ValueError(
            f"{where}: {type(recipe).__name__} runs the {', '.join(hp)} GEMM(s) in high "
            "precision, which fp8jax supports only for the wgrad under row-wise scaling "
            "(Float8RowwiseScaling(wgrad_high_precision=True))"
        )
    return bool(hp)


def _blocks(recipe: Recipe):
    """Fp8Setup.blocks of a block-scaled recipe."""
    qs = {r: recipe.qparams(r) for r in ("x", "w", "grad")}
    return tuple((r, recipe.block(r), q.power_2_scale, q.amax_epsilon) for r, q in qs.items())


def codes(q: jax.Array) -> jax.Array:
    """An FP8 tensor's ``uint8`` codes (how FP8 residuals travel; see the module docstring).
    A high-precision array (the row-wise recipe's high-precision wgrad operand) is returned
    as it is."""
    if not is_fp8_dtype(q.dtype):
        return q
    return jax.lax.bitcast_convert_type(q, jnp.uint8)


def named(x: Any, i: int) -> Any:
    """``x`` (an array, or a block-scaled tensor's pair of scale grids) under the checkpoint
    name ``CHECKPOINT_NAMES[i]``."""
    return jax.tree.map(lambda a: checkpoint_name(a, CHECKPOINT_NAMES[i]), x)


def current_scale(x: jax.Array, fp8_dtype: Any, margin: int) -> jax.Array:
    """Float8CurrentScaling: the scale from this tensor's own amax (1 if amax is 0/non-finite)."""
    return scale_from_amax(jnp.max(jnp.abs(x.astype(jnp.float32))), fp8_dtype, margin)


def scale_from_amax(amax: jax.Array, fp8_dtype: Any, margin: int) -> jax.Array:
    """Float8CurrentScaling's scale from an amax (elementwise: one per group of a grouped
    GEMM's tensor): ``fp8_max / amax * 2**-margin``, 1 where amax is 0, subnormal or
    non-finite."""
    s = (np.float32(fp8_max(fp8_dtype)) / amax) * np.float32(2.0**-margin)
    ok = (amax >= np.finfo(np.float32).smallest_normal) & jnp.isfinite(amax)
    return jnp.where(ok, jnp.minimum(s, np.finfo(np.float32).max), jnp.float32(1.0))


def scale_for(setup: Fp8Setup, value: jax.Array, scale: jax.Array, fp8_dtype: Any) -> jax.Array:
    """The scale to quantize ``value`` with: the delayed one, or under current scaling the one
    from ``value``'s own amax."""
    return current_scale(value, fp8_dtype, setup.margin) if setup.current_scaling else scale


def cast_t(setup: Fp8Setup, x: jax.Array, scale: jax.Array, fp8_dtype: Any, role: str = "x"):
    """``cast_transpose`` with this call's scale (current scaling: ``x``'s own) -> ``(q, q_t,
    scale_inv, amax)``. "mesh": every amax of the step is reduced over the same devices, so XLA
    merges all of them into one all-reduce (the value is the tensor's global amax either way).
    Under block scaling ``x`` is cast with ``role``'s blocks and ``scale_inv`` is the pair of
    scale grids ``(rows, transposed)`` (:func:`block_cast`)."""
    if setup.blocks is not None:
        return block_cast(setup, x, fp8_dtype, role)
    if setup.rowwise is not None:
        return rowwise_cast(setup, x, fp8_dtype, role)
    return cast_transpose(
        x, scale_for(setup, x, scale, fp8_dtype), fp8_dtype, amax_reduction="mesh",
        implementation=setup.implementation("cast"),
    )  # fmt: skip


def cast_dbias(setup: Fp8Setup, g: jax.Array, scale: jax.Array, with_bias: bool):
    """An output gradient cast to the backward format, with its column sums when the layer has
    a bias: ``(q, q_t, scale_inv, amax, dbias or None)`` (``cast_transpose_dbias``: one pass
    over ``g``, so the bias gradient costs no second read)."""
    bwd = setup.bwd_dtype
    if setup.blocks is not None:
        if with_bias:
            return block_cast(setup, g, bwd, "grad", with_dbias=True)
        return (*block_cast(setup, g, bwd, "grad"), None)
    if not with_bias or setup.rowwise is not None:
        dbias = jnp.sum(g.astype(jnp.float32), axis=0) if with_bias else None
        return (*cast_t(setup, g, scale, bwd, role="grad"), dbias)
    scale = scale_for(setup, g, scale, bwd)
    return cast_transpose_dbias(
        g, scale, bwd, amax_reduction="mesh", implementation=setup.implementation("cast")
    )


def rowwise_cast(setup: Fp8Setup, x: jax.Array, fp8_dtype: Any, role: str):
    """Matrix ``x [M, K]`` quantized row-wise for a GEMM (``Float8RowwiseScaling``): ``(q [M,
    K], q_t [K, M], (scale_inv [M, 1], scale_inv_t [K, 1]), amax)``, ``q_t`` quantized again
    from ``x`` along ``M`` (:func:`~fp8jax.ops.rowwise_quantize` of both layouts: the wgrad
    contracts over the tokens, so its operands are scaled per feature over them). With the
    high-precision wgrad, an input's or gradient's (``role`` ``"x"``, ``"grad"``) ``q_t`` is
    ``x``'s transpose in its own dtype, and ``scale_inv_t`` ``None``. ``amax`` is NaN, "not
    observed" (no state)."""
    pow2, eps = setup.rows(role)
    kw = dict(power_2_scale=pow2, amax_epsilon=eps, implementation=setup.implementation("cast"))
    q, s = rowwise_quantize(x, fp8_dtype, **kw)
    if setup.hp_wgrad and role != "w":
        q_t, s_t = jnp.transpose(x), None
    else:
        q_t, s_t = rowwise_quantize(jnp.transpose(x), fp8_dtype, **kw)
    return q, q_t, (s, s_t), jnp.float32(jnp.nan)


def block_cast(
    setup: Fp8Setup,
    x: jax.Array | tuple[jax.Array, jax.Array],
    fp8_dtype: Any,
    role: str,
    *,
    with_dbias: bool = False,
    activations: tuple[str, ...] | None = None,
):
    """Matrix ``x`` [M, K] block-scaled for a GEMM with ``role``'s blocks (``"x"``, ``"w"``,
    ``"grad"``): ``(q [M, K], q_t [K, M], (scale_inv, scale_inv_t), amax)``, both layouts from
    :mod:`fp8jax.ops.block.block_scaling` (a 1-row-block tensor's ``q_t`` quantized again from
    ``x``), plus ``x``'s float32 column sums when ``with_dbias``, in the same op
    (:func:`~fp8jax.ops.block_cast_transpose_dbias`). With ``activations``, ``x`` is an MLP's
    first GEMM output [M, k, N] and its activation is cast, in one op
    (:func:`~fp8jax.ops.activation_block_cast_transpose`); or ``x`` is the pair ``(da [M, N],
    h [M, k, N])`` and the activation's gradient ``[M, k N]`` is cast with its column sums
    (:func:`~fp8jax.ops.dactivation_block_cast_transpose_dbias`; ``N`` a multiple of the
    block's columns, so that its per-half blocks are the matrix's). MXFP8's E8M0 scales travel
    as their ``uint8`` bits (as FP8 codes do: see the module docstring). ``amax`` is NaN, "not
    observed": block scaling has no state to observe for, so no pass over ``x`` computes it."""
    block, pow2, eps = setup.block(role)
    kw = dict(implementation=setup.implementation("cast"))
    if not setup.mxfp8:
        kw.update(power_2_scale=pow2, amax_epsilon=eps)
    if isinstance(x, tuple):  # the activation's gradient (da, h): q [M, k I], dbias [k I]
        fused = dactivation_mxfp8_cast_transpose_dbias if setup.mxfp8 else (
            dactivation_block_cast_transpose_dbias)  # fmt: skip
        kw["implementation"] = setup.implementation("activation")
        m, k, i = x[1].shape
        q, s, q_t, s_t, dbias = fused(*x, activations, fp8_dtype, block, **kw)
        out = (q.reshape(m, k * i), s.reshape(s.shape[0], -1), q_t.reshape(k * i, m),
               s_t.reshape(-1, s_t.shape[-1]), dbias.reshape(k * i))  # fmt: skip
    elif activations is not None:
        fused = activation_mxfp8_cast_transpose if setup.mxfp8 else activation_block_cast_transpose
        kw["implementation"] = setup.implementation("activation")
        out = fused(x, activations, fp8_dtype, block, **kw)
    elif with_dbias:
        fused = mxfp8_cast_transpose_dbias if setup.mxfp8 else block_cast_transpose_dbias
        out = fused(x, fp8_dtype, block, **kw)
    else:
        cast = mxfp8_cast_transpose if setup.mxfp8 else block_cast_transpose
        out = cast(x, fp8_dtype, block, **kw)
    return block_outputs(setup, *out)


def block_norm_cast(
    setup: Fp8Setup, x: jax.Array, gamma: jax.Array, beta: jax.Array | None,
    norm: tuple[str, float, bool],
):  # fmt: skip
    """The norm of ``x`` [M, H] block-scaled for a GEMM (role ``"x"``), in one op
    (:func:`~fp8jax.ops.norm_block_cast_transpose`): ``(q, q_t, (scale_inv, scale_inv_t), amax,
    mu [M], rsigma [M])``, as :func:`block_cast` of the norm's output would give."""
    norm_type, epsilon, zero_centered = norm
    block, pow2, eps = setup.block("x")
    kw = dict(norm_type=norm_type, epsilon=epsilon, zero_centered_gamma=zero_centered,
              implementation=setup.implementation("norm"))  # fmt: skip
    if setup.mxfp8:
        out = norm_mxfp8_cast_transpose(x, gamma, beta, setup.fwd_dtype, block, **kw)
    else:
        out = norm_block_cast_transpose(x, gamma, beta, setup.fwd_dtype, block,
                                        power_2_scale=pow2, amax_epsilon=eps, **kw)  # fmt: skip
    return block_outputs(setup, *out)


def block_outputs(setup: Fp8Setup, q, s, q_t, s_t, *rest):
    """A block cast's outputs as the layers carry them: ``(q, q_t, (s, s_t), amax, *rest)``,
    MXFP8's E8M0 scales as their ``uint8`` bits, ``amax`` NaN (not observed)."""
    if setup.mxfp8:
        s, s_t = (jax.lax.bitcast_convert_type(v, jnp.uint8) for v in (s, s_t))
    return (q, q_t, (s, s_t), jnp.float32(jnp.nan), *rest)


def _rows(sinv: Any) -> jax.Array:
    """The scale of a tensor's row-wise copy (per-tensor: the one scale)."""
    return sinv[0] if isinstance(sinv, tuple) else sinv


def _cols(sinv: Any) -> jax.Array:
    """The scale of a tensor's transposed copy (per-tensor: the one scale)."""
    return sinv[1] if isinstance(sinv, tuple) else sinv


def _gemm(setup: Fp8Setup, a, a_sinv, b, b_sinv, *, roles, dtypes, out_dtype, bias=None,
          accumulate, reuse=None):  # fmt: skip
    """``a @ b.T`` of the K-major codes ``a`` [M, K] and ``b`` [N, K]: the FP8 GEMM
    (:func:`~fp8jax.ops.gemms.gemm.gemm_codes`), or under block scaling the block-scaled one with
    ``roles``' blocks (dequantize per block, float32 accumulation;
    :func:`~fp8jax.ops.block_gemm`: cuBLASLt on a GPU with the scale modes, else
    XLA's dequantize and float32 dot), or under row-wise scaling the dot of the FP8 values
    scaled by the outer product of the row scales (:func:`~fp8jax.ops.rowwise_gemm`: XLA,
    or cuBLASLt under ``gemm_options(rowwise_cublaslt=True)``), plus ``bias`` in float32."""
    if setup.blocks is None and setup.rowwise is None:
        return gemm_codes(
            a, b, a_sinv, b_sinv, dtypes=dtypes, out_dtype=out_dtype, bias=bias,
            accumulate=accumulate, reuse=reuse, implementation=setup.implementation("gemm"),
        )  # fmt: skip
    if setup.rowwise is not None:
        views = [jax.lax.bitcast_convert_type(c, dt) for c, dt in zip((a, b), dtypes, strict=True)]
        y = rowwise_gemm(views[0], a_sinv, views[1], b_sinv,
                         implementation=setup.implementation("gemm"))  # fmt: skip
        return (y if bias is None else y + bias.astype(jnp.float32)).astype(out_dtype)
    views, scales = [], []
    for codes_, sinv, dt in ((a, a_sinv, dtypes[0]), (b, b_sinv, dtypes[1])):
        views.append(jax.lax.bitcast_convert_type(codes_, dt))
        scales.append(
            jax.lax.bitcast_convert_type(sinv, jnp.float8_e8m0fnu) if setup.mxfp8 else sinv
        )
    (ba, _, _), (bb, _, _) = setup.block(roles[0]), setup.block(roles[1])
    y = block_gemm(views[0], scales[0], ba, views[1], scales[1], bb,
                   implementation=setup.implementation("gemm"))  # fmt: skip
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def named_input(q: jax.Array, q_t: jax.Array, sinv: jax.Array, amax: jax.Array):
    """A GEMM input cast to FP8 (``q`` [M, K] row-wise for the forward GEMM, ``q_t`` [K, M]
    for the wgrad, its inverse scale and amax) as it is kept: codes, checkpoint-named."""
    return named(codes(q), 2), named(codes(q_t), 0), named(sinv, 4), named(amax, 5)


class GemmResiduals(NamedTuple):
    """What one FP8 GEMM's backward reads of its forward (besides its input's transposed
    copy, which the caller produced): the kernel in both layouts (codes), its inverse scale."""

    w_q: jax.Array
    w_t: jax.Array
    w_sinv: jax.Array


def gemm_forward(
    setup: Fp8Setup,
    x_q: jax.Array,
    x_sinv: jax.Array,
    w: jax.Array,
    w_scale: jax.Array,
    bias: jax.Array | None,
    out_dtype: Any,
) -> tuple[jax.Array, jax.Array, GemmResiduals]:
    """``y = x @ w (+ bias)`` for ``x_q`` (codes, [M, K], row-wise) and the high-precision
    kernel ``w`` [K, N], which is cast here; returns ``(y, w's amax, residuals)``. One FP8 GEMM
    with fast accumulation; both backward GEMMs that use ``w_t`` see the very same value, so an
    FSDP gather of it is shared."""
    fwd = setup.fwd_dtype
    w_amax, res = cast_kernel(setup, w, w_scale)
    y = _gemm(
        setup, x_q, _rows(x_sinv), res.w_t, _cols(res.w_sinv), roles=("x", "w"),
        dtypes=(fwd, fwd), out_dtype=out_dtype, bias=bias, accumulate="fast",
    )  # fmt: skip
    return y, w_amax, res


def cast_kernel(setup: Fp8Setup, w: jax.Array, w_scale: jax.Array):
    """A GEMM's high-precision kernel ``w`` [K, N] cast for its three GEMMs (both layouts, as
    checkpoint-named codes) -> ``(w's amax, GemmResiduals)``."""
    w_q, w_t, w_sinv, w_amax = cast_t(setup, w, w_scale, setup.fwd_dtype, role="w")
    w_q, w_t = named(codes(w_q), 1), named(codes(w_t), 3)
    return named(w_amax, 5), GemmResiduals(w_q, w_t, named(w_sinv, 4))


def gemm_backward(
    setup: Fp8Setup,
    g_q: jax.Array,
    g_t: jax.Array,
    g_sinv: jax.Array,
    x_t: jax.Array,
    x_sinv: jax.Array,
    res: GemmResiduals,
    x_dtype: Any,
    w_dtype: Any,
) -> tuple[jax.Array, jax.Array]:
    """dgrad and wgrad of one FP8 GEMM from its cast output gradient (codes ``g_q`` [M, N] and
    ``g_t`` [N, M]) and its input's transposed copy ``x_t`` (codes, [K, M]), with split
    (full-precision) accumulation: ``dx = g @ w^T`` in ``x_dtype``, ``dw = x^T @ g`` in
    ``w_dtype``. Every GEMM gets K-major operands; under FSDP the dgrad reuses the forward
    GEMM's gathered ``w_t`` (transposed on each device, no second all-gather)."""
    fwd, bwd = setup.fwd_dtype, setup.bwd_dtype
    dx = _gemm(
        setup, g_q, _rows(g_sinv), res.w_q, _rows(res.w_sinv), roles=("grad", "w"),
        dtypes=(bwd, fwd), reuse=(res.w_t, x_t), out_dtype=x_dtype, accumulate="split",
    )  # fmt: skip
    return dx, gemm_wgrad(setup, g_t, g_sinv, x_t, x_sinv, w_dtype)


def gemm_wgrad(setup: Fp8Setup, g_t, g_sinv, x_t, x_sinv, w_dtype: Any) -> jax.Array:
    """The wgrad ``dw = x^T @ g`` in ``w_dtype`` of :func:`gemm_backward`, from the transposed
    codes ``g_t`` [N, M] and ``x_t`` [K, M], with split accumulation; with the high-precision
    wgrad (``setup.hp_wgrad``), ``g_t`` and ``x_t`` are the high-precision transposes and the
    wgrad a plain dot in their promoted dtype, accumulated in float32."""
    if setup.hp_wgrad:
        dt = jnp.promote_types(x_t.dtype, g_t.dtype)
        # under explicit sharding, sharded as the FP8 wgrad's rule gives it (a split M summed)
        spec = explicit_matmul_spec(x_t, g_t, b_rows_are_n=True) if explicit_mesh() else None
        dw = jax.lax.dot_general(x_t.astype(dt), g_t.astype(dt), (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32, out_sharding=spec)  # fmt: skip
        return dw.astype(w_dtype)
    return _gemm(
        setup, x_t, _cols(x_sinv), g_t, _cols(g_sinv), roles=("x", "grad"),
        dtypes=(setup.fwd_dtype, setup.bwd_dtype), out_dtype=w_dtype, accumulate="split",
    )  # fmt: skip


# ------------------------------------------------------------ grouped GEMMs, (hidden, g, N) kernels


def grouped_forward(s: Fp8Setup, x_q, x_sinv, w, scale, bias, dtype):
    """A layer's grouped GEMM ``y [M, g, N]`` from its input's FP8 codes ``x_q [M, hidden]``
    and the high-precision kernel ``w (hidden, g, N)``, cast here (one quantize; its transposed
    copy ``(g, N, hidden)`` a transpose of the codes) -> ``(y, w's amax, residuals)`` as
    :func:`gemm_forward`'s."""
    fwd = s.fwd_dtype
    if s.blocks is not None or s.rowwise is not None:  # the layers take the 2-D path then
        raise ValueError(f"{s.where}: a grouped GEMM has no block-scaled or row-wise form")
    q, sinv, amax = quantize(
        w, scale_for(s, w, scale, fwd), fwd, amax_reduction="mesh",
        implementation=s.implementation("cast"),
    )  # fmt: skip
    w_q = named(codes(q), 1)
    w_t = named(jnp.transpose(w_q, (1, 2, 0)), 3)
    sinv, amax = named(sinv, 4), named(amax, 5)
    y = fixed_groups.gemm_n(x_q, w_t, x_sinv, sinv, dtypes=(fwd, fwd), out_dtype=dtype, bias=bias,
               accumulate="fast")  # fmt: skip
    return y, amax, GemmResiduals(w_q, w_t, sinv)


def grouped_cast_grad(s: Fp8Setup, dy: jax.Array, scale: jax.Array, with_bias: bool):
    """The output gradient ``dy [M, g, N]`` cast to the backward format -> ``(codes [M, g, N],
    transposed codes [g, N, M], scale_inv, amax, dbias [g, N] (float32) or None)``: one fused
    kernel (:func:`~fp8jax.ops.casts.cast_transpose.grouped_cast_transpose_dbias`), or under
    explicit sharding (where its global view is not allowed) a quantize, an XLA transpose of
    the codes and a float32 column sum."""
    bwd, impl = s.bwd_dtype, s.implementation("cast")
    scale = scale_for(s, dy, scale, bwd)
    if not explicit_mesh():
        q, q_t, sinv, amax, dbias = grouped_cast_transpose_dbias(
            dy, scale, bwd, amax_reduction="mesh", implementation=impl
        )
        return codes(q), codes(q_t), sinv, amax, (dbias if with_bias else None)
    q, sinv, amax = quantize(dy, scale, bwd, amax_reduction="mesh", implementation=impl)
    q = codes(q)
    dbias = jnp.sum(dy.astype(jnp.float32), axis=0) if with_bias else None
    return q, jnp.transpose(q, (1, 2, 0)), sinv, amax, dbias


def grouped_backward(s: Fp8Setup, g_q, g_t, g_sinv, x_t, x_sinv, res, x_dt, w_dt):
    """dgrad ``[M, hidden]`` and wgrad ``(hidden, g, N)`` of :func:`grouped_forward` from the output
    gradient's codes ``g_q [M, g, N]`` and ``g_t [g, N, M]``."""
    fwd, bwd = s.fwd_dtype, s.bwd_dtype
    dx = fixed_groups.gemm_k(
        g_q, res.w_q, g_sinv, res.w_sinv, dtypes=(bwd, fwd), out_dtype=x_dt,
        reuse=(res.w_t, x_t),
    )  # fmt: skip
    dw = fixed_groups.gemm_n(
        x_t, g_t, x_sinv, g_sinv, dtypes=(fwd, bwd), out_dtype=w_dt, accumulate="split"
    )
    return dx, dw
