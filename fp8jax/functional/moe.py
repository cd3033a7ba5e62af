"""``fp8jax.moe``: a mixture-of-experts block's routed experts, in FP8.

The steps, for tokens ``x [T, H]`` (already normalised):

1. **Router**, in float32 whatever the recipe: ``logits = x @ gate_kernel``; scores by
   ``softmax`` (over all experts, or with ``use_pre_softmax=False`` over the chosen ``k`` only)
   or ``sigmoid`` (the chosen ``k`` renormalised to sum to 1 when ``k > 1``); the top ``k``
   experts per token, optionally group-limited (DeepSeek-V3: experts in ``num_groups`` groups,
   a token's experts from its ``group_topk`` best groups, a group ranked by the sum of its best
   ``k // group_topk`` scores), with ``expert_bias`` (sigmoid only) added for the choice alone;
   the weights times ``scaling_factor``. TransformerEngine's ``fused_topk_with_score_function``
   semantics.
2. **Dispatch** (sort-based, dropless): the ``T k`` (token, expert) assignments sorted by expert
   with a stable sort, so each expert's rows are in token order; ``group_sizes [E]`` counts
   them. With ``capacity_factor``, an expert keeps its first ``ceil(T k / E * capacity_factor)``
   assignments and the rest move past the sum (they get no expert output).
3. **Experts**: a gated MLP per expert on the grouped GEMM (:func:`fp8jax.grouped_dense`):
   ``act(x wi_0[e]) * (x wi_1[e]) -> wo[e]``, the two input kernels as one ``[E, H, 2 I]``
   GEMM. The FP8 state: one GEMM triple per expert and GEMM, ``moe_roles(E)`` (6 E rows).
4. **Combine**: each assignment's output back to its token, weighted by its routing weight, in
   float32.
5. **Losses**: the load-balancing loss (TE's ``fused_moe_aux_loss``: ``E * coeff / (k T^2)
   * sum_e P_e f_e``, ``P_e`` the summed softmax (or normalised sigmoid) scores of expert ``e``
   over all experts, ``f_e`` its assignment count) and the router z-loss (ST-MoE:
   ``coeff * mean_t logsumexp(logits_t)^2``).

**Expert parallelism** (``expert_axis``, with a mesh set by ``jax.set_mesh``): the tokens are
split over ``data_parallelism_axes + (expert_axis,)``, the experts over ``expert_axis``; one
``shard_map`` runs steps 1-5 on each device's tokens, with an ``all_to_all`` each way
(:mod:`fp8jax.functional._exchange`): FP8 codes and their scales go to the experts (the input's
in the forward pass, the output gradient's in the backward pass), the experts' outputs (and the
input gradient) come back in high precision. Routing statistics (the capacity's positions, the
losses' sums) are taken over all devices, so a mesh computes what one device computes.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.functional import _exchange
from fp8jax.functional.grouped_dense import grouped_dense_observed, grouped_roles
from fp8jax.ops.base.partition import explicit_mesh
from fp8jax.state import Fp8Meta

__all__ = [
    "MOE_ACTIVATIONS",
    "MoEOutput",
    "combine",
    "dispatch",
    "moe",
    "moe_losses",
    "moe_roles",
    "route",
]

#: The experts' gated activations by TransformerEngine's ``activation_type`` name.
MOE_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_exact": functools.partial(jax.nn.gelu, approximate=False),
    "relu": jax.nn.relu,
}
SCORE_FUNCTIONS = ("softmax", "sigmoid")


def moe_roles(num_experts: int) -> tuple[str, ...]:
    """The FP8 state rows of an MoE block's routed experts: ``wi``'s triple per expert, then
    ``wo``'s (``6 E`` rows)."""
    return tuple(f"wi/{r}" for r in grouped_roles(num_experts)) + tuple(
        f"wo/{r}" for r in grouped_roles(num_experts)
    )


class MoEOutput(NamedTuple):
    """What :func:`moe` returns: the output ``[T, H]``, the load-balancing loss and the z-loss
    (float32 scalars, already times their coefficients; 0 when the coefficient is 0) and the
    forward observations (``float32[6 E]``; ``None`` with FP8 off)."""

    out: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array
    observed: jax.Array | None


# ------------------------------------------------------------------ router


def _group_limited(scores: jax.Array, k: int, num_groups: int, group_topk: int) -> jax.Array:
    """``scores`` with the experts outside each token's ``group_topk`` best groups at -inf."""
    t, e = scores.shape
    grouped = scores.reshape(t, num_groups, e // num_groups)
    best = jax.lax.top_k(grouped, k // group_topk)[0].sum(axis=-1)
    _, chosen = jax.lax.top_k(best, group_topk)
    keep = jnp.zeros((t, num_groups), bool).at[jnp.arange(t)[:, None], chosen].set(True)
    keep = jnp.repeat(keep, e // num_groups, axis=1)
    return jnp.where(keep, scores, -jnp.inf)


def route(
    logits: jax.Array,
    num_experts_per_tok: int,
    *,
    score_function: str = "softmax",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float = 1.0,
    expert_bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The router's choice from float32 ``logits [T, E]``: ``(weights [T, k] float32, experts
    [T, k] int32)`` (see the module docstring, step 1).

    >>> import jax.numpy as jnp
    >>> w, e = route(jnp.log(jnp.array([[0.1, 0.6, 0.3]])), 2)
    >>> e.tolist(), [round(v, 4) for v in w[0].tolist()]  # softmax over the chosen two
    ([[1, 2]], [0.6667, 0.3333])
    """
    k = num_experts_per_tok
    logits = logits.astype(jnp.float32)
    if score_function == "softmax":
        scores = jax.nn.softmax(logits, axis=-1) if use_pre_softmax else logits
    else:
        scores = jax.nn.sigmoid(logits)
    choice = scores if expert_bias is None else scores + expert_bias.astype(jnp.float32)
    if num_groups:
        choice = _group_limited(choice, k, num_groups, group_topk)
    _, experts = jax.lax.top_k(choice, k)
    chosen = jnp.take_along_axis(scores, experts, axis=-1)
    if score_function == "softmax":
        weights = chosen if use_pre_softmax else jax.nn.softmax(chosen, axis=-1)
    else:
        weights = chosen / (chosen.sum(axis=-1, keepdims=True) + 1e-20) if k > 1 else chosen
    return weights * np.float32(scaling_factor), experts.astype(jnp.int32)


def moe_losses(
    logits: jax.Array,
    experts: jax.Array,
    *,
    score_function: str,
    aux_loss_coeff: float,
    z_loss_coeff: float,
    axes: tuple[str, ...] = (),
) -> tuple[jax.Array, jax.Array]:
    """``(aux_loss, z_loss)`` of the router (module docstring, step 5); ``axes``: the mesh axes
    the tokens are split over (inside a ``shard_map``), whose devices' sums are added."""
    t, e = logits.shape
    k = experts.shape[1]
    total = lambda v: jax.lax.psum(v, axes) if axes else v
    n_tokens = t * math.prod(jax.lax.axis_size(a) for a in axes) if axes else t
    zero = jnp.zeros((), jnp.float32)
    aux = zero
    if aux_loss_coeff:
        if score_function == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
            if k > 1:
                scores = scores / (scores.sum(axis=-1, keepdims=True) + 1e-20)
        counts = jnp.zeros((e,), jnp.float32).at[experts.reshape(-1)].add(1.0)
        p = total(scores.sum(axis=0))
        f = jax.lax.stop_gradient(total(counts))
        aux = jnp.sum(p * f) * np.float32(e * aux_loss_coeff / (k * n_tokens * n_tokens))
    z = zero
    if z_loss_coeff:
        lse = jax.nn.logsumexp(logits, axis=-1)
        z = total(jnp.sum(lse * lse)) * np.float32(z_loss_coeff / n_tokens)
    return aux, z


# ------------------------------------------------------------------ dispatch and combine


class Dispatch(NamedTuple):
    """The sort of a layer's ``T k`` assignments by expert."""

    order: jax.Array  # int32 [T k]: the assignment (token * k + slot) in each sorted row
    group_sizes: jax.Array  # int32 [E]: the kept assignments per expert


def dispatch(
    experts: jax.Array, num_experts: int, capacity: int | None = None, offsets: Any = None
) -> Dispatch:
    """The sorted order of the assignments ``experts [T, k]`` (step 2 of the module
    docstring); ``capacity``: rows kept per expert (``None``: all). ``offsets [E]``: the
    assignments of each expert that come before these tokens (other devices' under expert
    parallelism), which count against the capacity.

    >>> import jax.numpy as jnp
    >>> d = dispatch(jnp.array([[1, 0], [1, 2]]), 3)
    >>> d.order.tolist(), d.group_sizes.tolist()
    ([1, 0, 2, 3], [1, 2, 1])
    """
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    if capacity is None:
        return Dispatch(order, counts)
    sorted_e = flat[order]
    starts = jnp.cumsum(counts) - counts
    before = jnp.zeros((num_experts,), jnp.int32) if offsets is None else offsets
    pos = jnp.arange(flat.shape[0], dtype=jnp.int32) - starts[sorted_e] + before[sorted_e]
    keep = pos < capacity
    again = jnp.argsort(jnp.where(keep, sorted_e, num_experts), stable=True)
    kept = jnp.zeros((num_experts,), jnp.int32).at[sorted_e].add(keep.astype(jnp.int32))
    return Dispatch(order[again], kept)


def combine(y_sorted: jax.Array, d: Dispatch, weights: jax.Array, dtype: Any) -> jax.Array:
    """Each sorted row's output back to its token, weighted (step 4): ``[T, H]`` in ``dtype``."""
    t, k = weights.shape
    per = jnp.zeros_like(y_sorted).at[d.order].set(y_sorted, unique_indices=True)
    per = per.reshape(t, k, -1).astype(jnp.float32)
    return jnp.einsum("tk,tkh->th", weights.astype(jnp.float32), per).astype(dtype)


def capacity_of(tokens: int, k: int, num_experts: int, capacity_factor: float | None) -> int | None:
    """Rows per expert with ``capacity_factor`` (``None``: dropless)."""
    if capacity_factor is None:
        return None
    return max(1, math.ceil(tokens * k / num_experts * capacity_factor))


# ------------------------------------------------------------------ the experts


class _Fp8(NamedTuple):
    meta: Fp8Meta | None
    recipe: Any
    enabled: bool | None
    probe: jax.Array | None


def _split(fp8: _Fp8, n_experts: int) -> tuple[_Fp8, _Fp8]:
    """The state and probe rows of ``wi`` and of ``wo``."""
    rows = 3 * n_experts

    def part(i):
        meta = (
            None
            if fp8.meta is None
            else Fp8Meta(
                fp8.meta.amax_history[i * rows : (i + 1) * rows],
                fp8.meta.scale[i * rows : (i + 1) * rows],
            )
        )
        probe = None if fp8.probe is None else fp8.probe[i * rows : (i + 1) * rows]
        return _Fp8(meta, fp8.recipe, fp8.enabled, probe)

    return part(0), part(1)


def experts_ffn(
    x,
    sizes,
    params,
    fp8: _Fp8,
    *,
    activation_type,
    dtype,
    where,
    n_experts,
    exchange=None,
    plan=None,
):
    """The gated expert MLP on dispatched rows (step 3): ``(y, observed or None)``. With an
    exchange, ``x`` and ``y`` are on the token side, ``sizes`` the expert side's."""
    # the gated pair as one GEMM [E, H, 2 I]; in FP8 its halves are cast apart and only their
    # codes concatenated (grouped_dense's kernel pair), never the high-precision kernels
    wi = (params["wi_0"], params["wi_1"])
    bi = None
    if params.get("wi_0_bias") is not None:
        bi = jnp.concatenate([params["wi_0_bias"], params["wi_1_bias"]], axis=-1)
    fp8_i, fp8_o = _split(fp8, n_experts)
    kw = dict(dtype=dtype, exchange=exchange, plan=plan, n_experts=n_experts)
    h = grouped_dense_observed(
        x,
        wi,
        sizes,
        bi,
        fp8_i.meta,
        fp8_i.recipe,
        probe=fp8_i.probe,
        enabled=fp8_i.enabled,
        where=f"{where} (wi)",
        exchange_input=True,
        **kw,
    )
    inter = params["wi_0"].shape[-1]
    a = MOE_ACTIVATIONS[activation_type](h.out[:, :inter]) * h.out[:, inter:]
    y = grouped_dense_observed(
        a.astype(dtype),
        params["wo"],
        sizes,
        params.get("wo_bias"),
        fp8_o.meta,
        fp8_o.recipe,
        probe=fp8_o.probe,
        enabled=fp8_o.enabled,
        where=f"{where} (wo)",
        exchange_input=False,
        **kw,
    )
    seen = None if h.observed is None else jnp.concatenate([h.observed, y.observed])
    return y.out, seen


class MoEConfig(NamedTuple):
    """The static settings of :func:`moe` (hashable)."""

    num_experts: int
    num_experts_per_tok: int
    activation_type: str = "silu"
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float = 1.0
    capacity_factor: float | None = None
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    expert_axis: str | None = None
    data_parallelism_axes: tuple[str, ...] = ()


def _local_moe(cfg: MoEConfig, x, params, fp8: _Fp8, dtype, where, axes=()):
    """Steps 1-5 on one device's tokens (``axes``: the token-splitting mesh axes, inside a
    ``shard_map``; the experts' axis is ``cfg.expert_axis``)."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    logits = jnp.matmul(
        x.astype(jnp.float32),
        params["gate_kernel"].astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    weights, experts = route(
        logits,
        k,
        score_function=cfg.score_function,
        use_pre_softmax=cfg.use_pre_softmax,
        num_groups=cfg.num_groups,
        group_topk=cfg.group_topk,
        scaling_factor=cfg.scaling_factor,
        expert_bias=params.get("expert_bias"),
    )
    aux, z = moe_losses(
        logits,
        experts,
        score_function=cfg.score_function,
        aux_loss_coeff=cfg.aux_loss_coeff,
        z_loss_coeff=cfg.z_loss_coeff,
        axes=axes,
    )
    n_tokens = x.shape[0] * (math.prod(jax.lax.axis_size(a) for a in axes) if axes else 1)
    capacity = capacity_of(n_tokens, k, e, cfg.capacity_factor)
    offsets = None
    if capacity is not None and cfg.expert_axis is not None:
        # the tokens' global order runs over every token axis (data-major), not the experts'
        offsets = _exchange.earlier_counts(experts, e, axes)
    d = dispatch(experts, e, capacity, offsets)
    rows = jnp.take(x, d.order // k, axis=0)
    if cfg.expert_axis is None:
        y, seen = experts_ffn(
            rows,
            d.group_sizes,
            params,
            fp8,
            activation_type=cfg.activation_type,
            dtype=dtype,
            where=where,
            n_experts=e,
        )
    else:
        ex, plan = _exchange.exchange_plan(
            cfg.expert_axis, cfg.data_parallelism_axes, d.group_sizes, rows.shape[0], capacity
        )
        y, seen = experts_ffn(
            rows,
            plan.sizes_experts,
            params,
            fp8,
            activation_type=cfg.activation_type,
            dtype=dtype,
            where=where,
            n_experts=e,
            exchange=ex,
            plan=plan,
        )
    return combine(y, d, weights, dtype), aux, z, seen


def moe(
    x: jax.Array,
    params: dict[str, jax.Array | None],
    config: MoEConfig,
    *,
    fp8_meta: Fp8Meta | None = None,
    recipe: Any = None,
    probe: jax.Array | None = None,
    enabled: bool | None = None,
    dtype: Any = None,
    where: str = "fp8jax.moe",
) -> MoEOutput:
    """The routed experts of an MoE block on ``x [T, H]`` (see the module docstring).

    ``params``: ``gate_kernel [H, E]``, ``wi_0``, ``wi_1`` ``[E, H, I]``, ``wo [E, I, H]``,
    optionally ``wi_0_bias``, ``wi_1_bias`` ``[E, I]``, ``wo_bias [E, H]`` and ``expert_bias
    [E]``. FP8 as for :func:`fp8jax.dense` (``fp8_meta``, ``probe``: the ``6 E`` rows of
    :func:`moe_roles`).
    """
    _check(where, x, params, config)
    dtype = jnp.dtype(dtype or jnp.result_type(x, params["wi_0"]))
    fp8 = _Fp8(fp8_meta, recipe, enabled, probe)
    if config.expert_axis is not None:
        local = lambda x, p, f, axes: _local_moe(config, x, p, f, dtype, where, axes)
        return MoEOutput(*_exchange.expert_parallel(local, config, x, params, fp8, where))
    if not explicit_mesh():
        return MoEOutput(*_local_moe(config, x, params, fp8, dtype, where))

    # Explicit axes (jax.make_mesh's default) refuse the dispatch's sort of every token on a
    # split token dim: traced with automatic axes, as on a jax.sharding.Mesh (XLA gathers what
    # the sort needs), the output laid out as the input; an absent output travels as [0].
    def local(x, params, meta, probe):
        inner = _Fp8(meta, fp8.recipe, fp8.enabled, probe)
        outs = _local_moe(config, x, params, inner, dtype, where)
        return tuple(jnp.zeros((0,), jnp.float32) if o is None else o for o in outs)

    P = jax.sharding.PartitionSpec
    spec = (jax.typeof(x).sharding.spec, P(), P(), P())
    outs = jax.sharding.auto_axes(local, out_sharding=spec)(x, params, fp8.meta, fp8.probe)
    return MoEOutput(*(None if o.shape == (0,) else o for o in outs))


def _check(where: str, x: Any, params: dict[str, Any], cfg: MoEConfig) -> None:
    """The input's and the params' shapes, each mismatch a ValueError naming the argument."""
    if not hasattr(x, "shape") or len(x.shape) != 2:
        raise ValueError(f"{where}: x must be [tokens, hidden], got shape {getattr(x, 'shape', x)}")
    hidden, e = x.shape[1], cfg.num_experts
    for name in ("gate_kernel", "wi_0", "wi_1", "wo"):
        if params.get(name) is None:
            raise ValueError(f"{where}: params must hold {name!r}")
    width = params["gate_kernel"].shape[0]
    if width != hidden:
        raise ValueError(
            f"{where}: the inputs' last dim is {hidden}, but the params are for width {width} "
            f"(gate_kernel {tuple(params['gate_kernel'].shape)})"
        )
    inter = params["wi_0"].shape[-1]
    want = {
        "gate_kernel": (hidden, e),
        "wi_0": (e, hidden, inter),
        "wi_1": (e, hidden, inter),
        "wo": (e, inter, hidden),
        "wi_0_bias": (e, inter),
        "wi_1_bias": (e, inter),
        "wo_bias": (e, hidden),
        "expert_bias": (e,),
    }
    for name, shape in want.items():
        value = params.get(name)
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(
                f"{where}: params[{name!r}] must have shape {shape} (width {hidden}, {e} "
                f"experts, expert width {inter}), got {tuple(value.shape)}"
            )
