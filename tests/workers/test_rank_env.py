"""A rank actor's allocator settings, set in its own process before torch loads
([Note: rank settings in process] in workers/rank_env.py)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.rank_actor import FORWARDED_CALLS, RankActor
from workers.rank_env import set_mmap_threshold

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import ctypes, ctypes.util, json, sys
settings, torch_first = json.loads(sys.argv[1]), sys.argv[2] == "1"
if torch_first:
    import torch
from workers.rank_env import apply_in_process
try:
    apply_in_process(settings)
except RuntimeError as e:
    print(json.dumps({"error": str(e)}))
    raise SystemExit(0)
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
freed = torch.empty(2**22)  # 16 MiB mapped, then freed: glibc's own threshold rises past it
del freed
before = libc.mallinfo2().hblkhd
block = torch.empty(2**18)  # 1 MiB
mapped = libc.mallinfo2().hblkhd - before

def thp_eligible(tensor):  # THPeligible of the mapping that holds it
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= tensor.data_ptr() < hi
        elif inside and line.startswith("THPeligible:"):
            return int(line.split()[1])
    return None

ones = torch.ones(2**24)  # 64 MiB
print(json.dumps({"mapped": mapped, "eligible": thp_eligible(ones)}))
"""


def _probe(settings: dict[str, str], torch_first: bool = False) -> dict:
    """A fresh interpreter that applies ``settings`` and reports what its allocations got."""
    env = {k: v for k, v in os.environ.items() if k not in settings}
    for name in ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"):
        env.pop(name, None)  # glibc's and torch's own defaults, whatever this process has
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(settings), "1" if torch_first else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "never"


def test_the_actor_forwards_every_public_method_of_the_rank_worker():
    from workers.rank import RankWorker

    public = {
        name
        for name, member in inspect.getmembers(RankWorker, inspect.isfunction)
        if not name.startswith("_")
    }
    assert set(FORWARDED_CALLS) == public
    assert all(callable(getattr(RankActor, name)) for name in FORWARDED_CALLS)


def test_settings_applied_in_the_process_take_effect_as_if_it_started_with_them():
    """The threshold maps a 1 MiB block that glibc's own (risen) threshold keeps in its
    heap; torch asks for huge pages for its 64 MiB tensor (where the kernel's mode is
    ``madvise``, only a mapping that asked is eligible)."""
    plain = _probe({})
    applied = _probe({"MALLOC_MMAP_THRESHOLD_": "131072", "THP_MEM_ALLOC_ENABLE": "1"})
    assert plain["mapped"] == 0
    assert applied["mapped"] >= 2**20
    mode = _thp_mode()
    if mode == "never" or applied["eligible"] is None:
        pytest.skip(f"transparent huge pages: mode {mode!r}, THPeligible not reported")
    assert applied["eligible"] == 1
    if mode == "madvise":
        assert plain["eligible"] == 0


def test_huge_pages_asked_for_after_torch_loaded_are_an_error():
    result = _probe({"THP_MEM_ALLOC_ENABLE": "1"}, torch_first=True)
    assert "cannot take effect" in result["error"]
    assert "host_allocator: inherit" in result["error"]


@pytest.mark.parametrize("value", ["128k", "-1", str(2**40)])
def test_a_threshold_that_is_not_a_size_is_an_error(value):
    """Refused before glibc is asked (a call it took would change this process)."""
    with pytest.raises(ValueError, match="MALLOC_MMAP_THRESHOLD_"):
        set_mmap_threshold(value)
