"""Tiny random Hugging Face checkpoints, built in the test with a fixed seed.

Random init at HF's scale gives near-tied logits (every greedy test passes by luck) or,
with tied embeddings, a model that just echoes its last token. `make_tiny_checkpoint`
re-draws the weights at scales that give peaked, varied logits, and trains a small
byte-level BPE tokenizer (with a chat template) on a fixed text, so each checkpoint is a
complete folder: config.json, model.safetensors, tokenizer files.
"""

from __future__ import annotations

import math
import os
import sysconfig

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
_CORPUS_MODULES = ["textwrap.py", "heapq.py", "bisect.py", "colorsys.py", "fnmatch.py"]


def _corpus() -> list[str]:
    stdlib = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in _CORPUS_MODULES:
        path = os.path.join(stdlib, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
    # A fixed fallback so the tokenizer is the same kind of thing on any interpreter.
    texts.append("def hello(name):\n    return 'hello ' + name\n" * 20)
    return texts


def make_tokenizer(path: str, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def _hf_config(family: str, vocab_size: int, eos: int, **overrides):
    import transformers as tf

    common = dict(vocab_size=vocab_size, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    if family == "bamba":
        cfg = dict(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=2,
            attn_layer_indices=[1],
            mamba_n_heads=6,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=12,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
        )
        cls = tf.BambaConfig
    elif family == "mamba2":
        cfg = dict(
            hidden_size=40,
            num_heads=5,
            head_dim=16,
            state_size=12,
            num_hidden_layers=3,
            n_groups=1,
            expand=2,
            conv_kernel=4,
            chunk_size=16,
            tie_word_embeddings=False,
        )
        cls = tf.Mamba2Config
    elif family == "mamba":
        cfg = dict(
            hidden_size=40,
            state_size=10,
            num_hidden_layers=3,
            expand=2,
            conv_kernel=4,
            time_step_rank=6,
            tie_word_embeddings=True,
        )
        cls = tf.MambaConfig
    elif family == "falcon_mamba":
        cfg = dict(
            hidden_size=40,
            state_size=10,
            num_hidden_layers=3,
            expand=2,
            conv_kernel=4,
            time_step_rank=6,
            tie_word_embeddings=False,
        )
        cls = tf.FalconMambaConfig
    elif family == "llama":
        cfg = dict(
            hidden_size=48,
            intermediate_size=72,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
        )
        cls = tf.LlamaConfig
    elif family == "zamba2":
        cfg = dict(
            hidden_size=42,
            intermediate_size=50,
            num_hidden_layers=7,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba", "hybrid"],
            num_mem_blocks=2,
            num_attention_heads=6,
            num_key_value_heads=6,
            use_shared_attention_adapter=True,
            adapter_rank=5,
            use_mem_rope=True,
            n_mamba_heads=6,
            mamba_expand=2,
            mamba_ngroups=2,
            mamba_d_state=6,
            mamba_d_conv=4,
            chunk_size=16,
            tie_word_embeddings=True,
            max_position_embeddings=4096,
        )
        cls = tf.Zamba2Config
    elif family == "nemotron_h":
        cfg = dict(
            hidden_size=48,
            layers_block_type=["mamba", "mlp", "attention", "mamba", "mlp"],
            num_attention_heads=6,
            num_key_value_heads=1,
            head_dim=12,
            intermediate_size=72,
            mamba_num_heads=6,
            mamba_head_dim=10,
            n_groups=3,
            ssm_state_size=12,
            conv_kernel=4,
            chunk_size=16,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
        )
        cls = tf.NemotronHConfig
    elif family == "falcon_h1":
        cfg = dict(
            hidden_size=40,
            intermediate_size=56,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            mamba_d_ssm=60,
            mamba_n_heads=6,
            mamba_d_head=10,
            mamba_n_groups=3,
            mamba_d_state=12,
            mamba_d_conv=4,
            mamba_chunk_size=16,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            # µP multipliers away from 1 so that a misplaced one changes the output.
            embedding_multiplier=1.7,
            lm_head_multiplier=0.6,
            key_multiplier=0.7,
            attention_in_multiplier=1.3,
            attention_out_multiplier=0.8,
            ssm_in_multiplier=0.9,
            ssm_out_multiplier=1.2,
            mlp_multipliers=[1.4, 0.7],
            ssm_multipliers=[0.8, 1.3, 0.7, 1.2, 0.6],
        )
        cls = tf.FalconH1Config
    elif family == "jamba":
        # transformers runs experts through torch._grouped_mm, which needs hidden and
        # intermediate sizes that are multiples of 4 in float32 (16-byte strides).
        cfg = dict(
            hidden_size=40,
            intermediate_size=36,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=5,
            num_experts_per_tok=2,
            attn_layer_period=3,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=0,
            mamba_d_state=10,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=6,
            use_mamba_kernels=False,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
        )
        cls = tf.JambaConfig
    elif family == "granitemoehybrid":
        cfg = dict(
            hidden_size=48,
            intermediate_size=28,
            shared_intermediate_size=44,
            num_hidden_layers=3,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_local_experts=5,
            num_experts_per_tok=2,
            layer_types=["mamba", "attention", "mamba"],
            position_embedding_type="rope",
            mamba_n_heads=6,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=12,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=16,
            embedding_multiplier=1.6,
            residual_multiplier=0.7,
            attention_multiplier=0.3,
            logits_scaling=1.25,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
        )
        cls = tf.GraniteMoeHybridConfig
    else:
        raise ValueError(f"unknown family {family!r}")
    cfg.update(common)
    cfg.update(overrides)
    return cls(**cfg)


@torch.no_grad()
def _rescale(model: torch.nn.Module, tied: bool, gen: torch.Generator) -> None:
    """Redraw weights so activations stay O(1) and logits are peaked but varied."""
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "A_log" in name or "dt_bias" in name or leaf == "D":
            continue  # keep HF's SSM dynamics init (stable decays, sane step sizes)
        if "norm" in name and p.ndim == 1:
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        elif "embed" in name or "embeddings" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * (0.35 if tied else 1.0))
        elif "lm_head" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * (2.5 / math.sqrt(p.shape[1])))
        elif "conv1d.weight" in name:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        elif p.ndim == 2:
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            # Biases that move close choices between experts, and a last expert whose
            # score plus bias (below -2) always loses: one expert that receives no token.
            b.copy_(torch.randn(b.shape, generator=gen) * 0.2)
            b[-1] = -3.0


def make_tiny_checkpoint(path: str, family: str = "bamba", seed: int = 0, **overrides) -> str:
    """Build and save a tiny `family` checkpoint (+ tokenizer) under `path`; return `path`."""
    import transformers as tf

    os.makedirs(path, exist_ok=True)
    tokenizer = make_tokenizer(path)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    # A vocab_size override may exceed the tokenizer (ids it never produces are unused rows).
    vocab = overrides.pop("vocab_size", len(tokenizer))
    config = _hf_config(family, vocab, eos, **overrides)
    arch = {
        "bamba": tf.BambaForCausalLM,
        "mamba2": tf.Mamba2ForCausalLM,
        "mamba": tf.MambaForCausalLM,
        "falcon_mamba": tf.FalconMambaForCausalLM,
        "llama": tf.LlamaForCausalLM,
        "zamba2": tf.Zamba2ForCausalLM,
        "nemotron_h": tf.NemotronHForCausalLM,
        "falcon_h1": tf.FalconH1ForCausalLM,
        "jamba": tf.JambaForCausalLM,
        "granitemoehybrid": tf.GraniteMoeHybridForCausalLM,
    }[family]
    torch.manual_seed(seed)
    model = arch(config)
    _rescale(model, config.tie_word_embeddings, torch.Generator().manual_seed(seed))
    model.save_pretrained(path)
    return path


def make_attention(heads: int, kv_heads: int, head_dim: int, scale: float):
    """A single-rank Attention layer without RoPE, on the torch ops (its fused paths are
    what the tests call directly)."""
    from ssmserve.distributed.parallel import TensorParallel
    from ssmserve.kernels import get_ops
    from ssmserve.layers.attention import Attention

    return Attention(
        hidden_size=heads * head_dim,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ops=get_ops("torch", "cpu"),
        tp=TensorParallel(),
        rotary=None,
        scale=scale,
    )
