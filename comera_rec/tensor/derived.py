"""Values derived from parameters, kept between forwards that cannot change them.

A TT module derives tensors from its parameters on every forward: the cores with their
rank controllers folded in, a TT layer's two merged chains, the lookup's permuted core
copies. In training each step changes the parameters, so the work is redone and
differentiated. When a model only scores (no gradients) its parameters stay the same from
batch to batch, and at a batch of one row that recomputation is most of a lookup's time.

Inside :func:`cached_weights` (like ``torch.nn.utils.parametrize.cached``), with gradients
off, each such value is computed once and kept. A kept value is handed back only while
every tensor it came from is the same tensor with the same storage and version counter, so
an in-place write (``load_state_dict``, an optimiser step), ``.to()`` or a rank truncation
inside the scope still gives fresh values; writes through ``.data`` do not move the version
counter and are not seen, which is why nothing is kept outside the scope. Leaving the
outermost scope drops every kept value.

Example::

    >>> from comera_rec.tensor import TTLinear
    >>> layer = TTLinear(16, 8, rank=2)
    >>> with torch.inference_mode(), cached_weights():
    ...     y = [layer(torch.randn(1, 16)) for _ in range(3)]  # the chains merged once
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable, Iterator, Sequence, TypeVar

import torch

_V = TypeVar("_V")


class _Scope(threading.local):
    depth = 0
    filled: dict  # id -> weak reference of each cache that kept a value in this scope

    def __init__(self) -> None:
        self.filled = {}


_SCOPE = _Scope()


@contextlib.contextmanager
def cached_weights() -> Iterator[None]:
    """Keep values derived from parameters between forwards without gradients (scoring).

    Nests; leaving the outermost scope drops every value kept in it. See the module
    docstring for what counts as a change.
    """
    _SCOPE.depth += 1
    try:
        yield
    finally:
        _SCOPE.depth -= 1
        if _SCOPE.depth == 0:
            for ref in _SCOPE.filled.values():
                cache = ref()
                if cache is not None:
                    cache.clear()
            _SCOPE.filled = {}


def _note_filled(cache: object) -> None:
    _SCOPE.filled[id(cache)] = weakref.ref(cache)


def _fingerprint(tensors: Sequence[torch.Tensor]) -> tuple:
    # identity (weakly held: a cache must not keep replaced parameters alive), storage,
    # version counter (bumped by every in-place write; inference tensors have none, and
    # only values derived under inference mode are such, see cache_applies), shape, dtype, device
    return tuple(
        (weakref.ref(t), t.data_ptr(), -1 if t.is_inference() else t._version, tuple(t.shape), t.dtype, t.device)
        for t in tensors
    ) + (torch.is_inference_mode_enabled(),)


def _matches(kept: tuple, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` still have the fingerprint ``kept`` (compared in place: making a
    fingerprint, weak references included, costs more than a one-row layer's arithmetic)."""
    if len(kept) != len(tensors) + 1 or kept[-1] != torch.is_inference_mode_enabled():
        return False
    # the same tensor object, storage and shape: its device is the same too (not compared,
    # making a device object per tensor costs as much as the rest); an inference tensor
    # (-1) still is one, and keeps no version counter
    for (ref, ptr, version, shape, dtype, _), t in zip(kept, tensors):
        if (
            ref() is not t
            or t.data_ptr() != ptr
            or (version >= 0 and t._version != version)
            or t.shape != shape
            or t.dtype != dtype
        ):
            return False
    return True


def _capturing() -> bool:
    # a CUDA graph would bake a kept value's address in and outlive the scope that keeps it
    # (no capture without CUDA initialised; is_available() costs ~2 us a call on a CPU host)
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def scoring_cache_on() -> bool:
    """The conditions of :func:`cache_applies` that do not depend on the tensors: inside
    :func:`cached_weights`, gradients off, no tracing, compiling or CUDA graph capture."""
    return (
        _SCOPE.depth > 0
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
        and not _capturing()
    )


def _tensors_apply(tensors: Sequence[torch.Tensor]) -> bool:
    # the conditions of cache_applies on each tensor: checked when a value is kept; a kept
    # value's fingerprint then vouches for them (the same tensors, storage and shape)
    return all(
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and not t.is_meta
        and not (isinstance(t, torch.nn.Parameter) and t.is_inference())
        for t in tensors
    )


def cache_applies(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a value derived from ``tensors`` may be kept: inside :func:`cached_weights`,
    gradients off, no tracing, compiling or CUDA graph capture, plain (not meta, not
    subclassed) tensors, and no parameter made under ``torch.inference_mode`` (its in-place
    writes would go unseen: such tensors keep no version counter)."""
    return scoring_cache_on() and _tensors_apply(tensors)


def _tensor_bytes(value: object) -> int:
    # bytes of the tensors in a kept value (a tensor, or a tuple / list of them)
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class DerivedCaches:
    """Values derived from sets of tensors, each computed again only when one of its
    tensors changed; the last ``slots`` sets used are kept (least recently used out), and
    with ``max_bytes`` no more than that many bytes of tensors (least recently used out
    first; a value larger than the bound alone is still kept, alone).

    Where :func:`cache_applies` does not hold (outside :func:`cached_weights`, gradients
    on, tracing) it computes every time and keeps nothing. Copies and pickles start empty.
    For callers without a module to hold a :class:`DerivedCache`.

    Example::

        >>> a, b = torch.ones(2), torch.zeros(2)
        >>> caches = DerivedCaches(slots=2)
        >>> with torch.no_grad(), cached_weights():
        ...     first = caches.get([a], lambda: a + 1)
        ...     _ = caches.get([b], lambda: b + 1)
        ...     caches.get([a], lambda: a + 2) is first
        True
    """

    def __init__(self, slots: int, max_bytes: int | None = None) -> None:
        if slots < 1:
            raise ValueError(f"{type(self).__name__}: slots must be positive, got {slots}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"{type(self).__name__}: max_bytes must be >= 0, got {max_bytes}")
        self.__setstate__({"slots": slots, "max_bytes": max_bytes})

    def get(self, sources: Sequence[torch.Tensor], compute: Callable[[], _V]) -> _V:
        """``compute()``, or the value it gave for the same, unmodified ``sources``."""
        if not scoring_cache_on():
            return compute()
        kept = self.peek(sources)
        if kept is not None:
            return kept  # type: ignore[return-value]
        return self._compute(sources, compute)

    def get_when(
        self, sources: Sequence[torch.Tensor], compute: Callable[[], _V], when: Callable[[], bool]
    ) -> _V | None:
        """:meth:`get` where ``when()`` holds, else ``None``; ``when`` (the caller's own
        check that ``compute`` applies) is asked only if nothing is kept for ``sources``: a
        kept value was made where it held, for the same tensors."""
        kept = self.peek(sources)
        if kept is not None:
            return kept  # type: ignore[return-value]
        if not when():
            return None
        return self._compute(sources, compute)

    def _compute(self, sources: Sequence[torch.Tensor], compute: Callable[[], _V]) -> _V:
        # nothing kept for sources: compute, and keep the value where it may be kept
        if not scoring_cache_on() or not _tensors_apply(sources):
            return compute()
        with self._lock:  # shared by every thread that scores
            # entries whose sources are gone can never match again; the least recently
            # used goes before the new value is made, so at most `slots` are ever held
            self._entries = [e for e in self._entries if all(x[0]() is not None for x in e[0][:-1])]
            del self._entries[: len(self._entries) - self.slots + 1]
            key = _fingerprint(sources)  # the sources as compute() reads them
            value = compute()
            size = _tensor_bytes(value)
            if self.max_bytes is not None:
                held = sum(e[2] for e in self._entries)
                while self._entries and held + size > self.max_bytes:
                    held -= self._entries.pop(0)[2]
            self._entries.append((key, value, size))
        _note_filled(self)
        return value

    def peek(self, sources: Sequence[torch.Tensor]) -> object | None:
        """The value kept for the same, unmodified ``sources``, or ``None`` (nothing kept
        for them, or a value may not be used here: see :func:`cache_applies`). A value is
        kept only for tensors :func:`cache_applies` took, and a match means the same
        tensors, so their own conditions are not checked again (a one-row batch's
        lookups and layers each ask once per call)."""
        if not self._entries or not scoring_cache_on():
            return None
        with self._lock:
            for i, (kept, value, _) in enumerate(self._entries):
                if _matches(kept, sources):
                    if i != len(self._entries) - 1:
                        self._entries.append(self._entries.pop(i))  # most recently used last
                    return value
        return None

    def clear(self) -> None:
        """Drop every kept value."""
        with self._lock:
            self._entries.clear()

    def is_empty(self) -> bool:
        """Whether nothing is kept."""
        return not self._entries

    def __len__(self) -> int:
        """How many values are kept."""
        return len(self._entries)

    def nbytes(self) -> int:
        """Bytes of the tensors kept."""
        return sum(e[2] for e in self._entries)

    def __getstate__(self) -> dict:
        return {"slots": self.slots, "max_bytes": self.max_bytes}  # copies and pickles keep no values

    def __setstate__(self, state: dict) -> None:
        self.slots = state["slots"]
        self.max_bytes = state.get("max_bytes")
        self._entries: list[tuple[tuple, object, int]] = []  # (fingerprint, value, bytes)
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> "DerivedCaches":
        copy = object.__new__(type(self))
        copy.__setstate__(self.__getstate__())
        return copy


class DerivedCache(DerivedCaches):
    """One value derived from some tensors (a :class:`DerivedCaches` of one slot), held by
    a module (:func:`derived_cache`).

    Example::

        >>> w = torch.nn.Parameter(torch.ones(3))
        >>> cache, calls = DerivedCache(), []
        >>> def double():
        ...     calls.append(1)
        ...     return w * 2
        >>> with torch.no_grad(), cached_weights():
        ...     _ = cache.get([w], double); _ = cache.get([w], double)
        ...     _ = w.add_(1)  # an in-place write: computed again
        ...     _ = cache.get([w], double)
        >>> len(calls)
        2
    """

    def __init__(self) -> None:
        super().__init__(slots=1)


def derived_cache(module: torch.nn.Module, name: str) -> DerivedCache:
    """``module``'s cache called ``name``, made on first use (modules built before this
    attribute existed, or restored by ``copy`` / ``pickle``, get one too). While compiling,
    a cache that keeps nothing (nothing is kept then), so that dynamo does not trace the
    making of a cache and its lock: each was a graph break."""
    if torch.compiler.is_compiling():
        return _KEEPS_NOTHING
    caches = module.__dict__.setdefault("_derived_caches", {})
    if name not in caches:
        caches[name] = DerivedCache()
    return caches[name]


_KEEPS_NOTHING = DerivedCache()  # made here, not under dynamo; it never holds a value while compiling


def clear_derived_caches(module: torch.nn.Module) -> None:
    """Drop every value ``module`` keeps (its parameters are about to be replaced)."""
    for cache in module.__dict__.get("_derived_caches", {}).values():
        cache.clear()
