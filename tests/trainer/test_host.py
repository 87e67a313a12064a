import subprocess
import sys

import pytest

_CHILD = """
import resource, sys, torch
from gspo.trainer.host import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
torch.ones(64 * 2**20 // 4)  # 64 MiB, freed at once
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    torch.ones(64 * 2**20 // 4)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc tuning")
def test_keep_freed_memory_stops_large_tensors_from_page_faulting_again():
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True,
                             text=True, check=True).stdout.split()
        return out[0], int(out[1])

    applied, kept = faults("keep")
    _, plain = faults("plain")
    pages = 5 * 64 * 2**20 // 4096
    assert applied == "True"
    assert plain > pages // 2  # each fresh 64 MiB mmap faults its pages in
    assert kept < pages // 5 + 1000  # at most one of the five faults in: the rest reuse it
