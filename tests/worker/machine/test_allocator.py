import resource
import subprocess
import sys

import pytest

from worker.machine import allocator

# A language-model head's forward and backward (logits [8, 64, 32000] = 64 MiB, above glibc's
# largest dynamic mmap threshold), five times to settle, then the page faults of ten more.
PROBE = """
import resource, sys, torch
from worker.machine import allocator
if sys.argv[1] == "keep":
    assert allocator.keep_freed_memory()
h = torch.randn(8, 64, 64, requires_grad=True)
w = torch.randn(64, 32000, requires_grad=True)
def step():
    (h @ w).log_softmax(-1)[..., 0].sum().backward()
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = 64 * 2**20 // resource.getpagesize()  # one logits buffer, in the pages faults are counted in


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(allocator._glibc() is None, reason="glibc's mallopt is not available on this platform")
def test_kept_memory_is_reused_without_faulting_it_in_again():
    default = faults("default")
    assert default >= 10 * PAGES  # glibc's default: fresh mappings every step
    # The heap's pages, reused. Not none: where a freed block is too fragmented for the next
    # buffer the heap still grows, now and then (seen: 0-5 logits' worth in ten steps).
    assert faults("keep") < default / 4


RELEASE = """
import os, torch
from worker.machine import allocator
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
assert allocator.keep_freed_memory()
base = rss_mb()
x = torch.ones(64 * 2**20)  # 256 MiB, every page touched
del x
kept = rss_mb()
allocator.release_freed_memory()
print(kept - base, rss_mb() - base)
"""


@pytest.mark.skipif(allocator._glibc() is None, reason="glibc's malloc_trim is not available on this platform")
def test_release_hands_kept_memory_back():
    out = subprocess.run([sys.executable, "-c", RELEASE], check=True, capture_output=True, text=True)
    kept, released = map(float, out.stdout.split())
    assert kept > 200  # freed, but kept by the process
    assert released < 20  # back to the OS
