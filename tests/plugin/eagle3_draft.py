"""A one-layer (or deeper) EAGLE-3 draft of sglang's real classes for probes on a CPU: the real
LlamaModel.forward, the EAGLE-3 decoder layer's forward and LlamaAttention's q/k/v preparation, with
small leaves in place of the GPU ones (sglang's parallel linears, RMSNorm, rope and RadixAttention,
which records the K/V it would write), and a KV pool that records its writes. Probe code: run with
the flavor's sglang first on the path (run_in_tree)."""

EAGLE3_LEAVES = """
import torch
from torch import nn
from types import SimpleNamespace as NS
from sglang.srt.models import llama_eagle3 as m, llama
from sglang.srt.model_executor.forward_batch_info import ForwardMode

torch.manual_seed(0)
D, TARGET, HEADS, KV_HEADS, HD, VOCAB = 16, 12, 2, 1, 8, 50

class Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w = nn.Parameter(torch.rand(d) + 0.5)
    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w
        return y if residual is None else (y, x)

class Linear2(nn.Module):   # sglang's parallel linears return (out, bias)
    def __init__(self, i, o):
        super().__init__()
        self.lin = nn.Linear(i, o, bias=False)
    def forward(self, x):
        return self.lin(x), None

class RecordingAttention:   # in RadixAttention's place: records what would reach the KV cache
    tp_k_head_num, tp_v_head_num, qk_head_dim, v_head_dim = KV_HEADS, KV_HEADS, HD, HD
    k_scale = v_scale = None
    def __init__(self):
        self.seen = []
    def __call__(self, q, k, v, forward_batch):
        self.seen.append((k.reshape(-1, KV_HEADS, HD).clone(), v.reshape(-1, KV_HEADS, HD).clone()))
        return q

def rope(positions, q, k):  # position-dependent, like the real one
    return q * (positions[:, None] + 1.0), k * (positions[:, None] + 2.0)

def make_draft(n_layers=1):
    model = object.__new__(m.LlamaModel)
    nn.Module.__init__(model)
    model.embed_tokens = nn.Embedding(VOCAB, D)
    model.fc = nn.Linear(3 * TARGET, D, bias=False)
    model.num_aux_hidden_states, model.input_norm, model.fc_norm = 3, None, None
    model.is_mrope_enabled, model.norm_output = False, False
    layers = []
    for i in range(n_layers):
        layer = object.__new__(m.LlamaDecoderLayer)
        nn.Module.__init__(layer)
        layer.is_input_layer = i == 0
        layer.hidden_norm, layer.input_layernorm, layer.post_attention_layernorm = Norm(D), Norm(D), Norm(D)
        layer.mlp = nn.Linear(D, D, bias=False)
        attn = object.__new__(llama.LlamaAttention)
        nn.Module.__init__(attn)
        attn.qkv_proj = Linear2(2 * D if i == 0 else D, (HEADS + 2 * KV_HEADS) * HD)
        attn.o_proj = Linear2(HEADS * HD, D)
        attn.q_size, attn.kv_size = HEADS * HD, KV_HEADS * HD
        attn.rotary_emb, attn.attn = rope, RecordingAttention()
        layer.self_attn = attn
        layers.append(layer)
    model.layers = nn.ModuleList(layers)
    model.norm = Norm(D)
    return model

def real_rope(max_positions=64):
    # upstream's RotaryEmbedding with its own cos/sin table and its PyTorch path (the CUDA kernels
    # are absent here): a position outside the table fails as an index error, where the GPU kernel
    # reads out of bounds
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding, apply_rotary_emb
    rope = object.__new__(RotaryEmbedding)
    nn.Module.__init__(rope)
    rope.head_size = rope.rotary_dim = HD
    rope.max_position_embeddings, rope.base, rope.is_neox_style = max_positions, 10000, True
    rope.dtype, rope._force_native, rope.position_start = torch.float32, False, 0
    rope.register_buffer("cos_sin_cache", rope._compute_cos_sin_cache(), persistent=False)
    rope._apply_rotary_emb_wrapped = apply_rotary_emb
    return rope.forward_native

class RecordingPool:
    def __init__(self):
        self.writes = []
    def set_kv_buffer(self, layer, loc, k, v, k_scale=None, v_scale=None):
        self.writes.append((layer, loc.clone(), k.clone(), v.clone(), k_scale, v_scale))

def full_forward_kv(model, tokens, positions, target_hidden):
    # the K/V that the draft's real forward (DECODE) hands to attention
    fb = NS(forward_mode=ForwardMode.DECODE, mm_input_embeds=None,
            spec_info=NS(hidden_states=target_hidden), contains_mm_inputs=lambda: False)
    model.forward(tokens, positions, fb)
    return model.layers[0].self_attn.attn.seen[-1]

# four requests: their sampled tokens, positions, KV slots and the target's (aux) hidden states
TOKENS, POSITIONS, SLOTS = torch.tensor([3, 17, 42, 8]), torch.tensor([5, 9, 0, 30]), torch.tensor([70, 71, 12, 99])
TARGET_HIDDEN = torch.randn(4, 3 * TARGET)
"""
