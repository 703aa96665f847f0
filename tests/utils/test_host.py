"""keep_freed_memory: freed activation-sized buffers are reused, not page-faulted again;
freeze_live_objects: what lives at the call leaves the collector's walks, later garbage does not."""

import subprocess
import sys
import textwrap

import pytest


def page_fault_probe(buffer_shape: tuple[int, int], count: int, first: str, then: str) -> tuple[bool, float, float]:
    """Page faults per round of ``count`` buffers allocated and freed together, in a fresh
    interpreter (the malloc settings are process-wide and must not leak into the suite):
    ``(applied, faults after `first`, faults after `then`)``, each setting a statement."""
    probe = textwrap.dedent(
        f"""
        import torch
        from comera_rec.utils.host import SERVING_MMAP_THRESHOLD, keep_freed_memory, minor_page_faults

        def faults_per_round():
            start = minor_page_faults()
            for _ in range(5):
                buffers = [torch.ones{buffer_shape} for _ in range({count})]
                del buffers
            return (minor_page_faults() - start) / 5

        {first}
        before = faults_per_round()
        applied = {then}
        faults_per_round()  # the heap grows to hold them once
        print(applied, before, faults_per_round())
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", float(out[1]), float(out[2])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_keep_freed_memory_stops_page_faults_on_reused_buffers():
    # 8 x 4 MiB (Kaggle-step activations) under glibc's defaults, then the trainer's setting
    applied, before, after = page_fault_probe((2048, 512), 8, "pass", "keep_freed_memory()")
    assert applied
    # 32 MiB of fresh pages is 8192 faults a round (glibc's own adaptive threshold sometimes
    # keeps part of it: ~1700 seen); reused heap memory needs next to none
    assert before > 1000, f"expected page faults before tuning, got {before}"
    assert after < before / 4, f"page faults per round: {before} before, {after} after"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_serving_threshold_reuses_blocks_above_32_mib():
    # 2 x 54 MiB (MLPerf-batch activations): the trainer's 32 MiB still maps them afresh
    applied, before, after = page_fault_probe(
        (4096, 3456), 2, "keep_freed_memory()", "keep_freed_memory(mmap_threshold_bytes=SERVING_MMAP_THRESHOLD)"
    )
    assert applied
    assert before > 10000, f"expected 108 MiB of fresh pages a round, got {before} faults"
    assert after < before / 4, f"page faults per round: {before} before, {after} after"


FREEZE_PROBE = textwrap.dedent(
    """
    import gc
    from comera_rec.utils.host import freeze_live_objects

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a  # freed only by the cycle collector

    cycle()  # garbage before the freeze: collected by it
    frozen = freeze_live_objects()
    in_young = len(gc.get_objects())  # the frozen ones are no longer listed
    cycle()  # garbage after the freeze: still collected
    found = gc.collect()
    gc.unfreeze()
    print(frozen, in_young, found, gc.get_freeze_count())
    """
)


def test_freeze_live_objects_hides_what_lives_and_collects_later_garbage():
    out = subprocess.run([sys.executable, "-c", FREEZE_PROBE], capture_output=True, text=True, check=True)
    frozen, listed, found, after_unfreeze = (int(v) for v in out.stdout.split())
    assert frozen > 1000 and listed < frozen  # the interpreter's and torch's objects, hidden
    assert found >= 2  # the later cycle's two objects
    assert after_unfreeze == 0
