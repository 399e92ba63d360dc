"""A prefill's draft K/V while the mode is plain, replayed as one CUDA graph per token count.

A prefill while the mode is plain writes only the one-layer draft's K/V of its tokens
(draft_kv.py): its own inputs (each token shifted by one, each request's tail, the positions after
its cached prefix) and the draft's embedding, norms, fc, K/V projection, rope and KV write, some
twenty launches and their Python between the target's prefill and the next decode step. At a
server's full load a prefill of a few short prompts comes every step or two, and the eager path
cost a threshold server's plain step 0.4 ms of host time against a plain server's
(docs/validation.md row 57). Here the same work runs from fixed buffers, padded to the next of a
few token counts, as one captured graph a count: five copies in and one replay. Opt-in
(SGLANG_IMAGE_PREFILL_KV_GRAPHS=1): on an H100 it cut 0.36 ms of host time a plain step at 256
requests but no throughput (rows 62-63); a host with slower CPUs may gain. After the capture the graphs
are checked against the eager write on the server's own GPU (check()), and used only if they agree.

A padded row writes the pool's padding slot 0 (upstream never gives slot 0 to a request), at
position 0, as deferred_kv.py's padded rows do. A prefill above the largest count, several GPUs
(the draft's embedding all-reduces) or a CPU run the eager path. sglang and torch are imported
inside the functions only.
"""

from __future__ import annotations

import bisect
from typing import Any

from sglang_image_plugin import draft_kv, gpu_memory
from sglang_image_plugin.setting import PREFILL_KV_GRAPHS_ENV

# The token counts a prefill is padded to: the next one up, at most 1.5x its own count above 16
# (the draft's work on the padding is small beside the target's prefill), up to 1,024 tokens; a
# longer prefill is GPU-bound and runs eagerly.
TOKEN_COUNTS = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
# Set to 1 to write a prefill's draft K/V from the graphs (otherwise eagerly).
GRAPHS_ENV = PREFILL_KV_GRAPHS_ENV
ON = ("1", "true", "yes", "on")


class PrefillDraftKv:
    """The fixed buffers of a prefill's draft K/V write, and its graph per token count.

    idx holds, from the host in one copy: the positions (padded with 0), each request's last row
    (padded with the bucket's scratch row) and the token count. tokens has one scratch row past
    the largest count, where the padded requests' tail tokens land."""

    def __init__(self, model: Any, pool: Any, hidden_size: int, dtype: Any, device: Any,
                 counts: tuple[int, ...] = TOKEN_COUNTS) -> None:
        import torch

        self.model = model
        self.pool = pool
        self.counts = tuple(sorted(counts))
        top = self.counts[-1]
        self.top = top
        self.graphs: dict[int, Any] = {}  # token count -> CUDA graph (none: run eagerly)
        self.ids = torch.zeros((top + 1,), dtype=torch.int64, device=device)
        self.tokens = torch.zeros((top + 1,), dtype=torch.int64, device=device)
        self.tail = torch.zeros((top,), dtype=torch.int64, device=device)
        self.idx = torch.zeros((2 * top + 1,), dtype=torch.int64, device=device)
        self.rows = torch.arange(top, dtype=torch.int64, device=device)
        self.loc = torch.zeros((top,), dtype=torch.int64, device=device)
        self.hidden = torch.zeros((top, hidden_size), dtype=dtype, device=device)
        self.pinned = torch.device(device).type == "cuda"

    def count_for(self, n: int) -> int | None:
        """The padded token count of a prefill of n tokens (None: above the largest)."""
        i = bisect.bisect_left(self.counts, n)
        return self.counts[i] if i < len(self.counts) else None

    def _run(self, b: int) -> None:
        """The write of a prefill padded to b tokens, from the buffers alone (what a graph records)."""
        import torch

        top = self.top
        tokens = self.tokens[: b + 1]
        tokens[:b].copy_(self.ids[1 : b + 1])  # at each position the token after it ...
        # ... but a request's last position takes its tail token; padding requests point at row b
        tokens.scatter_(0, self.idx[top : 2 * top], self.tail)
        real = self.rows[:b] < self.idx[2 * top]
        loc = torch.where(real, self.loc[:b], torch.zeros_like(self.loc[:b]))
        draft_kv.write_draft_kv(self.model, tokens[:b], self.idx[:b], self.hidden[:b], loc, self.pool)

    def write(self, batch: Any, tail_tokens: Any, target_hidden: Any) -> bool:
        """A prefill's draft K/V (the target's batch, its tail token per request and its hidden
        states), from the buffers: False where its token count is above the largest (the caller
        writes it eagerly)."""
        import torch

        input_ids = batch.input_ids
        n = int(input_ids.shape[0])
        b = self.count_for(n)
        if b is None or n == 0:
            return False
        top = self.top
        positions, ends = draft_kv.prefill_positions(batch)
        r = len(ends)
        # one host buffer, one copy; pinned, so the copy does not wait for the target's forward
        host = torch.empty((2 * top + 1,), dtype=torch.int64, pin_memory=self.pinned)
        view = host.numpy()
        view[:n] = positions
        view[n:top] = 0
        view[top : top + r] = ends
        view[top + r : 2 * top] = b
        view[2 * top] = n
        self.idx.copy_(host, non_blocking=True)
        self.ids[:n].copy_(input_ids)
        self.tail[:r].copy_(tail_tokens)
        self.hidden[:n].copy_(target_hidden)
        self.loc[:n].copy_(batch.out_cache_loc)
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
        else:
            self._run(b)
        return True

    def check(self, n: int = 40) -> float:
        """The largest difference, over the largest magnitude, between the K/V this path writes for
        a prefill of n made-up tokens (padded: 40 to 48) and what the eager write writes for them,
        both at the pool's slots 1..n (free before the first request; what stays there is
        overwritten before it is read)."""
        import torch

        device = self.ids.device
        gen = torch.Generator().manual_seed(0)
        vocab = int(self.model.embed_tokens.weight.shape[0])
        ids = torch.randint(0, vocab, (n + 1,), generator=gen).to(device)
        hidden = torch.randn((n, self.hidden.shape[1]), generator=gen).to(device, self.hidden.dtype)
        loc = torch.arange(1, n + 1, dtype=torch.int64, device=device)
        batch = _OnePrompt(input_ids=ids[:n], extend_lens=[n], prefix_lens=[0], out_cache_loc=loc)
        layer = self.model.layers[0].self_attn.attn
        with torch.no_grad():
            draft_kv.write_draft_kv(self.model, ids[1:], torch.arange(n, device=device), hidden, loc,
                                    self.pool)
            want = [self.pool.get_key_buffer(layer.layer_id)[loc].float(),
                    self.pool.get_value_buffer(layer.layer_id)[loc].float()]
            self.write(batch, ids[n:], hidden)
            got = [self.pool.get_key_buffer(layer.layer_id)[loc].float(),
                   self.pool.get_value_buffer(layer.layer_id)[loc].float()]
        scale = max(float(w.abs().max()) for w in want) or 1.0
        return max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) / scale

    def capture(self) -> None:
        """One graph per token count, the largest first, all in one memory pool. The buffers'
        token count is 0, so the warm-up and the capture write only the padding slot."""
        import torch

        self.idx.zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            for b in reversed(self.counts):
                self._run(b)  # warm-up: the kernels' first-call setup stays out of the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._run(b)
                self.graphs[b] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()


class _OnePrompt:
    """A prefill of one prompt, as write() reads the target's batch (check())."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


# check(): the graphs' K/V may differ from the eager write's by rounding only (the padded batch may
# run other GEMM tiles); more than this, over the largest magnitude, and they are not used.
CHECK_TOLERANCE = 0.02


def why_not_graphs(worker: Any, environ: dict[str, str] | None = None) -> str | None:
    """Why a prefill's draft K/V run eagerly here (None: from graphs)."""
    import os

    value = (os.environ if environ is None else environ).get(GRAPHS_ENV, "").strip().lower()
    if value not in ON:
        return f"{GRAPHS_ENV} is not 1 (off by default)"
    import torch
    from sglang.srt.arg_groups.overrides import resolving_view

    if int(resolving_view(worker.server_args).tp_size or 1) > 1:
        return "tensor parallelism (the draft's embedding all-reduces across the ranks)"
    model = worker._draft_worker.draft_runner.model.model
    fc = getattr(model, "fc", None)
    if fc is None:
        return "the draft has no fc layer over the target's hidden states"
    if fc.weight.device.type != "cuda" or not torch.cuda.is_available():
        return "not on a CUDA GPU"
    return None


def install(worker: Any) -> tuple[PrefillDraftKv | None, str]:
    """Before the worker's graphs are captured (the draft's pool exists): the buffers and graphs of
    a K/V-only prefill, and the log line that says what they took, or why there are none."""
    reason = why_not_graphs(worker)
    if reason is not None:
        return None, f"Plain step: prefills in plain mode write the draft's K/V eagerly: {reason}"
    runner = worker._draft_worker.draft_runner
    fc = runner.model.model.fc
    held_before = gpu_memory.held_bytes()
    prefill = PrefillDraftKv(runner.model.model, runner.token_to_kv_pool,
                             hidden_size=int(fc.weight.shape[1]), dtype=fc.weight.dtype,
                             device=fc.weight.device)
    try:
        prefill.capture()
        took = gpu_memory.took(held_before, gpu_memory.held_bytes())
        difference = prefill.check()
    except Exception as exc:  # noqa: BLE001 - any capture or check failure: the eager write, named
        # (one line, no traceback: the server goes on, and its log stays free of error patterns)
        first = (str(exc).splitlines() or [""])[0]
        return None, (f"Plain step: prefills in plain mode write the draft's K/V eagerly: their CUDA "
                      f"graphs failed ({type(exc).__name__}: {first})")
    if not difference <= CHECK_TOLERANCE:  # NaN too
        return None, (f"Plain step: prefills in plain mode write the draft's K/V eagerly: their CUDA "
                      f"graphs wrote K/V {difference:.3g} of the largest magnitude away from the eager "
                      f"write's (more than {CHECK_TOLERANCE})")
    memory = "memory not counted" if took is None else f"{took / 2**20:.0f} MiB"
    return prefill, (f"Plain step: prefills in plain mode write the draft's K/V from CUDA graphs at "
                     f"{len(prefill.counts)} token counts up to {prefill.top} ({memory}; "
                     f"checked against the eager write: {difference:.3g} of the largest magnitude apart)")
