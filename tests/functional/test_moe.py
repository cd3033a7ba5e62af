"""fp8jax.moe: the router (TransformerEngine's ``fused_topk_with_score_function`` semantics, against
a numpy oracle), the sort-based dispatch and combine, the router losses, and the whole routed
block against a dense per-expert loop (FP8 off) and within FP8's bounds (FP8 on)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import rand

import fp8jax
from fp8jax.functional.moe import MoEConfig, capacity_of, combine, dispatch, moe_losses, route

pytestmark = pytest.mark.usefixtures("float32_matmuls")


def _softmax(v):
    e = np.exp(v - v.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _route_oracle(logits, k, score, pre, groups, group_topk, factor, bias):
    """TE's reference, row by row in numpy (float64)."""
    logits = np.asarray(logits, np.float64)
    t, e = logits.shape
    weights, experts = np.zeros((t, k)), np.zeros((t, k), int)
    for i in range(t):
        if score == "softmax":
            s = _softmax(logits[i]) if pre else logits[i]
        else:
            s = 1 / (1 + np.exp(-logits[i]))
        choice = s + (0 if bias is None else np.asarray(bias))
        if groups:
            per = e // groups
            best = np.sort(choice.reshape(groups, per), -1)[:, -(k // group_topk) :].sum(-1)
            keep = np.argsort(-best, kind="stable")[:group_topk]
            choice = np.where(np.repeat(np.isin(np.arange(groups), keep), per), choice, -np.inf)
        idx = np.argsort(-choice, kind="stable")[:k]
        chosen = s[idx]
        if score == "softmax":
            w = chosen if pre else _softmax(chosen)
        else:
            w = chosen / (chosen.sum() + 1e-20) if k > 1 else chosen
        weights[i], experts[i] = w * factor, idx
    return weights, experts


ROUTERS = {
    "softmax-post": dict(score="softmax", pre=False),
    "softmax-pre": dict(score="softmax", pre=True),
    "sigmoid": dict(score="sigmoid", pre=False),
    "sigmoid-bias-groups": dict(score="sigmoid", pre=False, groups=4, group_topk=2, bias=True),
    "softmax-groups-scaled": dict(score="softmax", pre=True, groups=2, group_topk=1, factor=2.5),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_router_is_tes_topk_with_score_function(name):
    opt = {**dict(groups=None, group_topk=None, factor=1.0, bias=None), **ROUTERS[name]}
    e, k = 8, 2
    logits = rand((32, e), 0, 2.0)
    bias = rand((e,), 1, 0.3) if opt["bias"] else None
    w, idx = route(
        logits,
        k,
        score_function=opt["score"],
        use_pre_softmax=opt["pre"],
        num_groups=opt["groups"],
        group_topk=opt["group_topk"],
        scaling_factor=opt["factor"],
        expert_bias=bias,
    )
    ww, wi = _route_oracle(
        logits, k, opt["score"], opt["pre"], opt["groups"], opt["group_topk"], opt["factor"], bias
    )
    np.testing.assert_array_equal(idx, wi)
    np.testing.assert_allclose(w, ww, rtol=2e-6, atol=1e-7)


def test_dispatch_sorts_by_expert_in_token_order_and_combine_inverts_it():
    experts = jnp.asarray([[2, 0], [0, 1], [2, 1], [0, 2]], jnp.int32)
    d = dispatch(experts, 4)
    assert d.group_sizes.tolist() == [3, 2, 3, 0]
    assert (d.order // 2).tolist() == [0, 1, 3, 1, 2, 0, 2, 3]  # tokens, expert by expert
    y = jnp.arange(8.0)[d.order].reshape(8, 1)  # row r carries its assignment's number
    out = combine(y, d, jnp.ones((4, 2)), jnp.float32)
    np.testing.assert_array_equal(out[:, 0], [1.0, 5.0, 9.0, 13.0])  # 2t + 2t + 1


def test_capacity_drops_the_last_tokens_of_a_full_expert():
    experts = jnp.asarray([[0, 1], [0, 1], [0, 2], [0, 1]], jnp.int32)
    assert capacity_of(4, 2, 4, 1.0) == 2
    d = dispatch(experts, 4, capacity=2)
    assert d.group_sizes.tolist() == [2, 2, 1, 0]
    assert (d.order[:5] // 2).tolist() == [0, 1, 0, 1, 2]
    assert sorted((d.order[5:] // 2).tolist()) == [2, 3, 3]  # past the sum: dropped
    d2 = dispatch(experts, 4, capacity=2, offsets=jnp.asarray([1, 0, 0, 0], jnp.int32))
    assert d2.group_sizes.tolist() == [1, 2, 1, 0]  # one of expert 0's places taken before


def test_router_losses_are_tes_aux_loss_and_the_z_loss():
    logits = rand((16, 4), 2, 3.0)
    _, experts = route(logits, 2)
    aux, z = moe_losses(
        logits, experts, score_function="softmax", aux_loss_coeff=0.01, z_loss_coeff=0.001
    )
    p = _softmax(np.asarray(logits, np.float64)).sum(0)
    f = np.bincount(np.asarray(experts).ravel(), minlength=4)
    want_aux = (p * f).sum() * 4 * 0.01 / (2 * 16 * 16)
    lse = np.log(np.exp(np.asarray(logits, np.float64)).sum(-1))
    np.testing.assert_allclose(aux, want_aux, rtol=1e-5)
    np.testing.assert_allclose(z, 0.001 * np.mean(lse**2), rtol=1e-5)


def _params(h=16, e=4, i=8, seed=0):
    return {
        "gate_kernel": rand((h, e), seed, 0.5),
        "wi_0": rand((e, h, i), seed + 1, 0.3),
        "wi_1": rand((e, h, i), seed + 2, 0.3),
        "wo": rand((e, i, h), seed + 3, 0.3),
    }


def _dense_loop(x, p, k, activation=jax.nn.silu):
    """Every expert on every token, masked by the routing: an independent reference."""
    w, idx = route(jnp.dot(x, p["gate_kernel"], precision="highest"), k)
    out = jnp.zeros_like(x)
    for e in range(p["wi_0"].shape[0]):
        h = activation(x @ p["wi_0"][e]) * (x @ p["wi_1"][e])
        weight = jnp.sum(jnp.where(idx == e, w, 0.0), axis=1)
        out = out + weight[:, None] * (h @ p["wo"][e])
    return out


def test_routed_block_is_the_dense_loop_with_fp8_off():
    x, p = rand((24, 16), 9), _params()
    got = fp8jax.moe(x, p, MoEConfig(num_experts=4, num_experts_per_tok=2), enabled=False)
    np.testing.assert_allclose(got.out, _dense_loop(x, p, 2), rtol=1e-5, atol=1e-6)
    assert got.observed is None and float(got.aux_loss) == 0 and float(got.z_loss) == 0


@pytest.mark.parametrize(
    "recipe",
    [
        fp8jax.Float8CurrentScaling(),
        fp8jax.Float8BlockScaling(),
        fp8jax.MXFP8BlockScaling(),
        fp8jax.Float8RowwiseScaling(),
        fp8jax.Float8RowwiseScaling(wgrad_high_precision=True),
    ],
    ids=["current", "block", "mxfp8", "rowwise", "rowwise-hp-wgrad"],
)
def test_routed_block_in_fp8_is_close_to_fp8_off(recipe):
    x, p = rand((24, 16), 10), _params(seed=4)
    cfg = MoEConfig(num_experts=4, num_experts_per_tok=2)
    off = fp8jax.moe(x, p, cfg, enabled=False).out
    on = fp8jax.moe(x, p, cfg, recipe=recipe).out
    # two E4M3 GEMMs and an E4M3 cast between: a few percent, normwise
    assert float(jnp.linalg.norm(on - off)) <= 0.15 * float(jnp.linalg.norm(off))
    assert float(jnp.linalg.norm(on - off)) > 0  # really FP8
