"""The GPU memory this process holds, for what a piece of start-up state costs (the start log).

Counted from torch's allocator, not from the device's free memory: on a GPU shared with another
process (a second server started beside this one) the free memory moves with that process too, and
a capture of a few MiB read as gigabytes. The allocator holds the CUDA graphs' memory pools and the
libraries' workspaces; the graphs' own small driver allocations are not in it. torch is imported
inside the function only (a CPU server, the tests).
"""

from __future__ import annotations


def held_bytes() -> int | None:
    """The bytes torch's allocator holds on this process's GPU once its unused cache is returned
    (what the KV pool can no longer have); None without a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # blocks cached but unused are not the state's (a capture empties it too)
    return int(torch.cuda.memory_reserved())


def took(before: int | None, after: int | None) -> int | None:
    """What was taken between two readings of held_bytes (None where either has none)."""
    if before is None or after is None:
        return None
    return max(0, after - before)
