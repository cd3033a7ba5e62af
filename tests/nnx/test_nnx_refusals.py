"""NNX refuses what Linen refuses (issue 35): every module's call runs one shared check, the
Linen module's ``check`` (and ``check_decode``/``check_config``) called with the call's real
arguments, in both APIs.

:data:`CASES` holds one refused configuration or call per refusal; each runs in both APIs and
must raise the same type and message (or, where an NNX constructor has no such argument, the
TypeError naming it). :func:`test_every_refusal_of_the_checks_has_a_case` walks the checks' own
``raise`` statements (their source) and runs every case under Linen with a line tracer: each
``raise`` must be reached by some case, so a refusal added to a check without a twin case fails
here."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import fp8jax
from fp8jax import flax as fflax
from fp8jax import nnx as fnnx

DECODER = fflax.TransformerLayerType.DECODER
SMALL = dict(hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0)

#: The shared checks: every ``raise`` in their bodies must be reached by a case.
CHECKS = (
    fflax.DenseGeneral.check,
    fflax.LayerNorm.check,
    fflax.LayerNormDenseGeneral.check,
    fflax.LayerNormMLP.check,
    fflax.MultiHeadAttention.check_config,
    fflax.MultiHeadAttention.check,
    fflax.RelativePositionBiases.check,
    fflax.TransformerLayer.check,
    fflax.TransformerLayer.check_decode,
)


@dataclasses.dataclass(frozen=True)
class Case:
    """A refused configuration or call of ``module``: ``config`` goes to both constructors,
    ``call`` to both calls (``decode=True``: a decode step on a cache of ``shape``)."""

    module: str
    config: dict[str, Any]
    error: type[Exception]
    match: str
    call: dict[str, Any] = dataclasses.field(default_factory=dict)
    shape: tuple[int, ...] = (2, 4, 16)
    nnx_match: str | None = None  # where NNX's constructor has no such argument

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in {**self.config, **self.call}.items())
        return f"{self.module}({args})"


def _x(shape):
    return jnp.ones(shape, jnp.float32)


CASES = [
    # DenseGeneral
    Case("DenseGeneral", dict(batch_dims=(0,)), ValueError, "batch_dims must be ()",
         nnx_match="unexpected keyword argument 'batch_dims'"),
    Case("DenseGeneral", dict(precision="highest"), ValueError, "precision must be None",
         nnx_match="unexpected keyword argument 'precision'"),
    Case("DenseGeneral", dict(features=0), ValueError, "features must be positive ints",
         nnx_match="out_features must be a positive int"),
    Case("DenseGeneral", dict(axis=3), ValueError, "axis", nnx_match="axis"),
    Case("DenseGeneral", dict(enable_low_rank_adaptation=True), ValueError,
         "enable_low_rank_adaptation", nnx_match="unexpected keyword argument"),
    Case("DenseGeneral", {}, TypeError, "inputs must be",
         call=dict(x=jnp.ones((2, 16), jnp.int32))),
    # LayerNorm
    Case("LayerNorm", dict(layernorm_type="batchnorm"), ValueError, "layernorm_type"),
    Case("LayerNorm", dict(epsilon=-1.0), ValueError, "epsilon"),
    # LayerNormDenseGeneral
    Case("LayerNormDenseGeneral", dict(axis=0), ValueError, "axis must be -1",
         nnx_match="unexpected keyword argument 'axis'"),
    Case("LayerNormDenseGeneral", dict(features=(4, 0)), ValueError, "features must be positive",
         nnx_match="out_features must be a positive int"),
    Case("LayerNormDenseGeneral", dict(layernorm_type="rms"), ValueError, "layernorm_type"),
    Case("LayerNormDenseGeneral", dict(quantization_checkpoint_name="q"), ValueError,
         "quantization_checkpoint_name"),
    # LayerNormMLP
    Case("LayerNormMLP", dict(ffn1_ckpt_name=1), TypeError, "ffn1_ckpt_name must be a str"),
    Case("LayerNormMLP", dict(intermediate_dim=0), ValueError,
         "intermediate_dim must be a positive"),
    Case("LayerNormMLP", dict(axis=0), ValueError, "axis must be -1",
         nnx_match="unexpected keyword argument 'axis'"),
    Case("LayerNormMLP", dict(intermediate_dropout_rate=1.0), ValueError,
         r"intermediate_dropout_rate must be a float in \[0, 1\)"),
    # the input's real rank decides: dim 2 exists in the rank-3 call (not in a rank-2 sample)
    Case("LayerNormMLP", dict(intermediate_hidden_dropout_dims=(3,)), ValueError,
         "intermediate_hidden_dropout_dims holds 3"),
    Case("LayerNormMLP", dict(activations=("tanh",)), ValueError, "activations"),
    Case("LayerNormMLP", dict(dot_1_input_axes=("batch", "embed")), ValueError, "dot_1_input_axes"),
    # MultiHeadAttention
    Case("MultiHeadAttention", dict(head_dim=0), ValueError, "head_dim must be a positive int"),
    Case("MultiHeadAttention", dict(head_dim=3, enable_rotary_pos_emb=True), ValueError,
         "rotary embeddings need an even head_dim"),
    Case("MultiHeadAttention", dict(num_gqa_groups=3), ValueError, "num_gqa_groups"),
    Case("MultiHeadAttention", dict(attn_mask_type="diagonal"), ValueError, "attn_mask_type"),
    Case("MultiHeadAttention", dict(attn_mask_type="no_mask"), ValueError,
         "decode=True needs a causal attention", call=dict(decode=True)),
    Case("MultiHeadAttention", dict(attn_mask_type="padding"), ValueError,
         "decode=True needs a causal attention", call=dict(decode=True)),
    Case("MultiHeadAttention", dict(window_size=(2, 0)), ValueError,
         "decode=True does not support window_size", call=dict(decode=True)),
    Case("MultiHeadAttention", {}, ValueError, "decode steps do not support segment_ids",
         call=dict(decode=True, segment_ids=jnp.zeros((2, 1), jnp.int32))),
    Case("MultiHeadAttention", {}, ValueError, "inputs_q must be", shape=(2, 16)),
    # RelativePositionBiases
    Case("RelativePositionBiases", dict(max_distance=0), ValueError,
         "max_distance must be a positive int"),
    Case("RelativePositionBiases", dict(num_buckets=3), ValueError, "num_buckets must be >= 4"),
    Case("RelativePositionBiases", {}, ValueError, "q_seqlen must be a positive int",
         call=dict(q_seqlen=0)),
    # TransformerLayer
    Case("TransformerLayer", dict(layer_type="decoder"), ValueError, "layer_type must be"),
    Case("TransformerLayer", dict(mlp_hidden_size=0), ValueError,
         "mlp_hidden_size must be a positive int"),
    Case("TransformerLayer", dict(num_attention_heads=3), ValueError,
         "num_attention_heads=3 must divide hidden_size=16"),
    Case("TransformerLayer", {}, ValueError, "inputs must be rank 3", shape=(2, 4, 4, 16)),
    Case("TransformerLayer", {}, ValueError, "inputs' last dim 8 must equal hidden_size=16",
         shape=(2, 4, 8)),
    Case("TransformerLayer", dict(layer_type=DECODER), ValueError, "a DECODER layer needs encoded",
         call=dict(encoded=None)),
    Case("TransformerLayer", dict(drop_path=1.0), ValueError, r"drop_path must be a float in \["),
    Case("TransformerLayer", dict(softmax_type="off_by_one"), ValueError, "softmax_type"),
    Case("TransformerLayer", dict(self_attn_mask_type="no_mask"), ValueError,
         "decode=True needs a causal self-attention", call=dict(decode=True)),
    Case("TransformerLayer", dict(self_attn_mask_type="padding"), ValueError,
         "decode=True needs a causal self-attention", call=dict(decode=True)),
    Case("TransformerLayer", dict(window_size=(2, 0)), ValueError,
         "decode=True does not support window_size", call=dict(decode=True)),
    Case("TransformerLayer", dict(layer_type=DECODER, enable_rotary_pos_emb=True), ValueError,
         "enable_rotary_pos_emb is not supported for a DECODER layer", call=dict(decode=True)),
]  # fmt: skip

# ------------------------------------------------------------------------------ the two APIs


def _split(case: Case) -> tuple[dict[str, Any], dict[str, Any]]:
    config = dict(case.config)
    if case.module == "TransformerLayer":
        config = {**dict(hidden_size=16, mlp_hidden_size=32, num_attention_heads=2), **SMALL,
                  **config}  # fmt: skip
    elif case.module == "MultiHeadAttention":
        config = {**dict(head_dim=8, num_attention_heads=2, attention_dropout=0.0), **config}
    elif case.module == "RelativePositionBiases":
        config = {**dict(num_buckets=8, max_distance=16, num_attention_heads=2), **config}
    elif case.module == "LayerNormMLP":
        config.setdefault("intermediate_dim", 32)
    return config, dict(case.call)


def run_linen(case: Case) -> None:
    config, call = _split(case)
    key = jax.random.key(0)
    x = call.pop("x", None)
    x = _x(case.shape) if x is None else x
    name = case.module
    if name in ("DenseGeneral", "LayerNormDenseGeneral"):
        module = getattr(fflax, name)(**{"features": 4, **config})
        module.init(key, x)
    elif name in ("LayerNorm", "LayerNormMLP"):
        kw = {"deterministic": True} if name == "LayerNormMLP" else {}
        getattr(fflax, name)(**config).init(key, x, **kw)
    elif name == "RelativePositionBiases":
        module = fflax.RelativePositionBiases(**config)
        module.init(key, call.get("q_seqlen", 4), call.get("k_seqlen", 4))
    elif name == "MultiHeadAttention":
        module = fflax.MultiHeadAttention(**config)
        decode = call.pop("decode", False)
        variables = module.init(key, x, None, decode=decode, deterministic=True)
        if decode:  # the step on the cache init made
            module.apply(variables, x[:, :1], None, decode=True, deterministic=True,
                         mutable=["cache"], **call)  # fmt: skip
    else:
        module = fflax.TransformerLayer(**config)
        decoder = config.get("layer_type") is DECODER
        encoded = call.pop("encoded", x if decoder else None)
        module.init(key, x, encoded, deterministic=True, **call)


def run_nnx(case: Case) -> None:
    config, call = _split(case)
    rngs = nnx.Rngs(0)
    x = call.pop("x", None)
    x = _x(case.shape) if x is None else x
    name = case.module
    hidden = x.shape[-1]
    if name == "DenseGeneral":
        out = config.pop("features", 4)
        fnnx.DenseGeneral(hidden, out, rngs=rngs, **config)(x)
    elif name == "LayerNormDenseGeneral":
        out = config.pop("features", 4)
        fnnx.LayerNormDenseGeneral(hidden, out, rngs=rngs, **config)(x)
    elif name == "LayerNorm":
        fnnx.LayerNorm(hidden, rngs=rngs, **config)(x)
    elif name == "LayerNormMLP":
        fnnx.LayerNormMLP(hidden, rngs=rngs, **config)(x, deterministic=True)
    elif name == "RelativePositionBiases":
        fnnx.RelativePositionBiases(**config, rngs=rngs)(call.get("q_seqlen", 4),
                                                         call.get("k_seqlen", 4))  # fmt: skip
    elif name == "MultiHeadAttention":
        module = fnnx.MultiHeadAttention(hidden, rngs=rngs, **config)
        if call.pop("decode", False):
            module.init_cache(x.shape)
            module(x[:, :1], decode=True, deterministic=True, **call)
        else:
            module(x, deterministic=True)
    else:
        hidden_size = config.pop("hidden_size")
        module = fnnx.TransformerLayer(hidden_size, rngs=rngs, **config)
        decoder = config.get("layer_type") is DECODER
        encoded = call.pop("encoded", x if decoder else None)
        if call.get("decode"):
            module.init_cache(x.shape)
            x = x[:, :1]
        module(x, encoded, deterministic=True, **call)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_linen_refuses(case):
    with pytest.raises(case.error, match=case.match):
        run_linen(case)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_nnx_refuses_it_too(case):
    error = TypeError if case.nnx_match and "unexpected keyword" in case.nnx_match else case.error
    with pytest.raises(error, match=case.nnx_match or case.match):
        run_nnx(case)


def test_the_nnx_repro_of_issue_35():
    """The issue's repro: an NNX layer with a non-causal mask decoded silently (0.65 relative
    difference from its own forward); now the ValueError Linen gives."""
    layer = fnnx.TransformerLayer(
        32, mlp_hidden_size=64, num_attention_heads=4, self_attn_mask_type="no_mask", **SMALL,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    layer.init_cache((2, 8, 32))
    with pytest.raises(ValueError, match="decode=True needs a causal self-attention"):
        layer(jnp.ones((2, 1, 32)), deterministic=True, decode=True)


def test_a_causal_nnx_decode_still_runs():
    with fp8jax.autocast(enabled=False):
        layer = fnnx.TransformerLayer(16, **dict(mlp_hidden_size=32, num_attention_heads=2),
                                      **SMALL, rngs=nnx.Rngs(0))  # fmt: skip
    layer.init_cache((2, 4, 16))
    assert layer(jnp.ones((2, 1, 16)), deterministic=True, decode=True).shape == (2, 1, 16)


# ------------------------------------------------------------------------------ the walker


def _raise_lines(fn) -> set[tuple[str, int]]:
    """``(file, line)`` of every ``raise`` statement in ``fn``'s own body."""
    source, first = inspect.getsourcelines(fn)
    tree = ast.parse(textwrap.dedent("".join(source)))
    path = inspect.getsourcefile(fn)
    return {(path, first + node.lineno - 1) for node in ast.walk(tree)
            if isinstance(node, ast.Raise)}  # fmt: skip


def test_every_refusal_of_the_checks_has_a_case():
    checks = [inspect.unwrap(fn) for fn in CHECKS]  # Flax wraps module methods
    wanted = set().union(*(_raise_lines(fn) for fn in checks))
    codes = {fn.__code__ for fn in checks}
    reached: set[tuple[str, int]] = set()

    def tracer(frame, event, arg):
        if frame.f_code not in codes:
            return None

        def lines(frame, event, arg):
            if event == "line":
                reached.add((frame.f_code.co_filename, frame.f_lineno))
            return lines

        return lines

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        for case in CASES:
            try:
                run_linen(case)
            except (ValueError, TypeError):
                pass
    finally:
        sys.settrace(old)
    missing = sorted(wanted - reached)
    assert not missing, f"refusals of the shared checks with no case in CASES: {missing}"


def test_a_refused_fp8_dpa_warns_alike_in_both_apis():
    """fp8_dpa with a bias (which the FP8 attention does not take): one Fp8AttentionFallback
    warning naming it, from the Linen and the NNX MultiHeadAttention alike."""
    from fp8jax.layers import Fp8AttentionFallback

    cfg = dict(head_dim=4, num_attention_heads=2, fp8_dpa=True, attn_mask_type="no_mask")
    x, bias = jnp.ones((2, 4, 8)), jnp.zeros((1, 2, 4, 4))
    with fp8jax.autocast(enabled=True, recipe=fp8jax.Float8CurrentScaling()):
        linen = fflax.MultiHeadAttention(**cfg)
        variables = linen.init(jax.random.key(0), x, None)
        with pytest.warns(Fp8AttentionFallback, match="takes no bias"):
            linen.apply(variables, x, None, bias=bias)
        model = fnnx.MultiHeadAttention(8, **cfg, rngs=nnx.Rngs(0))
        with pytest.warns(Fp8AttentionFallback, match="takes no bias"):
            model(x, bias=bias)
