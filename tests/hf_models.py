"""Hugging Face transformers built offline from tiny configs (random weights, fixed seeds), with
batches in the form each takes: a BERT encoder (keyword batches, a ``ModelOutput``), a Llama-style
decoder with ``use_cache=False`` (token ids), GPT-2 (transformers' ``Conv1D`` projections), a ViT
(pixel values), a BERT wrapped by mean pooling as sentence-embedding models are (positional
``(input_ids, attention_mask)``), and a tiny decoder of each family people ship (``tiny_family``)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, ViTConfig, ViTModel

VOCAB = 256


def _tokens(seed: int, count: int = 6, batch: int = 4, length: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, length), generator=generator) for _ in range(count)]


def tiny_bert() -> tuple[nn.Module, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, 12:] = 0  # padding on every row's last tokens
    return BertModel(config).eval(), [{"input_ids": ids, "attention_mask": mask} for ids in _tokens(1)]


def tiny_llama(layers: int = 2) -> tuple[nn.Module, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    return LlamaForCausalLM(config).eval(), [(ids,) for ids in _tokens(2)]


def tiny_gpt2() -> tuple[nn.Module, list[tuple[torch.Tensor]]]:
    """GPT-2's layout at its config's defaults (``use_cache=True``): its projections are transformers'
    ``Conv1D``, weights stored (inputs, outputs)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval(), [(ids,) for ids in _tokens(3)]


def tiny_moe(layers: int = 2) -> tuple[nn.Module, list[tuple[torch.Tensor]]]:
    """Qwen3-MoE at its config's defaults (``tiny_family``, ``layers`` blocks): its experts are 3-d
    parameters of one module, not Linears."""
    model = tiny_family("Qwen3-MoE", layers)
    return model, [(ids,) for ids in _tokens(4, count=3)]


def tiny_vit() -> tuple[nn.Module, list[tuple[torch.Tensor]]]:
    torch.manual_seed(0)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
    )
    generator = torch.Generator().manual_seed(3)
    return ViTModel(config).eval(), [(torch.randn(4, 3, 32, 32, generator=generator),) for _ in range(6)]


class MeanPooled(nn.Module):
    """A sentence embedding: a BERT's hidden states averaged over the tokens the mask keeps."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).float()
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def mean_pooled_bert() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    encoder, batches = tiny_bert()
    return MeanPooled(encoder).eval(), [(b["input_ids"], b["attention_mask"]) for b in batches]


MODELS = {"bert": tiny_bert, "llama": tiny_llama, "vit": tiny_vit}


def tiny_family(name: str, layers: int = 2) -> nn.Module:
    """A decoder of family ``name`` (a key of ``FAMILIES``: the names of docs/ENGINES.md's families table) at its config's
    defaults (``use_cache=True``) but for its sizes: ``layers`` blocks of width 64, 4 heads (GPT-2: 2
    blocks)."""
    import transformers as t

    sizes = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
    }
    grouped = {**sizes, "num_key_value_heads": 2}
    tokens = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
    opt = {k: v for k, v in sizes.items() if k != "intermediate_size"}
    built = {
        "Llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(**grouped)),
        "Mistral": lambda: t.MistralForCausalLM(t.MistralConfig(**grouped)),
        "Qwen2": lambda: t.Qwen2ForCausalLM(t.Qwen2Config(**grouped)),
        "Qwen3": lambda: t.Qwen3ForCausalLM(t.Qwen3Config(**grouped, head_dim=16)),
        "Granite": lambda: t.GraniteForCausalLM(t.GraniteConfig(**grouped)),
        "SmolLM3": lambda: t.SmolLM3ForCausalLM(t.SmolLM3Config(**grouped, **tokens)),
        "Phi-3": lambda: t.Phi3ForCausalLM(t.Phi3Config(**grouped, **tokens)),
        "Gemma 2": lambda: t.Gemma2ForCausalLM(t.Gemma2Config(**grouped, head_dim=16)),
        "Gemma 3": lambda: t.Gemma3ForCausalLM(t.Gemma3TextConfig(**grouped, head_dim=16, sliding_window=16)),
        "OLMo 2": lambda: t.Olmo2ForCausalLM(t.Olmo2Config(**grouped, **tokens)),
        "Qwen3-MoE": lambda: t.Qwen3MoeForCausalLM(
            t.Qwen3MoeConfig(**grouped, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2)
        ),
        "StableLM": lambda: t.StableLmForCausalLM(t.StableLmConfig(**grouped)),
        "Phi": lambda: t.PhiForCausalLM(t.PhiConfig(**sizes, **tokens)),
        "OPT": lambda: t.OPTForCausalLM(t.OPTConfig(**opt, ffn_dim=128, word_embed_proj_dim=64, **tokens)),
        "LFM2": lambda: t.Lfm2ForCausalLM(t.Lfm2Config(**grouped, **tokens, layer_types=["conv", "full_attention"])),
        "GPT-NeoX": lambda: t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**sizes, **tokens)),
        "GPT-2": lambda: t.GPT2LMHeadModel(
            t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, **tokens)
        ),
    }
    torch.manual_seed(0)
    return built[name]().eval()


FAMILIES = (
    "Llama", "Mistral", "Qwen2", "Qwen3", "Granite", "SmolLM3", "Phi-3", "Gemma 2", "Gemma 3", "OLMo 2", "Qwen3-MoE",
    "StableLM", "Phi", "OPT", "LFM2", "GPT-NeoX", "GPT-2",
)  # fmt: skip
