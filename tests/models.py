"""Small random-weight HF checkpoints (made with transformers from a config, no downloads) for tests.

DESIGN.md: give test models a large initializer_range (0.3-0.6) so outputs depend on the context and the
top-1/top-2 logit margin stays clear of fp32 noise; otherwise exact-match tests prove little.
"""
from __future__ import annotations

import json
from pathlib import Path

CORPUS = (
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital. "
    "Translate to French: good morning, how are you today? Solve: if x + 3 = 7 then x = 4. "
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    "Write an essay about the history of computing, memory, paging and operating systems. "
    "Once upon a time there was a small engine that served many requests at once. 0123456789 "
    "Héllo wörld, naïve café — ünïcödé 日本語 テスト 😀 emoji. "
) * 4

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# name -> (transformers config class name, overrides)
# longrope factors of the tiny Phi models (head_dim 16: 8 frequencies), short near 1, long well above it
LONGROPE_SHORT = [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0]
LONGROPE_LONG = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2)),
    "llama3rope": ("LlamaConfig", dict(num_key_value_heads=2, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    # SmolLM3: layers 1 and 3 without rope (no_rope_layers 0), the others with it
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, num_key_value_heads=2, no_rope_layers=[1, 0, 1, 0],
                                      pad_token_id=0, tie_word_embeddings=False)),
    # Phi-3.5-mini style longrope: original context 32 (prompts go past it), context 1024 (long factors used);
    # smaller weights than the others: with the attention factor (1.36) the 0.4 init gives logits of 16, whose
    # float32 rounding alone (transformers float32 vs float64) exceeds 1e-4
    "phi3longrope": ("Phi3Config", dict(num_key_value_heads=2, pad_token_id=0, original_max_position_embeddings=32,
                                        initializer_range=0.25,
                                        rope_scaling=dict(type="longrope", short_factor=LONGROPE_SHORT,
                                                          long_factor=LONGROPE_LONG))),
    # Phi-4-mini style: partial rotary (12 of 16 values per head turn) with longrope
    "phi4mini": ("Phi3Config", dict(num_key_value_heads=2, pad_token_id=0, original_max_position_embeddings=32,
                                    initializer_range=0.25,
                                    tie_word_embeddings=True, partial_rotary_factor=0.75,
                                    rope_scaling=dict(type="longrope", short_factor=LONGROPE_SHORT[:6],
                                                      long_factor=LONGROPE_LONG[:6]))),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, sliding_window=24)),
    "tied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    # head_dim 24 != hidden 64 / 4 heads (catches a derived head_dim); q_norm / k_norm per head
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=24)),
    "qwen3tied": ("Qwen3Config", dict(num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)),
    # layer 0 full attention, layer 1 a sliding window of 8 (use_sliding_window, max_window_layers)
    "qwen3window": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=24, use_sliding_window=True,
                                         sliding_window=8, max_window_layers=1)),
    # fused qkv_proj / gate_up_proj in the checkpoint; transformers applies sliding_window on every layer
    # (pad_token_id: Phi3Config's default 32000 is outside the tiny vocabulary)
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, sliding_window=16, pad_token_id=0)),
    "phi3tied": ("Phi3Config", dict(num_key_value_heads=1, tie_word_embeddings=True, pad_token_id=0)),
    # Gemma 3 text: sliding / full / sliding layers (window 8, shorter than test prompts), local rope theta
    # 500 vs global 10000 with linear scaling 8, query_pre_attn_scalar 20 != head_dim 24, tied embeddings
    "gemma3": ("Gemma3TextConfig", dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=20, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}})),
    # Gemma 2: one rope table, attention and final logit softcapping (small caps, so they matter)
    "gemma2": ("Gemma2Config", dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=20, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True,
        attn_logit_softcapping=5.0, final_logit_softcapping=15.0)),
    # Mixture-of-Experts (tests/test_moe.py, test_moe_gguf.py): 8 experts top-2 renormalised, head_dim 24, layer 1 a
    # dense MLP (mlp_only_layers), experts narrower than the dense MLP (widths multiples of GGUF's 32-value blocks)
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1])),
    # every 2nd layer sparse (decoder_sparse_step), top-3 weights not renormalised
    "qwen3_moe_step": ("Qwen3MoeConfig", dict(
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
        norm_topk_prob=False, decoder_sparse_step=2)),
    # q/k/v biases, a sigmoid-gated shared expert, top-2 not renormalised (Qwen2-MoE's default)
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, norm_topk_prob=False)),
    # 4 experts top-2 (always renormalised), sliding window 16 on every layer
    "mixtral": ("MixtralConfig", dict(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, sliding_window=16)),
}
# archs whose RMSNorm weights are randomized (transformers initializes them to ones, which would hide a
# norm weight that is dropped or swapped, e.g. qwen3's q_norm / k_norm)
RANDOM_NORM_ARCHS = ("qwen3", "qwen3tied", "qwen3window", "phi3", "phi3tied", "gemma3", "gemma2", "smollm3",
                     "phi3longrope", "phi4mini",
                     "qwen3_moe", "qwen3_moe_step", "qwen2_moe", "mixtral")


def make_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a fixed corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    return tok


def make_random_model(path: str | Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write config.json, model.safetensors and tokenizer files of a tiny random model to PATH."""
    import torch
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer()
    cls_name, arch_over = ARCHS[arch]
    cfg = dict(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
        initializer_range=0.4, bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=False,
    )
    cfg.update(arch_over)
    cfg.update(overrides)
    config = getattr(transformers, cls_name)(**cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if arch in RANDOM_NORM_ARCHS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE, "add_bos_token": False,
    }, indent=1))
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def load_hf(path: str | Path):
    """(model, tokenizer) from transformers for the reference side of a test."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    return model, tok


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers (no EOS stop), the reference for exact-match tests."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()
