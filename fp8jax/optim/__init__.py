"""FP8 for memory: optimizer transforms (optax) whose state is stored in 8 bits (issue 39).

- :func:`adamw`: AdamW with both moments block-scaled in 8 bits, the first as FP8 E4M3, the
  second as uint8 codes of its square root (2.06 bytes per parameter for the two, against 8 in
  float32), dequantized, updated in float32 and re-quantized inside ``update``. With bfloat16
  parameters (no float32 master copy) the update is applied with stochastic rounding: 4.06
  bytes per parameter for params and optimizer state.
- :func:`scale_by_adam`, :func:`stochastic_rounding`: its parts, for your own ``optax.chain``.
- :func:`quantize_moment`, :func:`dequantize_moment`: the moment representation.

A drop-in for ``optax.adamw`` in ``fp8jax.flax.Fp8TrainState``, ``flax.nnx.Optimizer`` or
any optax loop::

    tx = optax.chain(optax.clip_by_global_norm(1.0), fp8jax.optim.adamw(schedule, weight_decay=0.1))

A NaN, inf or overflowing gradient makes the moments non-finite as in optax, through their 8-bit
storage. Under ``optax.inject_hyperparams`` the integers are static:
``optax.inject_hyperparams(fp8jax.optim.adamw, static_args=("block_size", "seed"))``.

The moments are sharded like their parameters (the scale grid has the parameter's rank, so
the same ``PartitionSpec`` fits both) and checkpoint with orbax like any optax state. Needs
optax (``pip install 'fp8jax[flax]'``); ``import fp8jax`` alone does not import it.
"""

from fp8jax.optim.adam import ScaleByAdamFp8State, adamw, scale_by_adam
from fp8jax.optim.moments import (
    BLOCK,
    MOMENT_FORMATS,
    BlockScaled,
    dequantize_moment,
    quantize_moment,
    scale_grid_shape,
)
from fp8jax.optim.rounding import StochasticRoundingState, round_to_bfloat16, stochastic_rounding

__all__ = [
    "BLOCK",
    "MOMENT_FORMATS",
    "BlockScaled",
    "ScaleByAdamFp8State",
    "StochasticRoundingState",
    "adamw",
    "dequantize_moment",
    "quantize_moment",
    "round_to_bfloat16",
    "scale_by_adam",
    "scale_grid_shape",
    "stochastic_rounding",
]
