"""Megatron-style sharding of a loaded transformers decoder over the ranks of a process group.

`shard_model(model, comm)` replaces modules in place, whatever the family, by the names its
decoder layers use (Llama, Qwen2/3, Mistral, Gemma: q/k/v/o_proj and gate/up/down_proj; Phi-3:
fused qkv_proj and gate_up_proj):

- q/k/v (or qkv) projections: column-parallel, each rank keeping the rows of its own heads;
  o_proj: row-parallel (`RowParallelLinear`: a local GEMM, one all-reduce, the bias added once).
- gate/up (or gate_up): column-parallel; down_proj: row-parallel.
- the input embedding: vocabulary-parallel (`VocabParallelEmbedding`: each rank looks up its
  rows, zeros elsewhere, one all-reduce); the LM head: column-parallel over the vocabulary with an
  all-gather of the logits (`ParallelLMHead`), sharing the embedding's shard when they are tied.
  The vocabulary is padded to a multiple of the world size (padding rows are zeros, cut off after
  the gather).

Column-parallel layers stay plain `nn.Linear`s with fewer rows, so `tessera.quantize` rounds the
local shards like any other linear.  transformers' attention reshapes projections with
`view(..., -1, head_dim)`, so it finds the local head count itself; the attention modules also
get a config copy with the local head counts, for the families that read them (Phi-3 slices its
fused qkv by `config.num_attention_heads`).

KV heads: with num_kv_heads >= world_size each rank keeps num_kv_heads / world_size of them; with
fewer (world_size a multiple of num_kv_heads) each KV head is replicated on world_size /
num_kv_heads ranks, as vLLM does, so every rank still holds the KV head of its query heads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from tessera.errors import UnsupportedError


class Communicator:
    """The collectives of one tensor-parallel group: a torch.distributed process group (gloo or NCCL)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce `tensor` (contiguous) in place over the ranks; returns it."""
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self.group.allreduce([tensor], options).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on all), in rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.group.allgather([out], [tensor.contiguous()]).wait()
        return out


class RowParallelLinear(torch.nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: the inputs' last dimension is split over the ranks.

    The local GEMM is an `nn.Linear` child without bias (so quantization rounds it like any
    linear); the bias is added after the reduction, once."""

    def __init__(self, linear: torch.nn.Linear, bias: torch.Tensor | None, comm: Communicator) -> None:
        super().__init__()
        self.linear = linear
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(self.linear(x).contiguous())
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose rows [start, start + rows) live on this rank; ids elsewhere give zeros,
    and one all-reduce sums the ranks' lookups into the full embedding."""

    def __init__(self, weight: torch.Tensor, start: int, vocab_size: int, comm: Communicator,
                 embed_scale: torch.Tensor | float | None = None) -> None:  # fmt: skip
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.start, self.vocab_size, self.comm = start, vocab_size, comm
        self.embed_scale = embed_scale  # Gemma 3's scaled embedding multiplies inside the module

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        out = self.comm.all_reduce(out.contiguous())
        if self.embed_scale is not None:
            out = out * (
                self.embed_scale.to(out.dtype) if isinstance(self.embed_scale, torch.Tensor) else self.embed_scale
            )
        return out


class ParallelLMHead(torch.nn.Module):
    """The LM head split over the vocabulary: local logits, all-gathered and cut to vocab_size."""

    def __init__(self, weight: torch.nn.Parameter, bias: torch.Tensor | None, vocab_size: int,
                 comm: Communicator) -> None:  # fmt: skip
        super().__init__()
        self.weight = weight  # the embedding's own Parameter when tied
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight, self.bias)
        return torch.cat(self.comm.all_gather(local), dim=-1)[..., : self.vocab_size]


@dataclass(frozen=True)
class ShardPlan:
    """How the heads of one model divide over `world_size` ranks (what `plan_shards` checked)."""

    world_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    local_heads: int
    local_kv_heads: int  # KV heads this rank keeps (and caches): replicated when num_kv_heads < world_size

    def kv_head_start(self, rank: int) -> int:
        """The first KV head of `rank`."""
        if self.num_kv_heads >= self.world_size:
            return rank * self.local_kv_heads
        return rank * self.num_kv_heads // self.world_size


def plan_shards(config: transformers.PretrainedConfig, world_size: int) -> ShardPlan:
    """Check that `config`'s heads, MLP and vocabulary divide over `world_size` ranks; ValueError if not."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    config = config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    intermediate = getattr(config, "intermediate_size", None)
    problems = []
    if heads % world_size:
        problems.append(f"num_attention_heads={heads} is not divisible by it")
    if kv_heads >= world_size and kv_heads % world_size:
        problems.append(f"num_key_value_heads={kv_heads} is not divisible by it")
    if kv_heads < world_size and world_size % kv_heads:
        problems.append(f"it is not a multiple of num_key_value_heads={kv_heads} (needed to replicate KV heads)")
    if intermediate is not None and intermediate % world_size:
        problems.append(f"intermediate_size={intermediate} is not divisible by it")
    if problems:
        raise ValueError(f"tensor_parallel_size={world_size} does not fit this model: " + "; ".join(problems))
    local_kv = max(kv_heads // world_size, 1)
    return ShardPlan(world_size, heads, kv_heads, head_dim, heads // world_size, local_kv)


def shard_model(model: transformers.PreTrainedModel, comm: Communicator) -> ShardPlan:
    """Replace `model`'s layers by this rank's shards (in place; see the module docstring)."""
    plan = plan_shards(model.config, comm.world_size)
    config = model.config.get_text_config()
    attentions = mlps = 0
    with torch.no_grad():
        for module in list(model.modules()):
            if hasattr(module, "o_proj") and (hasattr(module, "q_proj") or hasattr(module, "qkv_proj")):
                _shard_attention(module, plan, comm)
                attentions += 1
            elif hasattr(module, "down_proj") and (hasattr(module, "gate_up_proj") or hasattr(module, "up_proj")):
                _shard_mlp(module, comm)
                mlps += 1
        layers = config.num_hidden_layers
        if attentions != layers or mlps != layers:
            raise UnsupportedError(f"tensor parallelism found {attentions} attention and {mlps} MLP blocks of the "
                                   f"known layouts (q/k/v/o_proj or qkv_proj, gate/up/down_proj or gate_up_proj) in "
                                   f"a {layers}-layer {type(model).__name__}; it cannot shard this model")  # fmt: skip
        _shard_vocabulary(model, comm)
    return plan


def _rows(linear: torch.nn.Linear, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    bias = linear.bias[start:stop] if linear.bias is not None else None
    return linear.weight[start:stop], bias


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    """An nn.Linear holding copies of `weight` [out, in] and `bias` (the full tensors can then go)."""
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype)
    layer.weight = torch.nn.Parameter(weight.contiguous().clone(), requires_grad=False)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.contiguous().clone(), requires_grad=False)
    return layer


def _row_parallel(linear: torch.nn.Linear, rank: int, size: int, comm: Communicator) -> RowParallelLinear:
    cols = slice(rank * size, (rank + 1) * size)
    bias = linear.bias.detach().clone() if linear.bias is not None else None
    return RowParallelLinear(_linear(linear.weight[:, cols], None), bias, comm)


def _check_linear(linear: object, name: str) -> torch.nn.Linear:
    if type(linear) is not torch.nn.Linear:  # a quantized checkpoint's packed layers cannot be sliced here
        raise UnsupportedError(f"tensor parallelism shards float nn.Linear layers; {name} is a {type(linear).__name__} "
                               "(load float weights, and pass quantization= to round the shards)")  # fmt: skip
    return linear


def _shard_attention(attn: torch.nn.Module, plan: ShardPlan, comm: Communicator) -> None:
    d, rank = plan.head_dim, comm.rank
    q_rows = (rank * plan.local_heads * d, (rank + 1) * plan.local_heads * d)
    kv_start = plan.kv_head_start(rank)
    kv_rows = (kv_start * d, (kv_start + plan.local_kv_heads) * d)
    if hasattr(attn, "qkv_proj"):  # Phi-3: [q; k; v] fused along the output rows
        qkv = _check_linear(attn.qkv_proj, "qkv_proj")
        q_size, kv_size = plan.num_heads * d, plan.num_kv_heads * d
        offsets = ((0, q_rows), (q_size, kv_rows), (q_size + kv_size, kv_rows))
        parts = [_rows(qkv, base + a, base + b) for base, (a, b) in offsets]
        bias = torch.cat([p[1] for p in parts]) if qkv.bias is not None else None
        attn.qkv_proj = _linear(torch.cat([p[0] for p in parts]), bias)
    else:
        for name, (a, b) in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
            setattr(attn, name, _linear(*_rows(_check_linear(getattr(attn, name), name), a, b)))
    attn.o_proj = _row_parallel(_check_linear(attn.o_proj, "o_proj"), rank, plan.local_heads * d, comm)
    # Head counts some families read at run time (Phi-3's qkv split), local to this rank.
    local = copy.copy(attn.config)
    local.num_attention_heads, local.num_key_value_heads = plan.local_heads, plan.local_kv_heads
    attn.config = local
    for name, value in (("num_heads", plan.local_heads), ("num_key_value_heads", plan.local_kv_heads),
                        ("num_key_value_groups", plan.local_heads // plan.local_kv_heads)):  # fmt: skip
        if hasattr(attn, name):
            setattr(attn, name, value)


def _shard_mlp(mlp: torch.nn.Module, comm: Communicator) -> None:
    down = _check_linear(mlp.down_proj, "down_proj")
    size = down.in_features // comm.world_size
    rows = (comm.rank * size, (comm.rank + 1) * size)
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: [gate; up], split by chunk(2) in forward
        fused = _check_linear(mlp.gate_up_proj, "gate_up_proj")
        half = fused.out_features // 2
        parts = [_rows(fused, base + rows[0], base + rows[1]) for base in (0, half)]
        bias = torch.cat([p[1] for p in parts]) if fused.bias is not None else None
        mlp.gate_up_proj = _linear(torch.cat([p[0] for p in parts]), bias)
    else:
        for name in ("gate_proj", "up_proj"):
            if hasattr(mlp, name):
                setattr(mlp, name, _linear(*_rows(_check_linear(getattr(mlp, name), name), *rows)))
    mlp.down_proj = _row_parallel(down, comm.rank, size, comm)


def _shard_vocabulary(model: transformers.PreTrainedModel, comm: Communicator) -> None:
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not isinstance(embedding, torch.nn.Embedding):
        raise UnsupportedError(
            f"tensor parallelism shards an nn.Embedding; this model's is a {type(embedding).__name__}"
        )
    vocab = embedding.weight.shape[0]
    rows = -(-vocab // comm.world_size)
    start = comm.rank * rows

    def shard(weight: torch.Tensor) -> torch.Tensor:
        local = weight[start : start + rows]
        if local.shape[0] < rows:  # the last rank's padding rows: zero embeddings, logits cut off after the gather
            local = torch.cat([local, local.new_zeros(rows - local.shape[0], local.shape[1])])
        return local.contiguous().clone()

    tied = head is not None and head.weight is embedding.weight
    scale = getattr(embedding, "embed_scale", None)
    parallel_embedding = VocabParallelEmbedding(shard(embedding.weight), start, vocab, comm, scale)
    model.set_input_embeddings(parallel_embedding)
    if head is None:
        return
    head = _check_linear(head, "lm_head")
    if head.weight.shape[0] != vocab:
        raise UnsupportedError(f"the LM head has {head.weight.shape[0]} rows, the embedding {vocab}")
    weight = parallel_embedding.weight if tied else torch.nn.Parameter(shard(head.weight), requires_grad=False)
    bias = None
    if head.bias is not None:
        bias = torch.cat([head.bias, head.bias.new_zeros(rows * comm.world_size - vocab)])[start : start + rows].clone()
    model.set_output_embeddings(ParallelLMHead(weight, bias, vocab, comm))
