"""TransformerEngine's ``transformer_engine.jax.sharding``: ``MeshResource`` and its guard.

:class:`MeshResource` is fp8jax's (:mod:`fp8jax.sharding`: TE's fields, and
:meth:`~fp8jax.sharding.MeshResource.axis_rules` giving the Flax logical axis rules by which
fp8jax places its layers). :func:`global_shard_guard` records the resource for the block, as
TE's does (:func:`global_mesh_resource` reads it); fp8jax's layers are placed by the logical
axis rules in force (:func:`flax.linen.logical_axis_rules`), so enter both where a mesh is used:

>>> import flax.linen as nn
>>> res = MeshResource(dp_resource="data")
>>> with global_shard_guard(res), nn.logical_axis_rules(res.axis_rules()):
...     global_mesh_resource().dp_resource
'data'
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from fp8jax.sharding import MeshResource

__all__ = ["MeshResource", "global_mesh_resource", "global_shard_guard"]

_current = threading.local()


@contextlib.contextmanager
def global_shard_guard(resource: MeshResource) -> Iterator[None]:
    """Makes ``resource`` the mesh resource of this thread for the block (TE's guard)."""
    if not isinstance(resource, MeshResource):
        raise TypeError(
            f"global_shard_guard: resource must be a MeshResource, got {type(resource).__name__}"
        )
    old = getattr(_current, "resource", None)
    _current.resource = resource
    try:
        yield
    finally:
        _current.resource = old


def global_mesh_resource() -> MeshResource:
    """The resource of the innermost :func:`global_shard_guard` (an empty one outside any)."""
    resource = getattr(_current, "resource", None)
    return MeshResource() if resource is None else resource
