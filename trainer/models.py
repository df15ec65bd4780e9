"""Tiny causal LMs built locally: a Qwen2-style model (random init) and a tokenizer trained on
the task's own text, saved as an HF directory that both ``transformers`` and vLLM load.

The tokenizer is byte-level BPE (any input text encodes, nothing maps to an unknown token) with
digits split one per token, as Qwen and Llama do, so arithmetic stays character-level while
ordinary text still gets merges.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trainer.config import TrainerConfig

__all__ = ["PRESETS", "Preset", "ensure_model", "make_tiny_model", "EOS_TOKEN", "PAD_TOKEN"]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int
    bpe_vocab: int  # upper bound; a corpus of digits and symbols yields no merges at all


PRESETS: dict[str, Preset] = {
    # head_dim 32 for nano/micro and 64 for small: sizes vLLM's CPU attention supports.
    "nano": Preset(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=256,
                   max_positions=512, bpe_vocab=512),
    "micro": Preset(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=512,
                    max_positions=512, bpe_vocab=1024),
    "small": Preset(hidden=384, layers=8, heads=6, kv_heads=2, intermediate=1536,
                    max_positions=1024, bpe_vocab=4096),
}  # fmt: skip


def _train_tokenizer(texts: list[str], vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts or [""], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",  # generation pads on the left; training builds its own batches
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def make_tiny_model(
    out_dir: str | Path, preset: str, task_text: list[str], *, seed: int = 0
) -> Path:
    """Build a random-init Qwen2 model + tokenizer for ``task_text`` at ``out_dir``.

    Writes into a temporary sibling directory and renames it into place, so a reader never
    sees a half-written model. Raises FileExistsError if ``out_dir`` already exists.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    p = PRESETS[preset]
    tokenizer = _train_tokenizer(task_text, p.bpe_vocab)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=p.hidden,
        intermediate_size=p.intermediate,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        max_position_embeddings=p.max_positions,
        rope_theta=10_000.0,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_sliding_window=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, out)  # atomic on one filesystem; fails if a racer got there first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def ensure_model(cfg: TrainerConfig) -> Path:
    """The model directory for ``cfg``; built first when ``model.preset`` is set and it is missing.

    Safe to call from several processes at once: one builds under a file lock, the others wait
    and then find the finished directory.
    """
    path = Path(cfg.model.path)
    if cfg.model.preset is None or path.exists():
        return path
    from trainer.data import task_text

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.parent / f".{path.name}.lock"
    with lock.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            if not path.exists():
                make_tiny_model(path, cfg.model.preset, task_text(cfg), seed=cfg.seed)
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
    return path
