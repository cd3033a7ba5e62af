"""TransformerEngine's ``MeshResource``, for porting TE code.

TE names the mesh axes of each kind of parallelism in a ``MeshResource`` given to
``autocast(mesh_resource=...)``. fp8jax places its layers by Flax logical axis rules instead
(the modules' ``*_axes`` arguments, ``TransformerLayer(logical_axes=True)``, and
:func:`flax.linen.logical_axis_rules`; see ``fp8jax.flax.DEFAULT_RULES``), so
:func:`fp8jax.autocast` accepts an empty ``MeshResource`` (what TE's single-device examples
pass) and refuses one that names mesh axes, pointing at :meth:`MeshResource.axis_rules`, which
turns it into the equivalent rules.

>>> from fp8jax.sharding import MeshResource
>>> MeshResource(dp_resource="data", tp_resource="model").axis_rules()[:3]
(('batch', 'data'), ('length', None), ('embed', None))
"""

from __future__ import annotations

import dataclasses

__all__ = ["MeshResource"]


@dataclasses.dataclass(frozen=True)
class MeshResource:
    """Mesh axis names per kind of parallelism (TE's fields, order and defaults).

    Attributes:
      dp_resource: data parallelism (the batch dim).
      tp_resource: tensor parallelism (heads and the MLP width).
      tpsp_resource: tensor parallelism with sequence parallelism (as ``tp_resource`` for the
        weights; the sequence dim of the activations is split over it too).
      fsdp_resource: fully sharded data parallelism (the batch and the weights' model width).
      cp_resource: context parallelism: the sequence dim of the activations is split over it
        (``length``); name the same axis in the attention's ``context_parallel_axis``.
      pp_resource, ep_resource: pipeline and expert parallelism, which :meth:`axis_rules`
        refuses (fp8jax has no pipeline parallelism; its expert parallelism is the MoE
        layer's own).
    """

    dp_resource: str | None = None
    tp_resource: str | None = None
    tpsp_resource: str | None = None
    fsdp_resource: str | None = None
    pp_resource: str | None = None
    cp_resource: str | None = None
    ep_resource: str | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and not isinstance(value, str):
                raise TypeError(
                    f"MeshResource: {field.name} must be a mesh axis name (str) or None, got "
                    f"{value!r}"
                )

    def is_empty(self) -> bool:
        """Whether no mesh axis is named (a single device, or sharding set up elsewhere)."""
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))

    def axis_rules(self) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
        """The logical axis rules (for :func:`flax.linen.logical_axis_rules`) of fp8jax's axis
        names (those of ``fp8jax.flax.DEFAULT_RULES``) that shard as this ``MeshResource``.

        Raises:
          ValueError: for ``pp_resource`` or ``ep_resource`` (not implemented), or
            ``tp_resource`` and ``tpsp_resource`` (or ``cp_resource`` and ``tpsp_resource``)
            both set.
        """
        if self.pp_resource is not None:
            raise ValueError(
                f"MeshResource: pp_resource={self.pp_resource!r}: fp8jax implements data, "
                "FSDP, tensor, sequence, context and expert parallelism only"
            )
        if self.cp_resource is not None and self.tpsp_resource is not None:
            raise ValueError("MeshResource: set cp_resource or tpsp_resource, not both (both "
                             "split the sequence)")  # fmt: skip
        if self.ep_resource is not None:
            raise ValueError(
                f"MeshResource: ep_resource={self.ep_resource!r}: fp8jax's expert parallelism "
                "is the MoE layer's own (MoEBlock(expert_axis=...)); the experts' params are "
                "then split inside it, so no logical axis rule is needed"
            )
        if self.tp_resource is not None and self.tpsp_resource is not None:
            raise ValueError("MeshResource: set tp_resource or tpsp_resource, not both")
        batch = tuple(a for a in (self.dp_resource, self.fsdp_resource) if a is not None)
        model = self.tp_resource or self.tpsp_resource
        return (
            ("batch", batch[0] if len(batch) == 1 else (batch or None)),
            ("length", self.tpsp_resource or self.cp_resource),
            ("embed", self.fsdp_resource),
            ("mlp", model),
            ("heads", model),
            ("kv", None),
            ("act", None),
            ("relpos_buckets", None),
            ("exp", None),
        )
