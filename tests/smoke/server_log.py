"""Test data: a server log as sglang writes it (the checks read logs like it)."""

# A server log as sglang 0.5.17 writes it (launch of an EAGLE-3 server), without the patch's line.
SERVER_LOG = """\
$ python3 -m sglang.launch_server --model-path /tmp/smoke-state/models/tiny/target --host 127.0.0.1 --port 30000 --speculative-algorithm EAGLE3 --speculative-disable-batch-threshold 4
[2026-11-30 08:40:02] server_args=ServerArgs(model_path='/tmp/smoke-state/models/tiny/target', tokenizer_path='/tmp/smoke-state/models/tiny/target', attention_backend='triton', sampling_backend='pytorch', grammar_backend='none', speculative_algorithm='EAGLE3', speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4, ...)
[2026-11-30 08:40:09] Load weight begin. avail mem=138.72 GB
[2026-11-30 08:40:09] Load weight end. elapsed=0.05 s, type=LlamaForCausalLM, dtype=torch.bfloat16, avail mem=138.70 GB, mem usage=0.02 GB.
[2026-11-30 08:40:10] KV Cache is allocated. #tokens: 1966080, K size: 3.75 GB, V size: 3.75 GB
[2026-11-30 08:40:10] Memory pool end. avail mem=130.96 GB
[2026-11-30 08:40:14] Capture cuda graph begin. This can take up to several minutes. avail mem=130.90 GB
[2026-11-30 08:40:31] Capture cuda graph end. Time elapsed: 17.02 s. mem usage=0.11 GB. avail mem=130.79 GB.
[2026-11-30 08:40:33] max_total_num_tokens=1966080, chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=64, context_len=4096, available_gpu_mem=130.79 GB
[2026-11-30 08:40:34] INFO:     Started server process [41233]
[2026-11-30 08:40:34] INFO:     Waiting for application startup.
[2026-11-30 08:40:34] INFO:     Application startup complete.
[2026-11-30 08:40:34] INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)
[2026-11-30 08:40:35] INFO:     127.0.0.1:51220 - "GET /health HTTP/1.1" 200 OK
[2026-11-30 08:40:36] Prefill batch, #new-seq: 1, #new-token: 9, #cached-token: 0, token usage: 0.00, #running-req: 0, #queue-req: 0,
[2026-11-30 08:40:36] The server is fired up and ready to roll!
"""
PATCH_LINE = "[2026-11-30 08:40:10] Dynamic speculation disable enabled: threshold=4 (hysteresis=1)\n"
