"""fp32 against bf16 mixed precision (`train.mixed_precision`) in the Learner's RL passes, side by side.

    PYTHONPATH=. .venv/bin/python bench/mixed_precision.py                      # CPU, `small` model
    PYTHONPATH=. python bench/mixed_precision.py --shape qwen0.5b --device cuda  # a GPU

One process, one model, one batch of random tokens (`--rows` sequences of a 16-token prompt and
`--response` response tokens; the defaults are the generation-heavy workload of
bench/trainer_vs_trl.py). For each precision, alternately: the reference pass (no grad) and one
training pass (forward, backward, clip, AdamW step), the median of `--repeats` after a warm-up.
Also the log-probs' agreement (bf16 autocast against fp32, same weights). Prints a table and
writes the `mixed_precision` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import docs_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / ".yatt" / "models" / "bench-small"
# Qwen2.5-0.5B's shape (random init, the small model's tokenizer: only its pad/eos ids are used)
QWEN_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
            "tie_word_embeddings": True, "max_position_embeddings": 4096}


def model_dir(shape: str) -> Path:
    """The bench model of `shape`, built locally when missing (nothing is downloaded)."""
    from trainer.config import parse_config
    from trainer.models import ensure_model

    ensure_model(parse_config({"model": {"path": str(SMALL), "preset": "small"}}))
    if shape == "small":
        return SMALL
    out = ROOT / ".yatt" / "models" / f"bench-{shape}-shape"
    if not (out / "config.json").exists():
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        config = AutoConfig.from_pretrained(SMALL)
        for key, value in QWEN_05B.items():
            setattr(config, key, value)
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
        AutoTokenizer.from_pretrained(SMALL).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=["small", "qwen0.5b"], default="small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from trainer.config import parse_config
    from trainer.learner import Learner, native_bf16

    path = model_dir(a.shape)
    cfg = parse_config({"model": {"path": str(path)}, "algorithm": {"name": "grpo", "kl_coef": 0.04},
                        "train": {"mixed_precision": "bf16", "micro_batch_size": a.rows}})
    learner = Learner(cfg, path, device=a.device)
    assert learner.reference is not None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 258, (16,), generator=g).tolist() for _ in range(a.rows)]
    responses = [torch.randint(2, 258, (a.response,), generator=g).tolist() for _ in range(a.rows)]
    ids, attn, index, mask = learner._layout(prompts, responses)
    sync = torch.cuda.synchronize if learner.device.type == "cuda" else (lambda: None)
    precisions = {"fp32": contextlib.nullcontext, "bf16": learner.autocast}

    with torch.no_grad():  # agreement first, on the untouched reference weights
        lp = {"fp32": learner._logprobs(learner.reference, ids, attn, index)[0]}
        with learner.autocast():
            lp["bf16"] = learner._logprobs(learner.reference, ids, attn, index)[0]
    diff = (lp["bf16"] - lp["fp32"])[mask.bool()].abs()

    def timed(fn, precision) -> float:
        sync()
        t = time.perf_counter()
        fn(precision)
        sync()
        return time.perf_counter() - t

    def reference(precision) -> None:
        with torch.no_grad(), precision():
            learner._logprobs(learner.reference, ids, attn, index)

    def train(precision) -> None:
        learner.optimizer.zero_grad(set_to_none=True)
        with precision():
            out, _ = learner._logprobs(learner.policy, ids, attn, index, entropy=True)
        (-(out * mask).sum() / mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(learner.policy.parameters(), 1.0)
        learner.optimizer.step()

    times: dict[str, dict[str, list[float]]] = {p: {"reference": [], "train": []} for p in precisions}
    for rep in range(a.repeats + 1):  # the first round is a warm-up
        for name, precision in precisions.items():
            r, t = timed(reference, precision), timed(train, precision)
            if rep:
                times[name]["reference"].append(r)
                times[name]["train"].append(t)
    med = {p: {k: statistics.median(v) for k, v in d.items()} for p, d in times.items()}
    tokens = int(attn.sum())
    params = learner.num_parameters()
    load = os.getloadavg()
    where = (torch.cuda.get_device_name() if learner.device.type == "cuda"
             else f"CPU, {a.threads} threads, native bf16: {native_bf16(learner.device)}")
    command = " ".join(["PYTHONPATH=. python bench/mixed_precision.py", *sys.argv[1:]])
    rows = [f"`{command}` — "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {where}, load average "
            f"{load[0]:.1f}; {params / 1e6:.1f}M parameters, {a.rows} × ({16} + {a.response}) tokens "
            f"({tokens} in all), median of {a.repeats}.", "",
            "| pass | fp32 | bf16 autocast | fp32 / bf16 |", "|---|---:|---:|---:|"]
    for k, what in (("reference", "reference (no grad)"), ("train", "training (fwd, bwd, AdamW step)")):
        rows.append(f"| {what} | {med['fp32'][k]:.3f} s | {med['bf16'][k]:.3f} s | "
                    f"**{med['fp32'][k] / med['bf16'][k]:.2f}×** |")
    rows += ["", f"Log-prob agreement, bf16 autocast against fp32 (same weights): mean |Δ| "
             f"{float(diff.mean()):.4f}, max |Δ| {float(diff.max()):.4f} nats per token "
             f"(mean |log-prob| {float(lp['fp32'][mask.bool()].abs().mean()):.2f})."]
    text = "\n".join(rows)
    print(text)
    if not a.no_docs:
        docs_section.write_section(f"mixed_precision_{a.shape}_{learner.device.type}",
                                   f"## Mixed precision: fp32 against bf16 autocast ({a.shape}, "
                                   f"{learner.device.type})\n\n{text}\n")


if __name__ == "__main__":
    main()
