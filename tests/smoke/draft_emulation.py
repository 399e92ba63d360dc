"""A CPU emulation of speculative decoding with the smoke's generated EAGLE-3 draft: a check of the
models' design (their designed accept length), not of sglang. Test-only: the smoke never runs it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emulate_draft(model_dir: Path, *, steps: int = 3, rounds: int = 12) -> dict[str, Any]:
    """Runs speculative decoding (topk 1) with the saved weights: the target through HF transformers,
    the draft through a re-implementation of sglang 0.5.17's LlamaForCausalLMEagle3 forward (models/
    llama_eagle3.py: residual = h; x = cat(input_norm(embed), hidden_norm(h)); attn; add-norm; MLP;
    norm(mlp + residual) -> lm_head; aux = mlp + residual feeds the next step; fc(aux states) at the
    extend step). Returns the mean accept length. A check of the design on CPU, not of sglang."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    exp = json.loads((model_dir / "expected.json").read_text())
    tgt = LlamaForCausalLM.from_pretrained(model_dir / "target", dtype=torch.float32).eval()
    dcfg = json.loads((model_dir / "draft" / "config.json").read_text())
    w = {k: (v.float() if v.is_floating_point() else v) for k, v in load_file(model_dir / "draft" / "model.safetensors").items()}
    E = tgt.model.embed_tokens.weight.detach()
    aux_ids = dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    H, KV = dcfg["num_attention_heads"], dcfg["num_key_value_heads"]
    hd = dcfg.get("head_dim") or dcfg["hidden_size"] // H
    eps = dcfg["rms_norm_eps"]
    theta = (dcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    hot = w["d2t"] + torch.arange(w["d2t"].shape[0])

    def rms(x: Any, wt: Any) -> Any:
        return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * wt

    def rope(x: Any, pos: Any) -> Any:  # neox style, x: [n, heads, hd]
        inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = pos[:, None].float() * inv[None]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    p = "midlayer."

    def draft_forward(tokens: Any, h: Any, pos: Any, cache: dict[int, Any]) -> tuple[Any, Any]:
        """tokens [n], h [n, dd] (already through fc), pos [n]; cache {pos: (k, v)} is updated."""
        residual = h
        x = torch.cat([rms(E[tokens], w[p + "input_layernorm.weight"]),
                       rms(h, w[p + "hidden_norm.weight"])], -1)
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(-1, H, hd), pos)
        k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(-1, KV, hd), pos)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(-1, KV, hd)
        for i, pp in enumerate(pos.tolist()):
            cache[pp] = (k[i], v[i])
        outs = []
        for i, pp in enumerate(pos.tolist()):
            keys = [j for j in sorted(cache) if j <= pp]
            K = torch.stack([cache[j][0] for j in keys]).repeat_interleave(H // KV, 1)
            Vv = torch.stack([cache[j][1] for j in keys]).repeat_interleave(H // KV, 1)
            s = torch.einsum("hd,nhd->hn", q[i], K) * hd ** -0.5
            outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), Vv).reshape(-1))
        a = torch.stack(outs) @ w[p + "self_attn.o_proj.weight"].T
        residual = a + residual
        hs = rms(residual, w[p + "post_attention_layernorm.weight"])
        m = (torch.nn.functional.silu(hs @ w[p + "mlp.gate_proj.weight"].T)
             * (hs @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        residual = m + residual
        logits = rms(residual, w["norm.weight"]) @ w["lm_head.weight"].T
        return hot[logits.argmax(-1)], residual

    seq = list(exp["prompt_ids"])
    lens = []
    with torch.no_grad():
        # prefill: the target's first token
        out = tgt(torch.tensor([seq]), output_hidden_states=True)
        seq.append(int(out.logits[0, -1].argmax()))
        for _ in range(rounds):
            out = tgt(torch.tensor([seq[:-1]]), output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i + 1][0] for i in aux_ids], -1)
            h = aux @ w["fc.weight"].T
            n = len(seq) - 1
            cache: dict[int, Any] = {}
            # draft extend: position p reads token seq[p+1] and the target hidden of position p
            nxt, res = draft_forward(torch.tensor(seq[1:]), h, torch.arange(n), cache)
            drafts = [int(nxt[-1])]
            r = res[-1:]
            for s in range(1, steps):
                t, r = draft_forward(torch.tensor([drafts[-1]]), r, torch.tensor([n - 1 + s]), cache)
                drafts.append(int(t[0]))
            # verify with the target: greedy tokens after seq + drafts
            logits = tgt(torch.tensor([seq + drafts])).logits[0]
            acc = 0
            while acc < steps and int(logits[len(seq) - 1 + acc].argmax()) == drafts[acc]:
                acc += 1
            bonus = int(logits[len(seq) - 1 + acc].argmax())
            seq += drafts[:acc] + [bonus]
            lens.append(acc + 1)
    return {"accept_length": sum(lens) / len(lens), "per_round": lens, "tokens": seq}
