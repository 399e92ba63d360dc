"""Tiny models, generated offline: tokenizer + Llama target + EAGLE-3 draft (sglang 0.5.17 format).

    python -m smoke models OUT_DIR [--size tiny|1b|8b|tp2] [--draft first|chain] [--draft-accept Q]
                                   [--device cpu|cuda|auto] [--seed 0] [--arch llama|qwen3]

--arch qwen3 (for `bench comm`): OUT_DIR/target is a Qwen3ForCausalLM (q_norm/k_norm per head, sglang
runs it through LayerCommunicator, so the allreduce fusion applies) with the same structured weights,
no draft; --size tp2 gives heads/kv heads divisible by 2 (8/4, head_dim 64) for TP=2.

Writes OUT_DIR/target (LlamaForCausalLM, -> --model-path), OUT_DIR/draft (LlamaForCausalLMEagle3,
-> --speculative-draft-model-path) and OUT_DIR/expected.json (prompt ids and the target's greedy
continuation computed here with HF transformers in float32, its smallest top-1/top-2 logit margin, and
the accept length the draft is designed to give). Nothing is downloaded.

Target ("structured" weights): embeddings E ~ N(0, 1); every layer has random q/k/v/gate/up weights
but o_proj/down_proj scaled down (x0.3), so the residual stream stays close to E[token] while every
block still computes on real numbers. lm_head makes the next token a fixed function f(token) whose
values lie in a hot set H (the draft vocabulary; f restricted to H is one long cycle) with a margin of
many logits, so greedy output does not depend on kernel rounding (decode vs. verify kernels).

Draft, two designs:
  first  (default, the smoke's): fc picks the first captured target hidden state (~E[x_t]) and
         lm_head predicts f(f(x_t)): the first draft token of every step is right, the later ones
         wrong -> accept length 2.0 with 3 steps (both the accept and the reject paths run).
  chain  (the benchmark's; checked here on CPU with an emulation of sglang's draft forward): the
         draft predicts g(token it reads), g = f on a random "good" subset of the
         vocabulary of fraction Q (--draft-accept), another hot token elsewhere. The layer carries the
         current token's embedding into the residual stream: fc = 0; q = k = alpha * (embedding half)
         so attention picks the current position; v = (embedding half) - (hidden half), o_proj = I,
         so the residual becomes the normalized embedding of the current token at every draft step
         (the previous token cancels); MLP down_proj tiny. With topk 1 and S steps the expected accept
         length is 1 + Q + ... + Q^S (4.0 at Q = 1 with 3 steps); expected.json holds the value along
         the reference chain.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
PROMPT = "def fibonacci(n):\n    return"
CHAT_TEMPLATE = ("{% for m in messages %}" + BOS + "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 3072
    draft_vocab: int = 1024


SIZES = {
    "tiny": Size(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512),
    # "1B-shaped": ~1.0e9 parameters in the target (16 x 2048 layers); built on the GPU in seconds
    "1b": Size(hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192),
    # "8B-shaped" (Llama-3-8B's layer shapes, small vocab): GPU-bound at high concurrency on a fast
    # GPU, where the 1B shape is bound by the scheduler's host time; ~16 GB of bf16 weights
    "8b": Size(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
    # TP=2 splits heads and kv heads evenly (head_dim 64: triton attention's well-trodden size)
    "tp2": Size(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1024),
}
ARCHS = ("llama", "qwen3")


# ----------------------------------------------------------------------------- tokenizer
def corpus(max_bytes: int) -> list[str]:
    """Python stdlib sources in a fixed order (present on every CPython), else a synthetic text."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    for dp, dn, fn in os.walk(root):
        dn[:] = sorted(d for d in dn if d not in skip)
        files += [os.path.join(dp, f) for f in sorted(fn) if f.endswith(".py")]
    out, total = [], 0
    for p in sorted(files):
        try:
            s = Path(p).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.append(s)
        total += len(s)
        if total >= max_bytes:
            break
    if total < 100_000:
        import keyword

        rnd = random.Random(0)
        words = list(keyword.kwlist) + ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as",
                                  "with", "was", "on", "be", "by"]
        out = [" ".join(rnd.choice(words) for _ in range(200_000))]
    return out


def make_tokenizer(vocab_size: int, max_bytes: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = corpus(max_bytes)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, model_max_length=4096)
    fast.chat_template = CHAT_TEMPLATE  # /v1/chat/completions (the feature matrix) needs one
    return fast


# ----------------------------------------------------------------------------- weights
def _rms_normalize(x: Any) -> Any:
    return x * (x.pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt()


def structured_weights(cfg: Any, dcfg: Any, special_ids: set[int], seed: int, *, draft: str,
                       accept: float, gain: float = 30.0, block_scale: float = 0.3,
                       device: str = "cpu") -> tuple[dict[str, Any], dict[str, Any], Any, Any, Any]:
    """(target state dict, draft state dict, hot ids, f, g); g is None for the "first" draft."""
    import torch

    dev = torch.device(device)
    g_rng = torch.Generator(device=dev).manual_seed(seed)
    V, d, L = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers
    H, KV, hd, ffn = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    Dv = dcfg.draft_vocab_size

    def randn(*shape: int, std: float = 1.0) -> Any:
        return torch.randn(*shape, generator=g_rng, device=dev) * std

    def ones(n: int) -> Any:
        return torch.ones(n, device=dev)

    normal = torch.tensor([i for i in range(V) if i not in special_ids], device=dev)
    hot = normal[torch.randperm(len(normal), generator=g_rng, device=dev)[:Dv]].sort().values
    cyc = hot[torch.randperm(Dv, generator=g_rng, device=dev)]
    f = torch.empty(V, dtype=torch.long, device=dev)
    f[cyc] = torch.roll(cyc, -1)
    hot_set = set(hot.tolist())
    cold = torch.tensor([i for i in range(V) if i not in hot_set], device=dev)
    f[cold] = hot[torch.randint(0, Dv, (len(cold),), generator=g_rng, device=dev)]

    E = randn(V, d)
    sd = {"model.embed_tokens.weight": E.clone(), "model.norm.weight": ones(d)}
    for i in range(L):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = ones(d)
        sd[p + "post_attention_layernorm.weight"] = ones(d)
        sd[p + "self_attn.q_proj.weight"] = randn(H * hd, d, std=d ** -0.5)
        sd[p + "self_attn.k_proj.weight"] = randn(KV * hd, d, std=d ** -0.5)
        sd[p + "self_attn.v_proj.weight"] = randn(KV * hd, d, std=d ** -0.5)
        sd[p + "self_attn.o_proj.weight"] = randn(d, H * hd, std=block_scale * (H * hd) ** -0.5)
        sd[p + "mlp.gate_proj.weight"] = randn(ffn, d, std=d ** -0.5)
        sd[p + "mlp.up_proj.weight"] = randn(ffn, d, std=d ** -0.5)
        sd[p + "mlp.down_proj.weight"] = randn(d, ffn, std=block_scale * ffn ** -0.5)
    W = torch.zeros(V, d, device=dev)
    W.index_add_(0, f, E)  # lm_head row y = sum of E[x] over f(x) = y  -> logit(f(x)) ~ gain
    sd["lm_head.weight"] = W * (gain / d)

    dd, DH, DKV = dcfg.hidden_size, dcfg.num_attention_heads, dcfg.num_key_value_heads
    dhd, DI = dcfg.head_dim, dcfg.intermediate_size
    n_aux = len(dcfg.eagle_config["eagle_aux_hidden_state_layer_ids"])
    common = {
        "embed_tokens.weight": E.clone(),  # sglang replaces it by the target's (same values)
        "norm.weight": ones(dd),
        "midlayer.input_layernorm.weight": ones(dd),
        "midlayer.hidden_norm.weight": ones(dd),
        "midlayer.post_attention_layernorm.weight": ones(dd),
        "midlayer.mlp.gate_proj.weight": randn(DI, dd, std=dd ** -0.5),
        "midlayer.mlp.up_proj.weight": randn(DI, dd, std=dd ** -0.5),
        # d2t[j] = target_id(j) - j (sglang: hot_token_id = d2t + arange); t2d = membership mask
        "d2t": (hot - torch.arange(Dv, device=dev)).to(torch.int64),
        "t2d": torch.zeros(V, dtype=torch.bool, device=dev).index_fill_(0, hot, True),
    }
    g_map = None
    if draft == "first":
        fc = torch.zeros(dd, dcfg.target_hidden_size * n_aux, device=dev)
        fc[:, :dd] = torch.eye(dd, device=dev)  # the first captured target hidden state (~E[x_t])
        Wd = torch.zeros(V, dd, device=dev)
        Wd.index_add_(0, f[f], E)  # predict f(f(x_t)) = x_{t+2}
        dsd = dict(common)
        dsd.update({
            "fc.weight": fc,
            "lm_head.weight": Wd[hot] * (gain / dd),
            "midlayer.self_attn.q_proj.weight": randn(DH * dhd, 2 * dd, std=(2 * dd) ** -0.5),
            "midlayer.self_attn.k_proj.weight": randn(DKV * dhd, 2 * dd, std=(2 * dd) ** -0.5),
            "midlayer.self_attn.v_proj.weight": randn(DKV * dhd, 2 * dd, std=(2 * dd) ** -0.5),
            "midlayer.self_attn.o_proj.weight": randn(dd, DH * dhd, std=0.1 * (DH * dhd) ** -0.5),
            "midlayer.mlp.down_proj.weight": randn(dd, DI, std=0.1 * DI ** -0.5),
        })
    elif draft == "chain":
        assert DH == DKV and DH * dhd == dd, "chain draft needs kv_heads == heads and heads*head_dim == hidden"
        alpha = 2.5
        eye = torch.eye(dd, device=dev)
        zero = torch.zeros(dd, dd, device=dev)
        # good tokens: the draft predicts f(x); others: a wrong hot token
        good = torch.rand(V, generator=g_rng, device=dev) < accept
        pos_in_hot = torch.full((V,), -1, dtype=torch.long, device=dev)
        pos_in_hot[hot] = torch.arange(Dv, device=dev)
        shift = torch.randint(1, Dv, (V,), generator=g_rng, device=dev)
        wrong = hot[(pos_in_hot[f] + shift) % Dv]
        g_map = torch.where(good, f, wrong)
        Wd = torch.zeros(V, dd, device=dev)
        Wd.index_add_(0, g_map, _rms_normalize(E))
        dsd = dict(common)
        dsd.update({
            "fc.weight": torch.zeros(dd, dcfg.target_hidden_size * n_aux, device=dev),
            "lm_head.weight": Wd[hot] * (gain / dd),
            "midlayer.self_attn.q_proj.weight": torch.cat([alpha * eye, zero], 1),
            "midlayer.self_attn.k_proj.weight": torch.cat([alpha * eye, zero], 1),
            "midlayer.self_attn.v_proj.weight": torch.cat([eye, -eye], 1),
            "midlayer.self_attn.o_proj.weight": eye.clone(),
            "midlayer.mlp.down_proj.weight": randn(dd, DI, std=0.02 * DI ** -0.5),
        })
    else:
        raise ValueError(f"unknown draft design {draft!r}")
    return sd, dsd, hot, f, g_map


def designed_accept_length(chain: list[int], good: set[int] | None, steps: int) -> float:
    """Mean accept length (accepted drafts + 1) of topk-1 EAGLE rounds along `chain` (the target's
    greedy tokens, chain[0] = the last prompt token) when the draft is right exactly on `good`
    tokens; good=None means the "first" design (right once per round)."""
    if good is None:
        return 2.0 if steps >= 1 else 1.0
    i, rounds, total = 0, 0, 0
    while i + steps + 1 < len(chain):
        acc = 0
        while acc < steps and chain[i + acc] in good:
            acc += 1
        rounds += 1
        total += acc + 1
        i += acc + 1
    return total / max(rounds, 1)


# ----------------------------------------------------------------------------- main
def build(out_dir: Path, *, size: str = "tiny", draft: str = "first", accept: float = 1.0,
          seed: int = 0, device: str = "cpu", corpus_bytes: int = 3_000_000, gen_len: int = 32,
          steps: int = 3, arch: str = "llama") -> dict[str, Any]:
    """arch "qwen3": a Qwen3ForCausalLM target only (no draft dir); same weights + q_norm/k_norm = 1."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    t0 = time.time()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    sz = SIZES[size]
    torch.manual_seed(seed)
    tdir, ddir = out_dir / "target", out_dir / "draft"
    tdir.mkdir(parents=True, exist_ok=True)
    if arch == "llama":
        ddir.mkdir(parents=True, exist_ok=True)

    tok = make_tokenizer(sz.vocab, corpus_bytes)
    V = len(tok)
    special = {tok.convert_tokens_to_ids(t) for t in (BOS, EOS, PAD)}
    head_dim = sz.hidden // sz.heads
    common = {"vocab_size": V, "hidden_size": sz.hidden, "intermediate_size": sz.intermediate,
              "num_attention_heads": sz.heads, "head_dim": head_dim, "hidden_act": "silu",
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
              "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
              "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
              "pad_token_id": tok.pad_token_id}
    if arch == "qwen3":
        qcommon = {k: v for k, v in common.items() if k != "mlp_bias"}
        cfg = Qwen3Config(num_hidden_layers=sz.layers, num_key_value_heads=sz.kv_heads,
                          use_sliding_window=False, **qcommon)
        cfg.architectures = ["Qwen3ForCausalLM"]
        model_cls = Qwen3ForCausalLM
    else:
        cfg = LlamaConfig(num_hidden_layers=sz.layers, num_key_value_heads=sz.kv_heads, **common)
        cfg.architectures = ["LlamaForCausalLM"]
        model_cls = LlamaForCausalLM
    cfg.dtype = torch.bfloat16
    # sglang captures the residual stream entering layer id+1: three distinct ids in [0, L-2]
    aux_ids = [0, sz.layers // 2 - 1, sz.layers - 2]
    dcfg = LlamaConfig(num_hidden_layers=1,
                       num_key_value_heads=sz.heads if draft == "chain" else sz.kv_heads,
                       draft_vocab_size=sz.draft_vocab, target_hidden_size=sz.hidden,
                       eagle_config={"eagle_aux_hidden_state_layer_ids": aux_ids,
                                     "use_aux_hidden_state": True}, **common)
    dcfg.architectures = ["LlamaForCausalLMEagle3"]
    dcfg.dtype = torch.bfloat16

    with dev:
        model = model_cls(cfg)
    sd, dsd, hot, f, g_map = structured_weights(cfg, dcfg, special, seed, draft=draft,
                                                accept=accept, device=device)
    if arch == "qwen3":  # per-head RMSNorm of q and k: weight 1 (the normalization itself still runs)
        for i in range(sz.layers):
            for n in ("q_norm", "k_norm"):
                sd[f"model.layers.{i}.self_attn.{n}.weight"] = torch.ones(head_dim, device=dev)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    del sd
    model = model.to(torch.bfloat16).eval().to("cpu")
    model.save_pretrained(tdir, safe_serialization=True)
    tok.save_pretrained(tdir)
    if arch == "llama":
        dcfg.save_pretrained(ddir)
        dsd = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous().cpu()
               for k, v in dsd.items()}
        save_file(dsd, str(ddir / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(ddir)
    del model, dsd

    ref = model_cls.from_pretrained(tdir, dtype=torch.float32).eval().to(dev)
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    seq = list(ids)
    margins, tops = [], []
    with torch.no_grad():
        for _ in range(gen_len):
            logits = ref(torch.tensor([seq], device=dev)).logits[0, -1].float().cpu()
            top2 = torch.topk(logits, 2)
            margins.append(float(top2.values[0] - top2.values[1]))
            tops.append(float(top2.values[0]))
            seq.append(int(top2.indices[0]))
    cont = seq[len(ids):]
    f_cpu = f.cpu()
    follows = sum(1 for a, b in zip(seq[len(ids) - 1:], cont) if int(f_cpu[a]) == b)
    # the designed accept length along a long stretch of the target's chain f
    chain = [cont[-1]]
    for _ in range(4000):
        chain.append(int(f_cpu[chain[-1]]))
    good = None
    if g_map is not None:
        gm = g_map.cpu()
        good = {x for x in range(V) if int(gm[x]) == int(f_cpu[x])}
    info = {
        "arch": arch, "size": size, "hidden": sz.hidden, "layers": sz.layers,
        "heads": sz.heads, "kv_heads": sz.kv_heads, "draft": draft if arch == "llama" else None,
        "draft_accept": accept if draft == "chain" else None,
        "prompt": PROMPT, "prompt_ids": ids, "greedy_ids": cont, "greedy_text": tok.decode(cont),
        "min_top1_top2_margin": min(margins), "mean_top1_top2_margin": sum(margins) / len(margins),
        "max_top_logit": max(tops),
        "steps_following_designed_chain": follows, "vocab_size": V,
        "draft_vocab_size": sz.draft_vocab, "hot_ids": hot.cpu().tolist(),
        "eagle_aux_hidden_state_layer_ids": aux_ids, "spec_steps": steps,
        "designed_accept_length": designed_accept_length(chain, good, steps),
        "seed": seed, "device": device, "torch": torch.__version__,
        "build_seconds": round(time.time() - t0, 1),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    (out_dir / "expected.json").write_text(json.dumps(info, indent=1))
    return info


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--draft", choices=["first", "chain"], default="first")
    ap.add_argument("--draft-accept", type=float, default=1.0,
                    help="chain draft: fraction of tokens on which the draft is right (0..1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=["cpu", "cuda", "auto"], default="cpu")
    ap.add_argument("--corpus-bytes", type=int, default=3_000_000)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--arch", choices=ARCHS, default="llama",
                    help="qwen3: Qwen3ForCausalLM target only (LayerCommunicator path), no draft")


def main(a: argparse.Namespace) -> int:
    if not 0.0 <= a.draft_accept <= 1.0:
        raise SystemExit("--draft-accept must be in [0, 1]")
    info = build(a.out_dir, size=a.size, draft=a.draft, accept=a.draft_accept, seed=a.seed,
                 device=a.device, corpus_bytes=a.corpus_bytes, gen_len=a.gen_len, arch=a.arch)
    keys = ("arch", "size", "draft", "greedy_ids", "min_top1_top2_margin", "designed_accept_length",
            "build_seconds")
    print(json.dumps({k: info[k] for k in keys}))
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    p = argparse.ArgumentParser()
    add_arguments(p)
    sys.exit(main(p.parse_args()))
