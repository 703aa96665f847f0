"""Host (CPU process) settings for the training step.

A CPU training step allocates and frees the same few-megabyte activation buffers every
step (a ``2048 x 512`` float activation is 4 MiB). glibc's malloc may serve blocks of
that size with ``mmap``, or trim them off its heap, and return them to the kernel on
``free``, so the next step touches fresh pages and pays a page fault per 4 KiB.
:func:`keep_freed_memory` asks malloc to keep freed blocks for reuse, as jemalloc or
tcmalloc (``LD_PRELOAD``) do by default. It removes those faults (tested).

Whether a process faults depends on its history: glibc raises its mmap threshold after
freeing a large mapped block, so a process that built a 2 GiB dense model serves
activations from its heap anyway, while a compressed model alone in its process (it
never frees anything that large) faulted ~3,500 times per Kaggle DLRM step and ran
10-25% slower (docs/performance.md). The trainer therefore applies it by default
(``trainer.keep_freed_memory``).

:func:`freeze_live_objects` takes what a process holds before training out of the cycle
collector's walks (``trainer.freeze_gc``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import resource

logger = logging.getLogger(__name__)

# mallopt parameters of glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

# glibc's own ceiling for its adaptive mmap threshold (HEAP_MAX_SIZE / 2 on 64-bit hosts),
# and the most that glibc before 2.26 accepts from mallopt
_MAX_MMAP_THRESHOLD = 32 * 1024 * 1024

_TOP_PAD = 64 * 1024 * 1024
_TRIM_THRESHOLD = 1 << 30

SERVING_MMAP_THRESHOLD = 256 * 1024 * 1024
"""The mmap threshold for scoring: an MLPerf DLRM-DCNv2 batch of 4096 rows makes
activations of 54 MiB (4096 x 3456 floats), above the default 32 MiB, each fresh pages
that fault on every batch (2.8x slower scoring measured, docs/serving.md)."""


def keep_freed_memory(
    top_pad_bytes: int = _TOP_PAD,
    trim_threshold_bytes: int = _TRIM_THRESHOLD,
    mmap_threshold_bytes: int = _MAX_MMAP_THRESHOLD,
) -> bool:
    """Make glibc malloc keep freed blocks up to ``mmap_threshold_bytes`` for reuse (process-wide).

    Blocks up to that size then come from the heap instead of fresh ``mmap`` pages, and the
    heap is not trimmed back to the kernel until ``trim_threshold_bytes`` lie free at its
    top. Peak RSS is unchanged (the same blocks are reused); steady-state RSS stays at
    the peak instead of falling between steps.

    Args:
        top_pad_bytes: extra bytes requested whenever the heap grows.
        trim_threshold_bytes: free bytes at the heap top before malloc returns them.
        mmap_threshold_bytes: blocks up to this size come from the heap (32 MiB: the
            trainer's; :data:`SERVING_MMAP_THRESHOLD` for scoring large batches). A C
            library that refuses more than 32 MiB gets 32 MiB.

    Returns:
        ``True`` when the settings were applied; ``False`` on a C library without
        ``mallopt`` (musl, macOS, Windows), where nothing changes.

    Example::

        >>> keep_freed_memory() in (True, False)
        True
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        logger.info("keep_freed_memory: no glibc mallopt here; allocator left as it is")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    threshold = min(mmap_threshold_bytes, 2**31 - 1)
    if not mallopt(_M_MMAP_THRESHOLD, threshold):
        threshold = _MAX_MMAP_THRESHOLD
    ok = all(
        mallopt(param, value)
        for param, value in (
            (_M_MMAP_THRESHOLD, threshold),
            (_M_TRIM_THRESHOLD, min(max(trim_threshold_bytes, threshold), 2**31 - 1)),
            (_M_TOP_PAD, min(top_pad_bytes, 2**31 - 1)),
        )
    )
    if not ok:
        logger.warning("keep_freed_memory: mallopt refused a setting; allocator partly unchanged")
    return ok


def freed_memory_environment(mmap_threshold_bytes: int = _MAX_MMAP_THRESHOLD) -> dict[str, str]:
    """:func:`keep_freed_memory`'s settings as glibc's environment tunables, for a child
    process that should not import comera-rec (it reads them at start).

    Example::

        >>> freed_memory_environment(SERVING_MMAP_THRESHOLD)["MALLOC_MMAP_THRESHOLD_"]
        '268435456'
    """
    return {
        "MALLOC_MMAP_THRESHOLD_": str(mmap_threshold_bytes),
        "MALLOC_TRIM_THRESHOLD_": str(max(_TRIM_THRESHOLD, mmap_threshold_bytes)),
        "MALLOC_TOP_PAD_": str(_TOP_PAD),
    }


def freeze_live_objects() -> int:
    """Collect garbage once, then move every object alive into the collector's permanent
    generation (``gc.freeze``), where its collections no longer traverse them.

    Call it once a training process has built its model: TorchRec's import alone leaves
    ~180k tracked objects (it imports Triton), and every full collection during training
    would walk them all. Objects frozen are never freed by the cycle collector (reference
    counting still frees them); what training allocates later is collected as usual.

    Returns:
        The number of objects frozen.

    Example::

        >>> import gc
        >>> freeze_live_objects() > 0
        True
        >>> gc.unfreeze()  # before tearing the model down: collectable again
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def minor_page_faults() -> int:
    """Minor page faults of this process so far (``getrusage``), to check the above."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
