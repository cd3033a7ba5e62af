"""fp8jax.flax.dense: DenseGeneral, Fp8DotGeneral and Fp8Einsum against their plain-Flax twins.

Tolerances, from the formats' finfo (ml_dtypes):

- representable inputs (x and kernel survive the cast with scale 1): FP8 products are exact in
  float32, so FP8 and float32 differ only by summation order: 1e-4 relative (the TE tutorial).
- random inputs: a quantized value q/s is within ``max(u |v|, h / s)`` of v, with u = eps/2 the
  unit roundoff (2**-4 for E4M3, 2**-3 for E5M2) and h = smallest_subnormal/2 (2**-10, 2**-17),
  the worst rounding in the subnormal range. For a bilinear layer f(x, w) that gives the
  elementwise bound ``f(bx, |w|) + f(|x|, bw) + f(bx, bw)`` (bx, bw the per-element bounds), plus
  float32 accumulation slack; the same with the output gradient for dgrad and wgrad.
"""

from __future__ import annotations

import re

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _shared import rand
from conftest import requires_cuda

import fp8jax
from fp8jax import DelayedScaling, Float8CurrentScaling
from fp8jax.flax import DenseGeneral, Fp8DotGeneral, Fp8Einsum
from fp8jax.functional.dense import CHECKPOINT_NAMES

pytestmark = pytest.mark.usefixtures("float32_matmuls")

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
RECIPE = DelayedScaling(amax_history_len=4)


def _finfo(dt):
    fi = ml_dtypes.finfo(dt)
    return float(fi.eps) / 2, float(fi.smallest_subnormal) / 2


U4, H4 = _finfo(ml_dtypes.float8_e4m3fn)  # 2**-4, 2**-10
U5, H5 = _finfo(ml_dtypes.float8_e5m2)  # 2**-3, 2**-17
F32_EPS = float(np.finfo(np.float32).eps)


def _init(model, *args, recipe=RECIPE, enabled=True):
    with fp8jax.autocast(enabled=enabled, recipe=recipe):
        return model.init(jax.random.key(0), *args)


def _apply(model, variables, *args, recipe=RECIPE, enabled=True):
    with fp8jax.autocast(enabled=enabled, recipe=recipe):
        return model.apply(variables, *args)


class _EinsumLayer(nn.Module):
    """A weight contracted with jnp.einsum (twin) or Fp8Einsum."""

    equation: str
    shape: tuple[int, ...]
    fp8: bool = True

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.5), self.shape)
        if self.fp8:
            return Fp8Einsum()(self.equation, x, w)
        return jnp.einsum(self.equation, x, w)


def _dense_general_case():
    kw = dict(features=(6, 4), axis=(-2, -1))
    return DenseGeneral(**kw), nn.DenseGeneral(**kw), (8, 5, 12), "kernel"


def _cases():
    """(name, FP8 module, plain-Flax twin, input shape, name of the weight param)."""
    return {
        "DenseGeneral": _dense_general_case(),
        "Dense+Fp8DotGeneral": (
            nn.Dense(16, dot_general_cls=Fp8DotGeneral),
            nn.Dense(16),
            (2, 8, 24),
            "kernel",
        ),
        "DenseGeneral+Fp8DotGeneral": (
            nn.DenseGeneral((4, 4), axis=(-2, -1), dot_general_cls=Fp8DotGeneral),
            nn.DenseGeneral((4, 4), axis=(-2, -1)),
            (8, 3, 16),
            "kernel",
        ),
        "Einsum btd,dnh->btnh": (
            _EinsumLayer("btd,dnh->btnh", (24, 2, 8)),
            _EinsumLayer("btd,dnh->btnh", (24, 2, 8), fp8=False),
            (2, 8, 24),
            "w",
        ),
        "Einsum bsnh,nhd->bsd": (
            _EinsumLayer("bsnh,nhd->bsd", (2, 8, 12)),
            _EinsumLayer("bsnh,nhd->bsd", (2, 8, 12), fp8=False),
            (2, 4, 2, 8),
            "w",
        ),
        "Einsum ...d,fd->...f": (
            _EinsumLayer("...d,fd->...f", (12, 24)),
            _EinsumLayer("...d,fd->...f", (12, 24), fp8=False),
            (3, 4, 24),
            "w",
        ),
        "Einsum btd,dh->bht": (
            _EinsumLayer("btd,dh->bht", (24, 6)),
            _EinsumLayer("btd,dh->bht", (24, 6), fp8=False),
            (2, 8, 24),
            "w",
        ),
    }


CASES = _cases()


def _bilinear(twin, params, wname):
    """The twin as f(x, w) without its bias: linear in each argument."""

    def f(x, w):
        p = {**params, wname: w}
        if "bias" in p:
            p["bias"] = jnp.zeros_like(p["bias"])
        return twin.apply({"params": p}, x)

    return f


# ------------------------------------------------------------------------ variables and params


def test_init_creates_fp8_collections_and_flax_params():
    x = rand((2, 3, 6, 7), 0)
    ours = _init(DenseGeneral(features=(4, 5), axis=(1, -1)), x)
    theirs = nn.DenseGeneral(features=(4, 5), axis=(1, -1)).init(jax.random.key(0), x)
    assert set(ours) == {"params", "fp8_meta", "fp8_probe"}
    shapes = jax.tree.map(jnp.shape, ours)
    assert shapes["params"] == {"kernel": (3, 7, 4, 5), "bias": (4, 5)}
    assert shapes["fp8_meta"] == {"amax_history": (3, 4), "scale": (3,)}
    assert shapes["fp8_probe"] == {"call_0": (3,)}
    np.testing.assert_array_equal(ours["fp8_meta"]["amax_history"], np.zeros((3, 4)))
    np.testing.assert_array_equal(ours["fp8_meta"]["scale"], np.ones(3))
    # same tree, same values as Flax's own DenseGeneral for the same key
    jax.tree.map(np.testing.assert_array_equal, ours["params"], theirs["params"])


@pytest.mark.parametrize(
    "ctx",
    [
        lambda: fp8jax.autocast(enabled=False, recipe=RECIPE),
        lambda: fp8jax.autocast(enabled=True, recipe=Float8CurrentScaling()),
        None,
    ],
    ids=["disabled", "current_scaling", "outside_autocast"],
)
def test_no_fp8_variables_when_not_needed(ctx):
    x = rand((4, 8), 1)
    model = DenseGeneral(features=3)
    if ctx is None:
        variables = model.init(jax.random.key(0), x)
    else:
        with ctx():
            variables = model.init(jax.random.key(0), x)
    assert set(variables) == {"params"}


def test_checkpoint_of_flax_dense_general_loads():
    x = rand((4, 5, 6), 2)
    flax_model = nn.DenseGeneral(features=(3, 2), axis=(-2, -1))
    ckpt = flax_model.init(jax.random.key(7), x)  # a plain-Flax checkpoint
    model = DenseGeneral(features=(3, 2), axis=(-2, -1))
    fresh = _init(model, x)
    assert jax.tree.structure(fresh["params"]) == jax.tree.structure(ckpt["params"])
    assert jax.tree.map(jnp.shape, fresh["params"]) == jax.tree.map(jnp.shape, ckpt["params"])
    y_ref = flax_model.apply(ckpt, x)
    y_off = model.apply(ckpt, x)  # FP8 off: no FP8 variables needed
    np.testing.assert_allclose(y_off, y_ref, rtol=1e-6, atol=1e-6)
    variables = {**fresh, "params": ckpt["params"]}
    y_fp8 = _apply(model, variables, x)
    assert y_fp8.shape == y_ref.shape
    assert float(jnp.max(jnp.abs(y_fp8 - y_ref))) < 0.1 * float(jnp.max(jnp.abs(y_ref)))


# ------------------------------------------------------------------------ numerics vs twins


@pytest.mark.parametrize("name", list(CASES))
def test_disabled_is_identical_to_twin(name):
    fp8_model, twin, shape, _ = CASES[name]
    x = rand(shape, 3)
    params = twin.init(jax.random.key(1), x)["params"]
    for enabled in (False, None):
        if enabled is None:
            y = fp8_model.apply({"params": params}, x)  # outside autocast
        else:
            y = _apply(fp8_model, {"params": params}, x, enabled=False)
        y_ref = twin.apply({"params": params}, x)
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(y, y_ref)
        else:  # a GPU may pick another float32 (TF32) algorithm for the 2-D form of the dot
            np.testing.assert_allclose(y, y_ref, rtol=1e-2, atol=1e-2 * float(jnp.max(y_ref)))
    g = jax.grad(lambda p: jnp.sum(fp8_model.apply({"params": p}, x) ** 2))(params)
    g_ref = jax.grad(lambda p: jnp.sum(twin.apply({"params": p}, x) ** 2))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g, g_ref)


@pytest.mark.parametrize("name", list(CASES))
def test_representable_inputs_agree_to_1e_4(name):
    fp8_model, twin, shape, wname = CASES[name]
    x = fp8jax.cast_to_representable(rand(shape, 4, 2.0), E4M3)
    variables = _init(fp8_model, x)
    params = dict(variables["params"])
    params[wname] = fp8jax.cast_to_representable(params[wname], E4M3)
    variables = {**variables, "params": params}
    y = _apply(fp8_model, variables, x)  # first step: every scale is 1
    with jax.default_matmul_precision("highest"):  # no TF32 on a GPU
        y_ref = twin.apply({"params": params}, x)
    scale = float(jnp.max(jnp.abs(y_ref)))
    # Exact products: on CPU only float32 sums differ. On a GPU the FP8 tensor cores add with
    # about 14 mantissa bits (tests/ops/test_gemm.py), hence the GEMM tests' allowance of 2**-9.
    tol = 1e-4 if jax.default_backend() == "cpu" else 2.0**-9
    assert float(jnp.max(jnp.abs(y - y_ref))) <= tol * scale


@pytest.mark.parametrize("name", list(CASES))
def test_random_inputs_within_fp8_bounds(name):
    fp8_model, twin, shape, wname = CASES[name]
    x = rand(shape, 5, 1.5)
    variables = _init(fp8_model, x)
    params = dict(variables["params"])
    params[wname] = rand(params[wname].shape, 6, 0.5)
    if "bias" in params:
        params["bias"] = rand(params["bias"].shape, 7)
    variables = {**variables, "params": params}
    w = params[wname]
    f = _bilinear(twin, params, wname)
    y_ref = twin.apply({"params": params}, x)
    c = rand(y_ref.shape, 8)  # the output gradient of loss = sum(y * c)

    def loss(p, x, probes):
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            out = fp8_model.apply({**variables, "params": p, "fp8_probe": probes}, x)
        return jnp.sum(out * c)

    y = _apply(fp8_model, variables, x)
    dp, dx, _ = jax.grad(loss, argnums=(0, 1, 2))(params, x, variables["fp8_probe"])
    dp_ref, dx_ref = jax.grad(
        lambda p, x: jnp.sum(twin.apply({"params": p}, x) * c), argnums=(0, 1)
    )(params, x)

    def bound(a, b, ua, ha, ub, hb, fn):
        ba = jnp.maximum(ua * jnp.abs(a), ha)
        bb = jnp.maximum(ub * jnp.abs(b), hb)
        err = fn(ba, jnp.abs(b)) + fn(jnp.abs(a), bb) + fn(ba, bb)
        return err + 64 * F32_EPS * fn(jnp.abs(a), jnp.abs(b)) + 1e-6

    # forward: x and w in E4M3, scale 1
    fwd = bound(x, w, U4, H4, U4, H4, f)
    assert bool(jnp.all(jnp.abs(y - y_ref) <= fwd))
    # dgrad: c in E5M2 against the E4M3 kernel
    vjp_x = lambda g, w_: jax.vjp(lambda x_: f(x_, w_), x)[1](g)[0]
    dgrad = bound(c, w, U5, H5, U4, H4, vjp_x)
    assert bool(jnp.all(jnp.abs(dx - dx_ref) <= dgrad))
    # wgrad: the E4M3 input against c in E5M2
    vjp_w = lambda g, x_: jax.vjp(lambda w_: f(x_, w_), w)[1](g)[0]
    wgrad = bound(c, x, U5, H5, U4, H4, vjp_w)
    assert bool(jnp.all(jnp.abs(dp[wname] - dp_ref[wname]) <= wgrad))
    if "bias" in params:  # taken in float32 from the unquantized gradient
        np.testing.assert_allclose(dp["bias"], dp_ref["bias"], rtol=1e-5, atol=1e-5)


def test_bf16_dtype_and_param_dtype():
    x = rand((8, 16), 9).astype(jnp.bfloat16)
    model = DenseGeneral(features=8, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    variables = _init(model, x)
    assert variables["params"]["kernel"].dtype == jnp.bfloat16
    assert _apply(model, variables, x).dtype == jnp.bfloat16
    assert (
        DenseGeneral(features=8).apply(DenseGeneral(features=8).init(jax.random.key(0), x), x).dtype
        == jnp.float32
    )  # promoted with the float32 params, as in Flax


# ------------------------------------------------------------------------ probes per call


def _probe_grads(model, variables, *args):
    def f(probes):
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            out = model.apply({**variables, "fp8_probe": probes}, *args)
        return jnp.sum(out)

    return jax.grad(f)(variables["fp8_probe"])


class _Twice(nn.Module):
    """One DenseGeneral instance applied to two inputs."""

    @nn.compact
    def __call__(self, a, b):
        layer = DenseGeneral(features=8)
        return layer(a) + layer(b)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return DenseGeneral(features=8, name="dense")(x)


class _ParentTwice(nn.Module):
    """A compact parent applied twice: Flax builds a new child instance at the same path."""

    @nn.compact
    def __call__(self, a, b):
        block = _Block()
        return block(a) + block(b)


class _RematTwice(nn.Module):
    @nn.compact
    def __call__(self, a, b):
        layer = nn.remat(DenseGeneral)(features=8)
        return layer(a) + layer(b)


class _DotGeneralTwice(nn.Module):
    @nn.compact
    def __call__(self, a, b):
        layer = nn.Dense(8, dot_general_cls=Fp8DotGeneral)
        return layer(a) + layer(b)


class _EinsumTwice(nn.Module):
    @nn.compact
    def __call__(self, a, b):
        w = self.param("w", nn.initializers.normal(0.5), (8, 8))
        ein = Fp8Einsum()
        return ein("bd,df->bf", a, w) + ein("bd,df->bf", b, w)


@pytest.mark.parametrize(
    "model_cls", [_Twice, _ParentTwice, _RematTwice, _DotGeneralTwice, _EinsumTwice]
)
def test_each_call_has_its_own_probe(model_cls):
    a, b = rand((4, 8), 10, 1.0), rand((4, 8), 11, 5.0)
    model = model_cls()
    variables = _init(model, a, b)
    probes = variables["fp8_probe"]
    leaves = jax.tree_util.tree_leaves_with_path(probes)
    names = sorted(str(path[-1].key) for path, _ in leaves)
    assert names == ["call_0", "call_1"], probes
    grads = _probe_grads(model, variables, a, b)
    obs = {str(path[-1].key): v for path, v in jax.tree_util.tree_leaves_with_path(grads)}
    # each probe sees its own call's input amax (never the sum of both)
    np.testing.assert_allclose(obs["call_0"][0], jnp.max(jnp.abs(a)), rtol=0)
    np.testing.assert_allclose(obs["call_1"][0], jnp.max(jnp.abs(b)), rtol=0)


class _AutocastInside(nn.Module):
    """autocast entered inside the model: the calls are numbered from the parents."""

    @nn.compact
    def __call__(self, a, b):
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            block = _Block()
            return block(a) + block(b)


def test_calls_are_numbered_when_autocast_is_entered_inside_the_model():
    a, b = rand((4, 8), 10, 1.0), rand((4, 8), 11, 5.0)
    model = _AutocastInside()
    variables = model.init(jax.random.key(0), a, b)
    assert sorted(variables["fp8_probe"]["_Block_0"]["dense"]) == ["call_0", "call_1"]
    grads = jax.grad(lambda q: jnp.sum(model.apply({**variables, "fp8_probe": q}, a, b)))(
        variables["fp8_probe"]
    )["_Block_0"]["dense"]
    np.testing.assert_allclose(grads["call_0"][0], jnp.max(jnp.abs(a)), rtol=0)
    np.testing.assert_allclose(grads["call_1"][0], jnp.max(jnp.abs(b)), rtol=0)


def test_autocast_tracks_linen_calls_only_while_open():
    from fp8jax.flax import _variables

    assert not getattr(_variables._calls, "active", False)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        with fp8jax.autocast(enabled=False):
            assert _variables._calls.active
        assert _variables._calls.active
    assert not _variables._calls.active


def test_scan_over_layers_stacks_state_and_probes():
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return DenseGeneral(features=8)(x), x  # ys: each layer's input

    scanned = nn.scan(
        Layer,
        variable_axes={"params": 0, "fp8_meta": 0, "fp8_probe": 0},
        split_rngs={"params": True},
        length=3,
    )

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            return scanned(name="layers")(x, None)

    x = rand((4, 8), 12, 3.0)
    model = Stack()
    variables = _init(model, x)
    shapes = jax.tree.map(jnp.shape, variables)
    assert shapes["fp8_meta"]["layers"]["DenseGeneral_0"] == {
        "amax_history": (3, 3, 4),
        "scale": (3, 3),
    }
    # Flax traces a scan body twice (a discarded partial-evaluation pass, then the scan), so the
    # probe of the single call per step is numbered after the discarded pass's.
    (probe,) = jax.tree.leaves(variables["fp8_probe"])
    assert probe.shape == (3, 3)

    def f(probes):
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            out, inputs = model.apply({**variables, "fp8_probe": probes}, x)
        return jnp.sum(out), inputs

    grads, inputs = jax.grad(f, has_aux=True)(variables["fp8_probe"])
    (obs,) = jax.tree.leaves(grads)
    np.testing.assert_array_equal(obs[:, 0], jnp.max(jnp.abs(inputs), axis=(1, 2)))
    kernels = variables["params"]["layers"]["DenseGeneral_0"]["kernel"]
    np.testing.assert_array_equal(obs[:, 1], jnp.max(jnp.abs(kernels), axis=(1, 2)))


def test_apply_without_probes_is_inference():
    x = rand((4, 8), 13)
    model = DenseGeneral(features=8)
    variables = _init(model, x)
    y = _apply(model, {"params": variables["params"], "fp8_meta": variables["fp8_meta"]}, x)
    np.testing.assert_array_equal(y, _apply(model, variables, x))


def test_bound_compact_model_counts_calls_per_call():
    x = rand((4, 8), 20)
    model = DenseGeneral(features=8)
    variables = _init(model, x)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        bound = model.bind(variables)
        np.testing.assert_array_equal(bound(x), bound(x))  # both calls use call_0


def test_checkpoint_policy_with_names_gives_same_grads():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return DenseGeneral(features=8)(jax.nn.gelu(DenseGeneral(features=16)(x)))

    x = rand((4, 8), 14)
    model = MLP()
    variables = _init(model, x)
    policy = jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES)

    def loss(params, probes, remat):
        def fwd(params, probes, x):
            v = {**variables, "params": params, "fp8_probe": probes}
            return model.apply(v, x)

        if remat:
            fwd = jax.checkpoint(fwd, policy=policy)
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            return jnp.sum(fwd(params, probes, x) ** 2)

    args = (variables["params"], variables["fp8_probe"])
    g_remat = jax.jit(jax.grad(lambda p, q: loss(p, q, True), argnums=(0, 1)))(*args)
    g_plain = jax.jit(jax.grad(lambda p, q: loss(p, q, False), argnums=(0, 1)))(*args)
    jax.tree.map(np.testing.assert_array_equal, g_remat, g_plain)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda p, q: loss(p, q, True), (0, 1)))(*args))
    for name in CHECKPOINT_NAMES:
        assert name in jaxpr


# ------------------------------------------------------------------------ bad input


def test_bad_input_dense_general():
    x = rand((4, 8), 15)
    with pytest.raises(ValueError, match="batch_dims must be"):
        _init(DenseGeneral(features=3, batch_dims=(0,)), x)
    with pytest.raises(ValueError, match="precision must be None"):
        _init(DenseGeneral(features=3, precision=jax.lax.Precision.HIGHEST), x)
    with pytest.raises(ValueError, match=r"axis=\(1, 2\) names axis 2, out of range"):
        _init(DenseGeneral(features=3, axis=(1, 2)), x)
    with pytest.raises(ValueError, match="each once"):
        _init(DenseGeneral(features=3, axis=(1, -1)), x)
    with pytest.raises(ValueError, match="features must be positive"):
        _init(DenseGeneral(features=0), x)
    with pytest.raises(TypeError, match="inputs must be a floating-point array"):
        _init(DenseGeneral(features=3), jnp.ones((4, 8), jnp.int32))
    model = DenseGeneral(features=3)
    variables = _init(model, x)
    with pytest.raises(flax.errors.ScopeParamShapeError, match="kernel"):
        _apply(model, variables, rand((4, 9), 0))
    # initialised outside autocast, applied with FP8 on: the state is missing
    plain = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"'fp8_meta' variables .* are missing"):
        _apply(model, plain, x)
    # another history length than at init
    with pytest.raises(ValueError, match="amax_history_len=8"):
        _apply(model, variables, x, recipe=DelayedScaling(amax_history_len=8))


def test_more_calls_than_at_init_is_an_error():
    class Maybe(nn.Module):
        @nn.compact
        def __call__(self, x, twice: bool):
            layer = DenseGeneral(features=8)
            y = layer(x)
            return layer(y) if twice else y

    x = rand((4, 8), 16)
    variables = _init(Maybe(), x, False)
    with pytest.raises(ValueError, match=r"call number 1 .* only has probes"):
        _apply(Maybe(), variables, x, True)


def test_bad_input_dot_general_and_einsum():
    x = rand((2, 4, 8), 17)
    with pytest.raises(ValueError, match="batch dims are not supported"):
        _init(nn.DenseGeneral(3, batch_dims=(0,), dot_general_cls=Fp8DotGeneral), x)
    w = rand((8, 3), 18)
    dims = (((2,), (0,)), ((), ()))
    with pytest.raises(TypeError, match="lhs must be a floating-point"):
        Fp8DotGeneral().apply({}, x.astype(jnp.int32), w, dims)
    with pytest.raises(ValueError, match="contracted dims differ"):
        Fp8DotGeneral().apply({}, x, rand((7, 3), 0), dims)
    bad = [  # (equation, weight shape, message)
        ("btd,dh,hk->btk", (8, 3), "exactly two operands"),
        ("btd,bdh->bth", (2, 8, 3), "in x, w and the output"),
        ("btd,dh->bt", (8, 3), "summed away"),
        ("btd,eh->bteh", (8, 3), "contracts no dim"),
        ("bd,dh->bh", (8, 3), "x has rank 3"),
        ("btd,dd->btd", (8, 8), "repeats within w"),
        ("btd,...h->bth", (8, 3), "may not have '...'"),
    ]
    for eq, w_shape, msg in bad:
        with pytest.raises(ValueError, match=re.escape(msg)):
            Fp8Einsum().apply({}, eq, x, rand(w_shape, 0))
    with pytest.raises(ValueError, match="is 8 in x"):
        Fp8Einsum().apply({}, "btd,dh->bth", x, rand((7, 3), 0))
    with pytest.raises(TypeError, match="equation must be a str"):
        Fp8Einsum().apply({}, 3, x, w)


# ------------------------------------------------------------------------ GPU only


@requires_cuda
def test_gpu_train_step_runs_three_fp8_gemms_and_no_wide_dot():
    x = rand((256, 512), 19).astype(jnp.bfloat16)
    model = DenseGeneral(features=256, dtype=jnp.bfloat16)
    variables = _init(model, x)

    def step(params, probes, x):
        def loss(params, probes, x):
            with fp8jax.autocast(enabled=True, recipe=RECIPE):
                y = model.apply({**variables, "params": params, "fp8_probe": probes}, x)
            return jnp.mean(jnp.square(y.astype(jnp.float32)))

        # the loss value and dx keep the forward GEMM and dgrad alive (no dead-code removal)
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(params, probes, x)

    hlo = jax.jit(step).lower(variables["params"], variables["fp8_probe"], x).compile().as_text()
    assert hlo.count('custom_call_target="fp8jax_gemm"') == 3  # forward, dgrad, wgrad
    # no other matmul: neither an HLO dot nor what XLA:GPU turns dots into (cuBLAS/cuDNN custom
    # calls, Triton GEMM fusions)
    wide_dots = re.findall(r"= (?:f32|bf16|f16)\[[^\]]*\][^\n]* dot\(", hlo)
    assert not wide_dots, wide_dots
    xla_gemms = re.findall(r'custom_call_target="(__cublas[^"]*|__cudnn[^"]*)"', hlo)
    assert not xla_gemms, xla_gemms
    assert "triton_gemm" not in hlo
