#!/usr/bin/env python3
"""Multi-token prediction (DeepSeek-V3, section 2.2) reference for tests/golden/deepseek_v3.

transformers builds no MTP modules, so this script writes them itself in PyTorch on top of the
golden DeepseekV3ForCausalLM (tools/make_deepseek_golden.py): for depth k = 1..D, position i
combines the previous depth's hidden state h^{k-1}_i (depth 0: the last decoder layer's output,
before the final norm, as MaxText's) with the embedding of token t_{i+k}:

    h'_i  = W_k [RMSNorm_e(Emb(t_{i+k})); RMSNorm_h(h^{k-1}_i)]     (2d -> d; the embedding
            first, as DeepSeek-V3's released eh_proj and MaxText's current layer)
    h^k   = TRM_k(h')                                           (transformers' own
            DeepseekV3DecoderLayer, a MoE layer, causal over the sequence, the same rotary
            positions)
    P^k_i = softmax(lm_head(norm(h^k_i)))                       (the shared final norm and head)

predicting t_{i+k+1}; positions whose target falls off the sequence are left out. CE_k is the
mean cross-entropy of depth k, and the objective main + scale / D x sum_k CE_k.

Writes tests/golden/deepseek_v3/mtp.safetensors:
  input_ids I32 [1, 100]         (the golden reference's)
  loss F32 [1]                   the main next-token cross-entropy
  mtp_loss F32 [D]               CE_k per depth
  mtp.<k>.<name>                 depth k's weights under mt's names and layouts ([in, out]
                                 matrices, experts stacked [E, in, out])
  grad.mtp.<k>.<name>            d(main + scale / D sum_k CE_k) / d(weight), same layout
and mtp.json (D, scale, seed, versions, command).

Run from the repository root with the transformers 5 environment
(tools/setup_reference_env_tf5.sh):
    .venv-tf5/bin/python tools/make_mtp_golden.py
"""

import os

import torch
from safetensors.torch import load_file
from transformers import DeepseekV3ForCausalLM
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

import golden_common as gc

DEPTHS = 2
SCALE = 0.3
SEED = 3101

# transformers' per-layer names -> mt's DeepSeek layer names (matrices transposed to [in, out]).
LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_a_proj.weight": ("wq_a", True),
    "self_attn.q_a_layernorm.weight": ("q_norm", False),
    "self_attn.q_b_proj.weight": ("wq_b", True),
    "self_attn.kv_a_proj_with_mqa.weight": ("wkv_a", True),
    "self_attn.kv_a_layernorm.weight": ("kv_norm", False),
    "self_attn.kv_b_proj.weight": ("wkv_b", True),
    "self_attn.o_proj.weight": ("wo", True),
    "mlp.gate.weight": ("router", True),
    "mlp.shared_experts.gate_proj.weight": ("shared_w_gate", True),
    "mlp.shared_experts.up_proj.weight": ("shared_w_up", True),
    "mlp.shared_experts.down_proj.weight": ("shared_w_down", True),
}


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class MtpDepth(torch.nn.Module):
    def __init__(self, config, k, gen):
        super().__init__()
        d = config.hidden_size
        self.eps = config.rms_norm_eps
        self.embedding_norm = torch.nn.Parameter(1.0 + 0.1 * torch.randn(d, generator=gen))
        self.hidden_norm = torch.nn.Parameter(1.0 + 0.1 * torch.randn(d, generator=gen))
        self.projection = torch.nn.Parameter(torch.randn(d, 2 * d, generator=gen) / (2 * d) ** 0.5)
        # A MoE layer (its index past first_k_dense_replace), as MaxText's last layer kind.
        self.layer = ds.DeepseekV3DecoderLayer(config, config.num_hidden_layers + k - 1)
        with torch.no_grad():
            for name, p in self.layer.named_parameters():
                gc.trained_init(name, p, gen)
            for name, b in self.layer.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.1 * torch.randn(b.shape, generator=gen))

    def forward(self, hidden, embedded, position_embeddings, position_ids, mask):
        e = rms_norm(embedded, self.embedding_norm, self.eps)
        h = rms_norm(hidden, self.hidden_norm, self.eps)
        x = torch.cat([e, h], dim=-1) @ self.projection.T
        out = self.layer(
            x,
            attention_mask=mask,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
        )
        return out[0] if isinstance(out, tuple) else out

    def mt_tensors(self, k, grads):
        """This depth's weights (or their gradients) under mt's names and layouts."""
        pick = (lambda p: p.grad) if grads else (lambda p: p.data)
        pre = ("grad." if grads else "") + f"mtp.{k}."
        r = {
            pre + "mtp_embedding_norm": pick(self.embedding_norm),
            pre + "mtp_hidden_norm": pick(self.hidden_norm),
            pre + "mtp_projection": pick(self.projection).T,
        }
        for name, p in self.layer.named_parameters():
            t = pick(p)
            if name in LAYER_NAMES:
                mt, transposed = LAYER_NAMES[name]
                r[pre + mt] = t.T if transposed else t
            elif name == "mlp.experts.gate_up_proj":  # [E, 2I, d] -> w_gate, w_up [E, d, I]
                half = t.shape[1] // 2
                r[pre + "w_gate"] = t[:, :half].transpose(1, 2)
                r[pre + "w_up"] = t[:, half:].transpose(1, 2)
            elif name == "mlp.experts.down_proj":  # [E, d, I] -> [E, I, d]
                r[pre + "w_down"] = t.transpose(1, 2)
            else:
                raise SystemExit(f"unmapped MTP layer parameter {name} {tuple(t.shape)}")
        if not grads:
            for name, b in self.layer.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    r[pre + "router_bias"] = b
        return {n: v.detach().contiguous().clone() for n, v in r.items()}


def main():
    command = gc.setup("make_mtp_golden.py")
    d = os.path.join(gc.repo_root(), "tests", "golden", "deepseek_v3")
    model = gc.load(DeepseekV3ForCausalLM, d)
    ids = load_file(os.path.join(d, "reference.safetensors"))["input_ids"].long()
    T = ids.shape[1]
    config = model.config

    gen = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    depths = [MtpDepth(config, k, gen).to(torch.float32).eval() for k in range(1, DEPTHS + 1)]

    # The main model; its last decoder layer's output (before the final norm) via a hook.
    captured = {}

    def hook(_module, _inputs, output):
        captured["h"] = output[0] if isinstance(output, tuple) else output

    handle = model.model.layers[-1].register_forward_hook(hook)
    logits = model(input_ids=ids).logits[0]
    handle.remove()
    main = torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])

    position_ids = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    h = captured["h"]
    pos_emb = model.model.rotary_emb(h, position_ids)
    ces = []
    for k, m in enumerate(depths, start=1):
        ahead = torch.zeros_like(ids)
        ahead[:, : T - k] = ids[:, k:]
        h = m(h, model.model.embed_tokens(ahead), pos_emb, position_ids, mask)
        lk = model.lm_head(model.model.norm(h))[0]
        ces.append(torch.nn.functional.cross_entropy(lk[: T - k - 1], ids[0, k + 1 :]))
    total = main + SCALE / DEPTHS * sum(ces)
    total.backward()

    tensors = {
        "input_ids": ids.to(torch.int32),
        "loss": main.detach().reshape(1),
        "mtp_loss": torch.stack([c.detach() for c in ces]),
    }
    for k, m in enumerate(depths, start=1):
        tensors.update(m.mt_tensors(k, grads=False))
        tensors.update(m.mt_tensors(k, grads=True))
    gc.save_tensors(os.path.join(d, "mtp.safetensors"), tensors)
    info = {
        "what": "multi-token prediction reference (tools/make_mtp_golden.py)",
        "mtp_num_layers": DEPTHS,
        "mtp_loss_scaling_factor": SCALE,
        "seed": SEED,
        "loss": main.item(),
        "mtp_loss": [c.item() for c in ces],
        "versions": gc.versions(),
        "command": command,
    }
    gc.write_json(os.path.join(d, "mtp.json"), info)
    print(info)


if __name__ == "__main__":
    main()
