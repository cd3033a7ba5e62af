"""The plain-Flax twin of ``fp8jax.flax.MoEBlock``: the same params (names, shapes), computed
with plain JAX (``jax.lax.top_k``, ``argsort``, ``jax.lax.ragged_dot``), no fp8jax. With FP8 off
the fp8jax block must equal it bit for bit."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

ACT = {"silu": jax.nn.silu, "gelu": lambda v: jax.nn.gelu(v, approximate=True)}


class PlainMoE(nn.Module):
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    activation_type: str = "silu"
    score_function: str = "softmax"
    use_expert_routing_bias: bool = False
    use_ffn_bias: bool = False

    @nn.compact
    def __call__(self, x):
        h = x.shape[-1]
        e, k, i = self.num_experts, self.num_experts_per_tok, self.intermediate_size
        init = nn.initializers.lecun_normal()
        gate = self.param("gate_kernel", init, (h, e))
        wi_0 = self.param("wi_0", init, (e, h, i))
        wi_1 = self.param("wi_1", init, (e, h, i))
        wo = self.param("wo", init, (e, i, h))
        bias = (
            self.param("expert_bias", nn.initializers.zeros, (e,))
            if (self.use_expert_routing_bias)
            else None
        )
        if self.use_ffn_bias:
            b0 = self.param("wi_0_bias", nn.initializers.zeros, (e, i))
            b1 = self.param("wi_1_bias", nn.initializers.zeros, (e, i))
            bo = self.param("wo_bias", nn.initializers.zeros, (e, h))
        tokens = x.reshape(-1, h)
        t = tokens.shape[0]
        logits = jnp.matmul(
            tokens.astype(jnp.float32),
            gate.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        if self.score_function == "softmax":
            _, idx = jax.lax.top_k(logits, k)
            weights = jax.nn.softmax(jnp.take_along_axis(logits, idx, -1), -1)
        else:
            scores = jax.nn.sigmoid(logits)
            _, idx = jax.lax.top_k(scores if bias is None else scores + bias, k)
            chosen = jnp.take_along_axis(scores, idx, -1)
            weights = chosen / (chosen.sum(-1, keepdims=True) + 1e-20)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
        rows = tokens[order // k]
        gid = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(t * k), side="right")
        h1 = jax.lax.ragged_dot(rows, jnp.concatenate([wi_0, wi_1], -1), sizes)
        if self.use_ffn_bias:
            h1 = h1 + jnp.concatenate([b0, b1], -1)[gid]
        a = ACT[self.activation_type](h1[:, :i]) * h1[:, i:]
        y = jax.lax.ragged_dot(a, wo, sizes)
        if self.use_ffn_bias:
            y = y + bo[gid]
        per = jnp.zeros_like(y).at[order].set(y).reshape(t, k, h)
        out = jnp.einsum("tk,tkh->th", weights, per.astype(jnp.float32)).astype(x.dtype)
        return out.reshape(x.shape)
