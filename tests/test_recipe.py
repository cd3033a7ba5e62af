"""Tests of fp8jax.recipe: formats, dtype helpers, recipe defaults, validation and hashing."""

import dataclasses
import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax.recipe as recipe_mod
from fp8jax.recipe import (
    FP8_DTYPES,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    QParams,
    Recipe,
    fp8_max,
    is_fp8_dtype,
)

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)


# --- Format and dtype helpers -------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, fwd, bwd, fwd_max, bwd_max",
    [
        (Format.E4M3, E4M3, E4M3, 448.0, 448.0),
        (Format.E5M2, E5M2, E5M2, 57344.0, 57344.0),
        (Format.HYBRID, E4M3, E5M2, 448.0, 57344.0),
    ],
)
def test_format_dtypes_and_max(fmt, fwd, bwd, fwd_max, bwd_max):
    assert fmt.fwd_dtype == fwd
    assert fmt.bwd_dtype == bwd
    assert isinstance(fmt.fwd_dtype, np.dtype)
    assert fmt.fwd_max == fwd_max
    assert fmt.bwd_max == bwd_max
    assert repr(fmt) == f"Format.{fmt.name}"
    r = DelayedScaling(fp8_format=fmt)
    assert (r.fwd_dtype, r.bwd_dtype) == (fwd, bwd)
    assert (r.fp8_max(), r.fp8_max(backward=True)) == (fwd_max, bwd_max)


def test_fp8_dtypes_tuple():
    assert FP8_DTYPES == (E4M3, E5M2)


@pytest.mark.parametrize(
    "spelling",
    [jnp.float8_e4m3fn, E4M3, np.dtype(jnp.float8_e4m3fn), "float8_e4m3fn"],
    ids=["scalar_type", "jnp_dtype", "np_dtype", "name"],
)
def test_fp8_max_e4m3(spelling):
    assert fp8_max(spelling) == 448.0
    assert is_fp8_dtype(spelling)


@pytest.mark.parametrize(
    "spelling",
    [jnp.float8_e5m2, E5M2, np.dtype(jnp.float8_e5m2), "float8_e5m2"],
    ids=["scalar_type", "jnp_dtype", "np_dtype", "name"],
)
def test_fp8_max_e5m2(spelling):
    assert fp8_max(spelling) == 57344.0
    assert is_fp8_dtype(spelling)


@pytest.mark.parametrize(
    "bad",
    [jnp.float32, np.dtype("float32"), jnp.bfloat16, jnp.float8_e4m3fnuz, None, "nope", 3],
)
def test_fp8_max_rejects_non_fp8(bad):
    with pytest.raises(TypeError, match="dtype"):
        fp8_max(bad)
    assert not is_fp8_dtype(bad)


def test_fp8_max_matches_finfo():
    for dt in FP8_DTYPES:
        assert fp8_max(dt) == float(jnp.finfo(dt).max)


# --- DelayedScaling -----------------------------------------------------------------------------


def test_delayed_scaling_defaults_match_transformer_engine():
    r = DelayedScaling()
    assert r.margin == 0
    assert r.fp8_format is Format.HYBRID
    assert r.amax_history_len == 1024
    assert r.amax_compute_algo == "max"
    assert r.scaling_factor_compute_algo is None
    assert r.reduce_amax is True
    assert r.fp8_dpa is False
    assert r.fp8_mha is False
    assert [f.name for f in dataclasses.fields(r)] == [
        "margin",
        "fp8_format",
        "amax_history_len",
        "amax_compute_algo",
        "scaling_factor_compute_algo",
        "reduce_amax",
        "fp8_dpa",
        "fp8_mha",
        "backward_override",
    ]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(margin=-1), ValueError, r"DelayedScaling\.margin .*got -1"),
        (dict(margin=1.0), TypeError, r"DelayedScaling\.margin .*got 1\.0"),
        (dict(margin=True), TypeError, r"DelayedScaling\.margin .*got True"),
        (dict(amax_history_len=0), ValueError, r"DelayedScaling\.amax_history_len .*got 0"),
        (dict(amax_history_len=2.5), TypeError, r"DelayedScaling\.amax_history_len .*got 2\.5"),
        (dict(amax_history_len=True), TypeError, r"DelayedScaling\.amax_history_len"),
        (
            dict(amax_compute_algo="mean"),
            ValueError,
            r"DelayedScaling\.amax_compute_algo .*'max'.*'most_recent'.*got 'mean'",
        ),
        (dict(amax_compute_algo=3), TypeError, r"DelayedScaling\.amax_compute_algo .*got 3"),
        (
            dict(scaling_factor_compute_algo="x"),
            TypeError,
            r"DelayedScaling\.scaling_factor_compute_algo .*got 'x'",
        ),
        (
            dict(fp8_format="HYBRID"),
            TypeError,
            r"DelayedScaling\.fp8_format .*Format\.HYBRID.*got 'HYBRID'",
        ),
        (dict(fp8_format=None), TypeError, r"DelayedScaling\.fp8_format"),
        (dict(reduce_amax=1), TypeError, r"DelayedScaling\.reduce_amax .*bool.*got 1"),
        (dict(reduce_amax=False), ValueError, r"DelayedScaling\.reduce_amax=False .*replicated"),
        (dict(fp8_dpa=1), TypeError, r"DelayedScaling\.fp8_dpa .*bool"),
        (dict(fp8_dpa=True), ValueError, r"DelayedScaling\.fp8_dpa.*fp8_dpa=True of DotProd"),
        (dict(fp8_mha=True), ValueError, r"DelayedScaling\.fp8_mha.*fp8_mha is not implemented"),
    ],
)
def test_delayed_scaling_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        DelayedScaling(**kwargs)


def test_unhashable_callable_rejected():
    class Unhashable:
        __hash__ = None

        def __call__(self, history):
            return history[0]

    with pytest.raises(TypeError, match=r"DelayedScaling\.amax_compute_algo .*hashable"):
        DelayedScaling(amax_compute_algo=Unhashable())


def test_numpy_scalars_normalized():
    r = DelayedScaling(margin=np.int64(2), amax_history_len=np.int32(8), reduce_amax=np.True_)
    assert type(r.margin) is int and r.margin == 2
    assert type(r.amax_history_len) is int and r.amax_history_len == 8
    assert r.reduce_amax is True
    assert r == DelayedScaling(margin=2, amax_history_len=8)


def test_positional_args_rejected():
    with pytest.raises(TypeError):
        DelayedScaling(1)
    with pytest.raises(TypeError):
        Float8CurrentScaling(Format.E4M3)


def test_callables_accepted():
    def algo(history):
        return jnp.max(history[:4])

    def sf(amax, scale, fp8_max, recipe):
        return fp8_max / amax

    r = DelayedScaling(amax_compute_algo=algo, scaling_factor_compute_algo=sf)
    assert r.amax_compute_algo is algo
    assert r.scaling_factor_compute_algo is sf
    hash(r)
    assert r == DelayedScaling(amax_compute_algo=algo, scaling_factor_compute_algo=sf)
    assert r != DelayedScaling(amax_compute_algo=lambda h: h[0], scaling_factor_compute_algo=sf)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_string_algos_accepted(algo):
    assert DelayedScaling(amax_compute_algo=algo).amax_compute_algo == algo


def test_frozen():
    r = DelayedScaling()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.margin = 1
    c = Float8CurrentScaling()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.margin = 1


def test_hashable_and_equal():
    a = DelayedScaling(margin=1, amax_history_len=16)
    b = DelayedScaling(margin=1, amax_history_len=16)
    c = DelayedScaling(margin=2, amax_history_len=16)
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2
    assert Float8CurrentScaling() == Float8CurrentScaling()
    assert hash(Float8CurrentScaling()) == hash(Float8CurrentScaling())
    assert DelayedScaling() != Float8CurrentScaling()


def test_recipe_as_static_jit_arg():
    traces = []

    def f(x, recipe):
        traces.append(recipe)
        return x * recipe.fp8_max() * 2.0**-recipe.margin

    jf = jax.jit(f, static_argnums=1)
    x = jnp.float32(1.0)
    a = DelayedScaling(margin=1)
    b = DelayedScaling(margin=2, fp8_format=Format.E5M2)
    assert float(jf(x, a)) == 224.0
    assert float(jf(x, b)) == 57344.0 / 4
    assert float(jf(x, DelayedScaling(margin=1))) == 224.0  # equal recipe: cache hit
    assert float(jf(x, Float8CurrentScaling())) == 448.0
    assert traces == [a, b, Float8CurrentScaling()]


def test_repr():
    r = repr(DelayedScaling())
    assert r.startswith("DelayedScaling(")
    assert "Format.HYBRID" in r
    assert "amax_history_len=1024" in r
    assert "amax_compute_algo='max'" in r
    assert repr(Float8CurrentScaling(fp8_format=Format.E4M3)) == (
        "Float8CurrentScaling(fp8_format=Format.E4M3, margin=0)"
    )


def test_docstring_examples():
    result = doctest.testmod(recipe_mod, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


# --- Float8CurrentScaling -----------------------------------------------------------------------


def test_current_scaling_defaults():
    r = Float8CurrentScaling()
    assert r.fp8_format is Format.HYBRID
    assert r.margin == 0
    assert [f.name for f in dataclasses.fields(r)] == ["fp8_format", "margin", "backward_override"]
    assert r.fp8_max() == 448.0 and r.fp8_max(backward=True) == 57344.0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(margin=-1), ValueError, r"Float8CurrentScaling\.margin .*got -1"),
        (dict(margin=1.0), TypeError, r"Float8CurrentScaling\.margin .*got 1\.0"),
        (dict(margin=True), TypeError, r"Float8CurrentScaling\.margin .*got True"),
        (dict(fp8_format="E4M3"), TypeError, r"Float8CurrentScaling\.fp8_format .*got 'E4M3'"),
    ],
)
def test_current_scaling_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        Float8CurrentScaling(**kwargs)


# --- Recipe base class --------------------------------------------------------------------------


def test_isinstance_recipe():
    assert isinstance(DelayedScaling(), Recipe)
    assert isinstance(Float8CurrentScaling(), Recipe)
    assert not isinstance(Format.HYBRID, Recipe)


def test_recipe_base_not_instantiable():
    with pytest.raises(TypeError, match="Recipe"):
        Recipe()


@pytest.mark.parametrize("cls", [DelayedScaling, Float8CurrentScaling])
def test_te_backward_override_none_only(cls):
    assert cls(backward_override=None) == cls()
    assert "backward_override" not in repr(cls())
    with pytest.raises(ValueError, match="backward_override='high_precision' is not supported"):
        cls(backward_override="high_precision")


# --- Float8BlockScaling, MXFP8BlockScaling ------------------------------------------------------


def test_block_scaling_defaults_match_transformer_engine():
    r = Float8BlockScaling()
    assert r.fp8_format is Format.E4M3 and not r.use_f32_scales
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    for q in (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad):
        assert q == QParams(power_2_scale=True, amax_epsilon=0.0)
    for mm in (r.fp8_gemm_fprop, r.fp8_gemm_dgrad, r.fp8_gemm_wgrad):
        assert mm == MMParams(use_split_accumulator=True)
    assert not r.fp8_dpa and not r.fp8_mha and r.backward_override is None
    assert (r.block("x"), r.block("w"), r.block("grad")) == ((1, 128), (128, 128), (1, 128))
    assert r.fp8_max() == r.fp8_max(backward=True) == 448.0
    # use_f32_scales sets the QParams defaults (in TE they are class attributes it cannot reach)
    assert not Float8BlockScaling(use_f32_scales=True).fp8_quant_fwd_inp.power_2_scale
    eps = QParams(power_2_scale=False, amax_epsilon=1e-6)
    assert Float8BlockScaling(fp8_quant_bwd_grad=eps).fp8_quant_bwd_grad is eps
    m = MXFP8BlockScaling()
    assert (m.margin, m.fp8_format, m.enable_2d_quantization) == (0, Format.E4M3, False)
    assert m.block("w") == (1, 32)
    assert MXFP8BlockScaling(enable_2d_quantization=True).block("w") == (32, 32)
    for rec in (r, m, Float8BlockScaling(fp8_format=Format.HYBRID)):
        assert isinstance(rec, Recipe) and hash(rec) == hash(dataclasses.replace(rec))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(x_block_scaling_dim=2), ValueError, r"fprop GEMM take two 128 x 128-block"),
        (dict(w_block_scaling_dim=1, grad_block_scaling_dim=2, x_block_scaling_dim=2), ValueError,
         r"wgrad GEMM"),
        (dict(grad_block_scaling_dim=2), ValueError, r"dgrad GEMM"),
        (dict(x_block_scaling_dim=3), ValueError, r"x_block_scaling_dim must be 1 .*got 3"),
        (dict(w_block_scaling_dim=2.0), TypeError, r"w_block_scaling_dim must be 1 or 2"),
        (dict(fp8_format=Format.E5M2), ValueError, r"pure E5M2 training is not supported"),
        (dict(fp8_format="E4M3"), TypeError, r"fp8_format must be a Format"),
        (dict(fp8_gemm_wgrad=MMParams(use_split_accumulator=False)), ValueError,
         r"fp8_gemm_wgrad\.use_split_accumulator=False is not supported"),
        (dict(fp8_gemm_fprop=True), TypeError, r"fp8_gemm_fprop must be an MMParams"),
        (dict(fp8_quant_fwd_inp=dict(power_2_scale=True)), TypeError, r"must be a QParams"),
        (dict(fp8_dpa=True), ValueError, r"fp8_dpa=True is not supported"),
        (dict(fp8_mha=1), TypeError, r"fp8_mha must be a bool"),
        (dict(use_f32_scales="yes"), TypeError, r"use_f32_scales must be a bool"),
        (dict(backward_override="dequantized"), ValueError, r"backward_override='dequantized'"),
    ],
)  # fmt: skip
def test_block_scaling_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        Float8BlockScaling(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(fp8_format=Format.E5M2), ValueError, r"pure E5M2"),
        (dict(margin=-1), ValueError, r"MXFP8BlockScaling\.margin"),
        (dict(enable_2d_quantization=None), TypeError, r"enable_2d_quantization must be a bool"),
        (dict(fp8_mha=True), ValueError, r"fp8_mha=True is not supported"),
        (dict(backward_override="high_precision"), ValueError, r"backward_override"),
    ],
)
def test_mxfp8_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        MXFP8BlockScaling(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(power_2_scale=1), TypeError, r"QParams\.power_2_scale must be a bool"),
        (dict(amax_epsilon=-1.0), ValueError, r"amax_epsilon must be a non-negative float"),
        (dict(amax_epsilon=float("nan")), ValueError, r"amax_epsilon"),
        (dict(amax_epsilon="0"), TypeError, r"amax_epsilon"),
    ],
)
def test_qparams_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        QParams(**kwargs)


def test_block_role_names_are_checked():
    with pytest.raises(ValueError, match="role must be x, w or grad"):
        Float8BlockScaling().block("input")
    with pytest.raises(ValueError, match="role must be x, w or grad"):
        MXFP8BlockScaling().block("weight")


# --- Float8RowwiseScaling -----------------------------------------------------------------------


def test_rowwise_defaults_follow_torchao():
    r = Float8RowwiseScaling()
    assert r.fp8_format is Format.E4M3 and r.power_2_scale and r.amax_epsilon == 0.0
    assert not r.wgrad_high_precision and not r.fp8_dpa and not r.fp8_mha
    assert r.backward_override is None and not r.keeps_state
    assert r.fp8_max() == r.fp8_max(backward=True) == 448.0
    assert Float8RowwiseScaling(fp8_format=Format.HYBRID).bwd_dtype == E5M2
    assert [r.fp8_gemm(g) for g in ("fprop", "dgrad", "wgrad")] == [True, True, True]
    hp = Float8RowwiseScaling(wgrad_high_precision=True)
    assert [hp.fp8_gemm(g) for g in ("fprop", "dgrad", "wgrad")] == [True, True, False]
    assert r.qparams("w") == QParams(power_2_scale=True, amax_epsilon=0.0)
    f32 = Float8RowwiseScaling(power_2_scale=False, amax_epsilon=1e-12)
    assert f32.qparams("grad") == QParams(power_2_scale=False, amax_epsilon=1e-12)
    assert Float8RowwiseScaling(amax_epsilon=1).amax_epsilon == 1.0  # an int, kept as a float
    assert isinstance(Float8RowwiseScaling(amax_epsilon=1).amax_epsilon, float)
    for rec in (r, hp, f32):
        assert hash(rec) == hash(dataclasses.replace(rec)) and rec == dataclasses.replace(rec)
    assert hp != r and "fp8_dpa" not in repr(r)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.power_2_scale = False


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(fp8_format=Format.E5M2), ValueError, r"Float8RowwiseScaling\.fp8_format=.*pure E5M2"),
        (dict(fp8_format="E4M3"), TypeError, r"Float8RowwiseScaling\.fp8_format must be a Format"),
        (dict(power_2_scale=1), TypeError, r"Float8RowwiseScaling\.power_2_scale must be a bool"),
        (dict(amax_epsilon=-1e-6), ValueError,
         r"Float8RowwiseScaling\.amax_epsilon must be a non-negative float"),
        (dict(amax_epsilon=float("inf")), ValueError, r"Float8RowwiseScaling\.amax_epsilon"),
        (dict(amax_epsilon="0"), TypeError, r"Float8RowwiseScaling\.amax_epsilon must be"),
        (dict(amax_epsilon=True), TypeError, r"Float8RowwiseScaling\.amax_epsilon must be"),
        (dict(wgrad_high_precision="yes"), TypeError,
         r"Float8RowwiseScaling\.wgrad_high_precision must be a bool"),
        (dict(fp8_dpa=True), ValueError, r"Float8RowwiseScaling\.fp8_dpa=True is not supported"),
        (dict(fp8_mha=1), TypeError, r"Float8RowwiseScaling\.fp8_mha must be a bool"),
        (dict(backward_override="high_precision"), ValueError,
         r"Float8RowwiseScaling\.backward_override='high_precision' is not supported"),
    ],
)  # fmt: skip
def test_rowwise_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        Float8RowwiseScaling(**kwargs)


def test_rowwise_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        Float8RowwiseScaling(Format.E4M3)


def test_fp8_gemm_names_are_checked():
    with pytest.raises(ValueError, match=r"Float8RowwiseScaling\.fp8_gemm: gemm must be fprop"):
        Float8RowwiseScaling().fp8_gemm("forward")
    with pytest.raises(ValueError, match=r"DelayedScaling\.fp8_gemm: gemm must be fprop"):
        DelayedScaling().fp8_gemm("bwd")
