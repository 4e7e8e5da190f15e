"""The daemon gives a burst's freed heap back to the kernel (daemon/io/heap.py): the policy's
rules, and a real glibc heap that keeps 64 MiB of freed chunks until the trimmer runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from hypothesis import given
from hypothesis import strategies as st

from kvpush.daemon.io.heap import MiB, TrimPolicy


def test_no_trim_below_the_growth_nor_twice_within_the_interval():
    p = TrimPolicy(grow_bytes=16 * MiB, every_s=10.0)
    assert not p.due(0.0, 100 * MiB)  # the first reading sets the floor
    assert not p.due(1.0, 200 * MiB)  # read again only one interval later
    assert p.due(10.0, 120 * MiB)
    p.trimmed(10.0, 120 * MiB, 101 * MiB)
    assert not p.due(15.0, 200 * MiB)
    assert p.due(20.0, 200 * MiB)


def test_a_useless_trim_doubles_the_wait_and_a_useful_one_resets_it():
    p = TrimPolicy(grow_bytes=16 * MiB, every_s=10.0, max_every_s=40.0)
    p.due(0.0, 100 * MiB)
    now = 10.0
    waits = []
    for _ in range(4):  # the heap is legitimately larger: nothing to give back
        assert p.due(now, 150 * MiB)
        p.trimmed(now, 150 * MiB, 150 * MiB)
        waits.append(p.wait_s)
        now = p.next_at
    assert waits == [20.0, 40.0, 40.0, 40.0]
    assert p.due(now, 150 * MiB)
    p.trimmed(now, 150 * MiB, 102 * MiB)
    assert p.wait_s == 10.0 and p.floor == 100 * MiB


@given(st.lists(st.tuples(st.floats(0, 50), st.integers(0, 4096), st.integers(0, 4096)), max_size=60))
def test_never_two_trims_closer_than_the_interval(steps):
    p = TrimPolicy(grow_bytes=16 * MiB, every_s=10.0)
    now, last = 0.0, None
    for dt, anon_mib, freed_mib in steps:
        now += dt
        anon = anon_mib * MiB
        if p.due(now, anon):
            assert anon - p.floor >= p.grow_bytes
            assert last is None or now - last >= p.every_s - 1e-6
            last = now
            p.trimmed(now, anon, max(0, anon - freed_mib * MiB))


CHILD = textwrap.dedent("""
    import ctypes, ctypes.util, json
    from kvpush.daemon.io.heap import HeapTrimmer, TrimPolicy, anon_bytes
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 64 KiB chunks come from the heap, not mmap
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() itself never trims
    trimmer = HeapTrimmer(TrimPolicy(grow_bytes=8 << 20, every_s=0.0))
    trimmer.tick(0.0)  # the floor
    chunks = [libc.malloc(64 << 10) for _ in range(1024)]
    for c in chunks:
        ctypes.memset(c, 1, 64 << 10)
    pin = libc.malloc(64)  # keeps the heap's top: only a trim of free pages gives them back
    for c in chunks:
        libc.free(c)
    held = anon_bytes()
    freed = trimmer.tick(1.0)
    print(json.dumps({"held": held, "after": anon_bytes(), "freed": freed}))
""")


def test_a_real_heap_gives_freed_chunks_back():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=True)
    r = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert r["freed"] >= 48 * MiB, r  # of 64 MiB freed by the program, the trim gave most back
    assert r["held"] - r["after"] >= 48 * MiB, r
