"""Models for the front-end tests, written here (torchvision and transformers are not installed
on the CPU machines).  Sizes are small and odd so that tests stay fast and catch shape bugs."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def randomize_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial running statistics, so that batchnorm folding is really tested."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=g) - 0.5)
            m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            m.weight.data.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
            m.bias.data.copy_(torch.rand(m.bias.shape, generator=g) - 0.5)
    return model


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 7):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 12, 3, stride=2, padding=1, groups=4)
        self.conv3 = nn.Conv2d(12, 16, 3, dilation=2, padding=2, bias=False)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True)
        x = torch.sigmoid(self.conv2(x)) * x.mean()  # an elementwise chain with a global reduction
        x = F.avg_pool2d(F.gelu(self.conv3(x)), 2, ceil_mode=True, count_include_pad=False)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return F.log_softmax(self.fc(x), dim=-1)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (2-2-2-2 basic blocks), with a width multiplier."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        w = [width, width * 2, width * 4, width * 8]
        self.stem = nn.Sequential(nn.Conv2d(3, w[0], 7, 2, 3, bias=False), nn.BatchNorm2d(w[0]), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))  # fmt: skip
        layers, cin = [], w[0]
        for i, c in enumerate(w):
            layers += [BasicBlock(cin, c, 1 if i == 0 else 2), BasicBlock(c, c, 1)]
            cin = c
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(w[-1], classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1))


class BertLayer(nn.Module):
    """A BERT encoder layer (post-norm) with embeddings and an additive padding mask."""

    def __init__(self, vocab: int = 50, hidden: int = 48, heads: int = 4, ffn: int = 80, max_len: int = 32):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        self.ln0 = nn.LayerNorm(hidden, eps=1e-12)
        self.q, self.k, self.v = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.o = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden, eps=1e-12)
        self.ff1, self.ff2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, ids, mask):
        b, s = ids.shape
        pos = torch.arange(s, device=ids.device)
        x = self.ln0(self.tok(ids) + self.pos(pos))
        hd = x.shape[-1] // self.heads

        def heads(t):
            return t.view(b, s, self.heads, hd).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        scores = scores + (1.0 - mask[:, None, None, :].to(x.dtype)) * -10000.0
        ctx = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, -1)
        x = self.ln1(x + self.o(ctx))
        return self.ln2(x + self.ff2(F.gelu(self.ff1(x))))


class GPT2Block(nn.Module):
    """A GPT-2 decoder block (pre-norm, fused c_attn projection, causal SDPA, tanh GELU)."""

    def __init__(self, hidden: int = 40, heads: int = 5):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.fc, self.proj = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.rand(dim) + 0.5), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    """A Llama decoder block: RMSNorm, rotary embedding, grouped KV heads, SiLU-gated MLP."""

    def __init__(self, hidden: int = 48, heads: int = 6, kv_heads: int = 2, ffn: int = 72, max_len: int = 64):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = RMSNorm(hidden), RMSNorm(hidden)
        self.q = nn.Linear(hidden, heads * self.hd, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, hidden, bias=False)
        self.gate, self.up = nn.Linear(hidden, ffn, bias=False), nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        freqs = torch.outer(torch.arange(max_len).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        cos, sin = self.cos[:s], self.sin[:s]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        # Grouped KV heads the way HF Llama spells it for exporters: expand + reshape.
        k = k[:, :, None].expand(b, self.kv_heads, rep, s, self.hd).reshape(b, self.heads, s, self.hd)
        v = v[:, :, None].expand(b, self.kv_heads, rep, s, self.hd).reshape(b, self.heads, s, self.hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaGQABlock(LlamaBlock):
    """The same block using SDPA's own grouped-query attention (enable_gqa)."""

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.hd).transpose(1, 2)
        cos, sin = self.cos[:s], self.sin[:s]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyGPT(nn.Module):
    """A GPT-2-style language model: token and position embeddings, decoder blocks, tied head."""

    def __init__(self, vocab: int = 1000, hidden: int = 128, heads: int = 4, layers: int = 4, max_len: int = 256):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(max_len, hidden)
        self.blocks = nn.ModuleList(GPT2Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


class TinyLlama(nn.Module):
    """A Llama-style language model: embedding, Llama blocks (RoPE, GQA, SwiGLU), RMSNorm, head."""

    def __init__(self, vocab: int = 1000, hidden: int = 128, heads: int = 4, kv_heads: int = 2, ffn: int = 344,
                 layers: int = 4, max_len: int = 256):  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(LlamaGQABlock(hidden, heads, kv_heads, ffn, max_len) for _ in range(layers))
        self.norm = RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class PassThrough(nn.Module):
    """Outputs that are the input itself after eval-mode dropout, clone and contiguous (no kernel
    writes them), next to a computed one: replayed plans must still follow every call."""

    def __init__(self, features: int = 64, out_features: int = 32):
        super().__init__()
        self.dropout = nn.Dropout(0.1)
        self.linear = nn.Linear(features, out_features)

    def forward(self, x):
        return self.dropout(x), self.linear(x).relu(), x.detach().clone().contiguous()
