"""Small models for the torch front end's model tests: hand-written ConvNeXt-, Swin-, RegNet- and
MobileNet-style blocks, a conv1d speech block, torch.nn's attention layers, and tiny configs of
transformers models (random weights; transformers is imported only when such a model is built)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 conv, channels-last LayerNorm, inverted MLP with GELU, layer scale, residual."""

    def __init__(self, dim=24):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1, self.pw2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pw2(F.gelu(self.pw1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class SwinBlock(nn.Module):
    """Shifted-window attention (torch.roll, window partition by view/permute, a relative position
    bias table indexed by a buffer, the shift mask) and an MLP, as torchvision's swin_t writes it."""

    def __init__(self, dim=24, heads=3, window=4, shift=2):
        super().__init__()
        self.heads, self.window, self.shift = heads, window, shift
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.1)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + window - 1
        self.register_buffer("rel_index", (rel[..., 0] * (2 * window - 1) + rel[..., 1]).flatten())

    def forward(self, x):  # [B, H, W, C], H and W multiples of the window
        b, h, w, c = x.shape
        ws, nh = self.window, self.heads
        y = torch.roll(self.norm1(x), shifts=(-self.shift, -self.shift), dims=(1, 2))
        y = y.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws * ws, c)
        q, k, v = self.qkv(y).reshape(y.shape[0], ws * ws, 3, nh, c // nh).permute(2, 0, 3, 1, 4)
        attn = (q * (c // nh) ** -0.5) @ k.transpose(-2, -1)
        bias = self.bias_table[self.rel_index].view(ws * ws, ws * ws, nh).permute(2, 0, 1)
        attn = attn + bias.unsqueeze(0)
        region = torch.zeros(h, w, device=x.device)
        for i, hs in enumerate((slice(0, -ws), slice(-ws, -self.shift), slice(-self.shift, None))):
            for j, wsl in enumerate((slice(0, -ws), slice(-ws, -self.shift), slice(-self.shift, None))):
                region[hs, wsl] = 3 * i + j
        region = region.view(h // ws, ws, w // ws, ws).permute(0, 2, 1, 3).reshape(-1, ws * ws)
        mask = (region[:, None, :] != region[:, :, None]).to(attn.dtype) * -100.0
        nw = mask.shape[0]
        attn = attn.view(b, nw, nh, ws * ws, ws * ws) + mask[None, :, None]
        attn = attn.view(-1, nh, ws * ws, ws * ws).softmax(-1)
        y = (attn @ v).transpose(1, 2).reshape(-1, ws * ws, c)
        y = self.proj(y).view(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(b, h, w, c)
        x = x + torch.roll(y, shifts=(self.shift, self.shift), dims=(1, 2))
        return x + self.mlp(self.norm2(x))


class RegNetBlock(nn.Module):
    """RegNetY bottleneck: 1x1 conv-BN-ReLU, grouped 3x3 conv (stride 2), squeeze-excitation,
    1x1 conv-BN, projection shortcut."""

    def __init__(self, cin=16, cout=32, group=8):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(cout, cout, 3, 2, 1, groups=cout // group, bias=False), nn.BatchNorm2d(cout),
                               nn.ReLU())  # fmt: skip
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(cout, 4, 1), nn.ReLU(), nn.Conv2d(4, cout, 1),
                                nn.Sigmoid())  # fmt: skip
        self.c = nn.Sequential(nn.Conv2d(cout, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.proj = nn.Sequential(nn.Conv2d(cin, cout, 1, 2, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.b(self.a(x))
        return F.relu(self.proj(x) + self.c(y * self.se(y)))


class MobileNetBlock(nn.Module):
    """Inverted residual with ReLU6 (hardtanh), a depthwise conv and hardswish (MobileNet v2/v3)."""

    def __init__(self, dim=16, expand=3):
        super().__init__()
        hidden = dim * expand
        self.expand = nn.Sequential(nn.Conv2d(dim, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(hidden, hidden, 3, 1, 1, groups=hidden, bias=False),
                                nn.BatchNorm2d(hidden), nn.Hardtanh(0.0, 6.0))  # fmt: skip
        self.project = nn.Sequential(nn.Conv2d(hidden, dim, 1, bias=False), nn.BatchNorm2d(dim), nn.Hardswish())

    def forward(self, x):
        return x + self.project(self.dw(self.expand(x)))


class SpeechBlock(nn.Module):
    """A wav2vec-style feature encoder: strided conv1d with group norm and GELU, then conv1d
    layers and a transpose into a LayerNorm and projection."""

    def __init__(self, dim=24):
        super().__init__()
        self.conv0 = nn.Conv1d(1, dim, 10, stride=5, bias=False)
        self.norm0 = nn.GroupNorm(dim, dim)
        self.conv1 = nn.Conv1d(dim, dim, 3, stride=2, padding=1)
        self.conv2 = nn.Conv1d(dim, dim, 5, padding=4, dilation=2, groups=4)
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, 16)

    def forward(self, wave):  # [B, T]
        x = F.gelu(self.norm0(self.conv0(wave.unsqueeze(1))))
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x)) + x
        return self.proj(self.norm(x.transpose(1, 2)))


class GroupNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(6, 12, 3, padding=1)
        self.gn1, self.gn2 = nn.GroupNorm(3, 12), nn.GroupNorm(4, 12, affine=False)

    def forward(self, x):
        return self.gn2(F.silu(self.gn1(self.conv(x))))


class MHA(nn.Module):
    """nn.MultiheadAttention (F.multi_head_attention_forward) with a key padding mask."""

    def __init__(self, dim=24, heads=4):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, x, pad):
        return self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]


def encoder_layer(dim=24, heads=4):
    """nn.TransformerEncoderLayer: in eval mode under no_grad it takes the fast path
    (torch._transformer_encoder_layer_fwd)."""
    return nn.TransformerEncoderLayer(dim, heads, dim_feedforward=40, batch_first=True, dropout=0.1)


# ---- transformers, tiny configs ------------------------------------------------------------------
def _common():
    return dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                max_position_embeddings=64)  # fmt: skip


def hf_model(name: str, size: str = "tiny"):
    """(model, kind of inputs) for a transformers model; size "tiny" (CPU tier) or "real"."""
    import transformers as T

    real = size == "real"
    if name == "gpt2":
        return T.GPT2Model(T.GPT2Config() if real else T.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4,
                                                                      n_positions=64)), "ids"  # fmt: skip
    if name == "bert":
        return T.BertModel(T.BertConfig() if real else T.BertConfig(**_common())), "ids_mask"
    if name == "distilbert":
        cfg = T.DistilBertConfig() if real else T.DistilBertConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4,
                                                                     hidden_dim=37, max_position_embeddings=64)  # fmt: skip
        return T.DistilBertModel(cfg), "ids_mask"
    if name == "llama":
        cfg = T.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=32,
                            num_key_value_heads=4) if real else T.LlamaConfig(**_common(), num_key_value_heads=2)  # fmt: skip
        return T.LlamaModel(cfg), "ids"
    if name == "mistral":
        cfg = T.MistralConfig(num_hidden_layers=4) if real else T.MistralConfig(**_common(), num_key_value_heads=2,
                                                                                sliding_window=8)  # fmt: skip
        return T.MistralModel(cfg), "ids"
    if name == "phi3":
        cfg = T.Phi3Config(num_hidden_layers=4) if real else T.Phi3Config(**_common(), num_key_value_heads=2,
                                                                          pad_token_id=0)  # fmt: skip
        return T.Phi3Model(cfg), "ids"
    if name == "bart":
        cfg = T.BartConfig() if real else T.BartConfig(
            vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64)
        return T.BartModel(cfg), "ids_mask"
    if name == "clip":
        cfg = T.CLIPTextConfig() if real else T.CLIPTextConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
                                                               num_attention_heads=4, intermediate_size=37,
                                                               max_position_embeddings=64)  # fmt: skip
        return T.CLIPTextModel(cfg), "ids"
    if name == "vit":
        cfg = T.ViTConfig() if real else T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=37, image_size=30, patch_size=6)  # fmt: skip
        return T.ViTModel(cfg), "pixels"
    raise ValueError(name)


HF_MODELS = ["gpt2", "bert", "distilbert", "llama", "mistral", "phi3", "bart", "clip", "vit"]


def hf_inputs(model, kind: str, batch: int, seq: int, g: torch.Generator, device="cpu") -> dict:
    """Random inputs: token ids (with a padding mask that hides the last tokens of the first
    sequence) or images at the config's size."""
    if kind == "pixels":
        n = model.config.image_size
        return dict(pixel_values=torch.randn(batch, 3, n, n, generator=g).to(device))
    vocab = model.config.vocab_size
    out = dict(input_ids=torch.randint(0, vocab, (batch, seq), generator=g).to(device))
    if kind == "ids_mask":
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[0, -3:] = 0
        out["attention_mask"] = mask.to(device)
    return out
