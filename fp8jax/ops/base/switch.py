"""Which implementation each op family runs: the fp8jax FFI kernel or XLA's compilation of the
op's ``jnp`` reference.

Every op belongs to a *family* (``"cast"``: quantize, dequantize, cast_transpose(_dbias);
``"activation"``: the activations and their FP8 forms; ``"scaling"``: the delayed-scaling state
update; ``"gemm"``: the FP8 GEMM; ``"norm"``; ``"attention"``: the FP8 attention). For each
family a program picks

* ``"kernel"`` (the default of every family but the FP8 attention, :data:`DEFAULTS`): the fp8jax
  custom call (on CPU the C++ kernel, on CUDA the CUDA kernel, cuBLASLt or cuDNN), split over a
  mesh by fp8jax's own sharding rules;
* ``"xla"``: the op's ``*_reference`` function, compiled by XLA like any other ``jnp`` code. XLA
  fuses it with its neighbours and partitions it itself; no fp8jax extension is loaded for it.
  Numerics are those of the reference, which the kernels match bit for bit (the GEMM within its
  stated tolerance on a GPU; on CPU the GEMM is the reference either way; the norms within
  their stated tolerance, their reductions summing in another order).

The choice is made in code with :func:`implementation` (a context manager, reusable and usable
as a decorator), or per call with the ``implementation=`` keyword of each op, which wins. It is
read while tracing and held in a :func:`jax.make_user_context` context, so it is part of
:func:`jax.jit`'s cache key: a function traced under one choice is traced again under another.
The state is thread-local, like :func:`fp8jax.autocast`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any

import jax

__all__ = ["get_implementation", "implementation"]

IMPLEMENTATIONS: tuple[str, ...] = ("kernel", "xla")
"""The values an implementation choice can take."""

FAMILIES: dict[str, list[str]] = {}
"""Known op families and the ops in each (filled by :func:`register_family` as the op modules
are imported)."""

DEFAULTS: dict[str, str] = {
    "cast": "kernel",
    "activation": "kernel",
    "scaling": "kernel",
    "gemm": "kernel",
    "norm": "kernel",
    "attention": "xla",
}
"""What each family runs outside any :func:`implementation` block, on CPU and on a GPU (a
family missing here: its kernel). The one place to change a default. On a GPU each entry is
the one the H100 figures of docs/performance.md and the whole-step predictions of
benchmarks/structure.py (``--families``: each family on XLA in turn) favour, every one the
kernel; docs/gpu-tuning.md ("Defaults") names the run or prediction behind each. The FP8
attention is the exception, on its reference: cuDNN's backward takes a term from its FP8
output that the reference does not, and emulated on CPU that trained the GPT demo 22-31% worse
(fp8jax/ops/attention/fp8_attention.py; ``implementation(attention="kernel")`` opts in). A
default changes here only with a GPU run or a prediction that decides it."""


def register_family(name: str, op: str) -> str:
    """Declares that ``op`` belongs to family ``name`` (a new family on first use); returns
    ``name``. Called by :class:`fp8jax.ops.base.opdef.OpDef` and by ``gemm``."""
    if not name.isidentifier():
        raise ValueError(f"register_family: name must be an identifier, got {name!r}")
    ops = FAMILIES.setdefault(name, [])
    if op not in ops:
        ops.append(op)
    return name


def _known() -> str:
    return ", ".join(f"{f} ({', '.join(ops)})" for f, ops in sorted(FAMILIES.items()))


@dataclasses.dataclass(frozen=True)
class _State:
    """Hashable (it is part of jit's cache key): the choice of families not listed in
    ``families`` is ``default``, or with ``default=None`` the family's :data:`DEFAULTS` entry."""

    default: str | None = None
    families: tuple[tuple[str, str], ...] = ()

    def of(self, family: str) -> str:
        chosen = dict(self.families).get(family, self.default)
        return chosen if chosen is not None else DEFAULTS.get(family, "kernel")


# Created once, at import: jax.make_user_context must not be called concurrently with other JAX
# APIs. Using the context afterwards (from any thread) is thread-safe and thread-local.
_CONTEXT = jax.make_user_context(default_value=_State())


def _value(fn: str, name: str, value: Any) -> str:
    if not isinstance(value, str) or value not in IMPLEMENTATIONS:
        raise ValueError(f"{fn}: {name} must be 'kernel' or 'xla', got {value!r}")
    return value


class _Context(contextlib.ContextDecorator):
    """Enters the state that ``implementation(...)`` asked for, on top of the enclosing one."""

    def __init__(self, default: str | None, families: dict[str, str]) -> None:
        self._default = default
        self._families = families
        self._local = threading.local()  # per-thread stack of entered jax contexts

    def _state(self) -> _State:
        outer = _CONTEXT.value
        if self._default is None:  # only the named families change
            default, families = outer.default, dict(outer.families) | self._families
        else:
            default, families = self._default, self._families

        def implied(f: str) -> str:  # what the family runs unlisted
            return default if default is not None else DEFAULTS.get(f, "kernel")

        # Canonical: a family that chose its implied value is not listed, so equal choices are
        # one key.
        return _State(
            default, tuple(sorted((f, v) for f, v in families.items() if v != implied(f)))
        )

    def __enter__(self) -> None:
        stack = self._local.__dict__.setdefault("stack", [])
        ctx = _CONTEXT(self._state())
        ctx.__enter__()
        stack.append(ctx)

    def __exit__(self, *exc_info: Any) -> None:
        self._local.stack.pop().__exit__(*exc_info)

    def __repr__(self) -> str:
        args = [repr(self._default)] if self._default is not None else []
        args += [f"{k}={v!r}" for k, v in self._families.items()]
        return f"implementation({', '.join(args)})"


def implementation(
    default: str | None = None, /, **families: str
) -> contextlib.AbstractContextManager[None]:
    """Context manager choosing ``"kernel"`` or ``"xla"`` for the fp8jax ops traced inside it.

    Args:
      default: the choice for every op family (``None``: keep the enclosing block's choices for
        the families not named).
      **families: the choice for one family, overriding ``default``: ``cast`` (quantize,
        dequantize, cast_transpose(_dbias)), ``activation`` (activation, dactivation and their
        FP8 forms), ``scaling`` (update_fp8_state(s)), ``gemm``, ``norm`` (norm_forward(_fp8),
        norm_backward, layernorm, rmsnorm), ``attention`` (the FP8 attention: cuDNN's, or its
        reference).

    Returns:
      A context manager (also a decorator, reusable); the arguments are checked here.

    Raises:
      ValueError: a value that is not ``"kernel"`` or ``"xla"``, or an unknown family.

    Outside any block each family runs its :data:`DEFAULTS` entry (every one its kernel but the
    FP8 attention).
    Blocks nest; an op's own
    ``implementation=`` argument overrides them all. The choice is part of :func:`jax.jit`'s
    cache key, so switching retraces instead of reusing a stale trace.

    >>> import jax.numpy as jnp, fp8jax
    >>> with fp8jax.ops.implementation("xla"):        # every family: XLA's compilation
    ...     q, s_inv, amax = fp8jax.ops.quantize(jnp.ones(4), jnp.float32(2), jnp.float8_e4m3fn)
    >>> with fp8jax.ops.implementation(cast="xla", gemm="kernel"):
    ...     print(fp8jax.ops.get_implementation("cast"), fp8jax.ops.get_implementation("gemm"))
    xla kernel
    """
    fn = "implementation"
    if default is not None:
        _value(fn, "default", default)
    for name, value in families.items():
        if name not in FAMILIES:
            raise ValueError(f"{fn}: unknown op family {name!r}; the families are {_known()}")
        _value(fn, name, value)
    return _Context(default, dict(families))


def get_implementation(family: str) -> str:
    """The implementation the innermost :func:`implementation` block of this thread chose for
    ``family`` (its :data:`DEFAULTS` entry outside any block)."""
    if family not in FAMILIES:
        raise ValueError(
            f"get_implementation: unknown op family {family!r}; the families are {_known()}"
        )
    return _CONTEXT.value.of(family)


def choose(op: str, family: str, value: Any) -> str:
    """What ``op`` of ``family`` runs: its ``implementation=`` argument ``value`` when given
    (validated, the error naming ``op``), else the enclosing :func:`implementation` choice."""
    if value is None:
        return _CONTEXT.value.of(family)
    return _value(op, "implementation", value)
