"""Tiny Hugging Face model directories for the tessera.llm tests, made on the spot.

`make_model_dir(path, family)` trains a byte-level BPE tokenizer on a small English corpus
(so text round-trips and multi-byte characters occur), builds a randomly initialised decoder of
the family with a few layers, and saves what `tessera serve DIR` reads: config.json,
model.safetensors, tokenizer.json with its config and a chat template, generation_config.json.
Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache keeps attention keys and values in fixed-size blocks.",
    "Continuous batching admits new requests at every step of the engine.",
    "Hello, how are you today? I am fine, thank you very much!",
    "Once upon a time there was a little compiler that wanted to be fast.",
    "Numbers like 12345 and 3.14159 appear in text too, as do symbols: #, $, %.",
    "Café, naïve, über and 東京 are words with characters outside ASCII.",
    "The user asks a question and the assistant answers it politely.",
] * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]

# Prompts of several lengths (one with non-ASCII text) for the engine's greedy comparisons.
PROMPTS = [
    "Hello, how are",
    "The quick brown fox jumps over the lazy dog. A paged KV cache keeps attention keys",
    "Café",
    "Once upon a time there was a little compiler that",
]

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "phi3")


def train_tokenizer(vocab_size: int = 384) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on CORPUS, with BOS prepended and a chat template."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>", pad_token="<pad>")  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(family: str, vocab_size: int, **overrides) -> transformers.PretrainedConfig:
    """A small config of `family`: 2 layers, hidden 64, 4 query heads over 2 KV heads."""
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=False)  # fmt: skip
    if family == "gemma":
        common.update(head_dim=16)
    common.update(overrides)
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
                    "gemma": transformers.GemmaConfig, "phi3": transformers.Phi3Config,
                    "mixtral": transformers.MixtralConfig}[family]  # fmt: skip
    return config_class(**common)


def make_model(family: str = "llama", vocab_size: int = 384, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A randomly initialised causal LM of `family` (float32, eval mode)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, vocab_size, **overrides))
    with torch.no_grad():  # larger weights than the default init: the tokens then depend on the context
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25)
    return model.eval()


def make_model_dir(path: Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny `family` model with its tokenizer under `path` (created); returns `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    model = make_model(family, len(tokenizer), seed, **overrides)
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def model_dir_maker(tmp_path_factory) -> Callable[[str], Path]:
    """`get(family)`: a tiny model directory of that family, made on first use under pytest's
    temporary directories and reused after (for a module-scoped fixture)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = make_model_dir(tmp_path_factory.mktemp(family), family)
        return made[family]

    return get
