"""A slow float64 Llama decoder that reads megatron-core weights and keeps a real compressed KV
cache token by token (Algorithm 1 of the DMC paper). Test helper only."""
from __future__ import annotations

import math

import torch

from dmc.ops.decisions import OMEGA_MIN


def rms_norm(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def rotate(x, position, base):
    """Rotate-half RoPE of ``x [..., dim]`` at an integer position."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.cat([position * inv_freq, position * inv_freq])
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return x * torch.cos(angles) + torch.cat([-x2, x1], dim=-1) * torch.sin(angles)


class HeadCache:
    """One (sequence, layer, KV head): slots of pre-RoPE running means, their weights z and the
    position each slot was last written at."""

    def __init__(self):
        self.keys, self.values, self.weights, self.positions = [], [], [], []

    def write(self, key, value, omega, merge, position):
        if merge and self.keys:
            z = self.weights[-1] + omega
            self.keys[-1] = (self.weights[-1] * self.keys[-1] + omega * key) / z
            self.values[-1] = (self.weights[-1] * self.values[-1] + omega * value) / z
            self.weights[-1] = z
            self.positions[-1] = position
        else:
            self.keys.append(key)
            self.values.append(value)
            self.weights.append(omega)
            self.positions.append(position)


def decode_with_compressed_cache(state, tokens, *, num_layers, num_heads, num_groups, eps,
                                 rotary_base, c=5.0, dmc=True):
    """Logits ``[batch, seq, vocab]`` of feeding ``tokens [batch, seq]`` one at a time.

    With ``dmc`` the last q/k channel gives alpha = [k[-1] - c > 0] and omega =
    sigmoid(mean_group(q[-1]) + c) floored at OMEGA_MIN; both channels are zeroed before and
    after RoPE; merged slots are rotated at the position of their newest token. Returns also the
    cache sizes ``[batch, layers, groups]`` after the last token.
    """
    w = {k: v.double() for k, v in state.items() if isinstance(v, torch.Tensor)}
    batch, seq = tokens.shape
    hidden = w["embedding.word_embeddings.weight"].shape[1]
    dim = hidden // num_heads
    group = num_heads // num_groups
    caches = [[[HeadCache() for _ in range(num_groups)] for _ in range(num_layers)]
              for _ in range(batch)]
    logits = torch.zeros(batch, seq, w["output_layer.weight"].shape[0], dtype=torch.float64)
    for b in range(batch):
        for t in range(seq):
            x = w["embedding.word_embeddings.weight"][tokens[b, t]]
            for layer in range(num_layers):
                p = f"decoder.layers.{layer}."
                h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
                qkv = (w[p + "self_attention.linear_qkv.weight"] @ h).reshape(
                    num_groups, group + 2, dim)
                out_heads = []
                for g in range(num_groups):
                    q, k, v = qkv[g, :group], qkv[g, group], qkv[g, group + 1]
                    merge, omega = False, 1.0
                    if dmc:
                        merge = t > 0 and (k[-1] - c).item() > 0
                        omega = max(torch.sigmoid(q[:, -1].mean() + c).item(), OMEGA_MIN)
                        q, k = q.clone(), k.clone()
                        q[:, -1] = 0
                        k[-1] = 0
                    cache = caches[b][layer][g]
                    cache.write(k, v, omega, merge, t)
                    keys = torch.stack([rotate(kk, pos, rotary_base)
                                        for kk, pos in zip(cache.keys, cache.positions)])
                    values = torch.stack(cache.values)
                    q_rot = rotate(q, t, rotary_base)
                    if dmc:
                        keys[:, -1] = 0
                        q_rot[:, -1] = 0
                    probs = torch.softmax(q_rot @ keys.T / math.sqrt(dim), dim=-1)
                    out_heads.append(probs @ values)
                attn = torch.cat([o.reshape(-1) for o in out_heads])
                x = x + w[p + "self_attention.linear_proj.weight"] @ attn
                h = rms_norm(x, w[p + "pre_mlp_layernorm.weight"], eps)
                gate, up = (w[p + "mlp.linear_fc1.weight"] @ h).chunk(2)
                x = x + w[p + "mlp.linear_fc2.weight"] @ (torch.nn.functional.silu(gate) * up)
            x = rms_norm(x, w["decoder.final_layernorm.weight"], eps)
            logits[b, t] = w["output_layer.weight"] @ x
    sizes = torch.tensor([[[len(caches[b][l][g].keys) for g in range(num_groups)]
                           for l in range(num_layers)] for b in range(batch)])
    return logits, sizes
