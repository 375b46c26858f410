"""keep_freed_memory: glibc's malloc reuses a freed large tensor's pages instead of mapping
fresh ones that the kernel must fault in and zero (transformers_lab/run/memory.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from transformers_lab.run import components, memory

# read at collection, before conftest's fixture stands in for it
pytestmark = pytest.mark.skipif(
    memory.libc_mallopt() is None, reason="no glibc mallopt (not Linux with glibc)"
)

# tensors of 48 MiB (above the 32 MiB that glibc's mmap threshold can reach) made and freed
# one after another, as a training loop does: after 30 (malloc's heap finds its steady
# state: a freed block is reused once its neighbours are free too), the page faults of 10
FAULTS = """
import resource, sys
import torch
from transformers_lab.run.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def make_and_free(times):
    for _ in range(times):
        x = torch.ones(12 * 2**20)
        del x
make_and_free(30)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
make_and_free(10)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(setting: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", FAULTS, setting], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[-1])


@pytest.mark.slow  # page faults counted in a process of its own (make test-slow)
def test_a_freed_large_tensor_s_pages_are_reused_not_faulted_in_again():
    pages = 10 * 48 * 2**20 // 4096  # 10 tensors of 48 MiB in pages of 4 KiB
    default, kept = page_faults("default"), page_faults("keep")
    assert default >= pages // 2, (default, pages)  # glibc maps each one afresh
    assert kept < pages // 50, (kept, pages)


def test_the_commands_keep_freed_memory_unless_told_not_to(monkeypatch):
    calls = []
    monkeypatch.setattr(components, "keep_freed_memory", lambda: calls.append(1) or True)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the tests' own stay
    components.use_cpu(OmegaConf.create({"cpu_threads": 1}))  # a config from before the key
    components.use_cpu(OmegaConf.create({"cpu_threads": None, "keep_freed_memory": True}))
    assert len(calls) == 2
    components.use_cpu(OmegaConf.create({"cpu_threads": None, "keep_freed_memory": False}))
    assert len(calls) == 2
