"""Loading a new policy into a CPU vLLM engine: vLLM's layer-wise reload against yatt's in-place load.

    PYTHONPATH=. .venv/bin/python bench/engine_load.py            # --rounds 12, --no-docs to skip the docs

The colocated weight sync of a CPU step is this load (trainer/weight_sync.py `load_in_place`
hands the learner's tensors to `VLLMEngine.update_weights`), and so is each rollout worker's
load as broadcast buckets arrive. One engine (in-process vLLM, one thread, as a colocated
controller runs it; this machine's default sampler precision) on the `small` model
(bench-small, as bench/trainer_vs_trl.py builds it), fed a perturbed fp32 policy by HF name,
the ways in alternation each round after a warm-up of each:

- reload: the worker's `reload_weights` (vLLM's own: every layer re-created on the meta
  device, its weight loaders and post-processing run again), then the packed LM-head/embedding
  GEMM rebuilt, as yatt did before;
- in place: trainer/rollout/vllm_engine.py `_load_cpu_in_place` (fused parts concatenated, each
  linear layer's weight set and packed again with vLLM's own post-processing), the default for
  the architectures it lists.

Prints each way's median seconds and the ratio, and checks that both leave the engine with the
same parameters bit for bit and the same greedy output.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import docs_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / ".yatt" / "models" / "bench-small"
SECTION = "engine_load"
PROMPTS = ["12+34=", "5+7=", "88+11=", "3+3="]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from trainer.config import parse_config
    from trainer.models import ensure_model
    from trainer.precision import sampler_dtype
    from trainer.rollout.vllm_engine import VLLMEngine

    cfg = parse_config({"model": {"path": str(MODEL), "preset": "small"},
                        "data": {"task": "arithmetic", "arithmetic": {"digits": 2, "ops": ["+"]}},
                        "rollout": {"engine": "vllm", "n": 1, "max_new_tokens": 16, "temperature": 0.0,
                                    "kv_cache_gb": 0.25},
                        "placement": {"mode": "colocate", "devices": 1, "device_type": "cpu"}})
    ensure_model(cfg)
    engine = VLLMEngine(MODEL, cfg, threads=1)
    torch.set_num_threads(1)
    policy = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    with torch.no_grad():  # a policy a few updates away from the engine's
        gen = torch.Generator().manual_seed(0)
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    weights = policy.state_dict()  # names the tied lm_head.weight too, as a learner's does
    n_bytes = sum(t.numel() * t.element_size() for t in weights.values())

    def load(in_place: bool) -> float:
        engine._in_place = in_place
        t = time.perf_counter()
        engine.update_weights(weights.items())
        return time.perf_counter() - t

    def state(worker) -> dict:
        return {n: p.detach().clone() for n, p in worker.model_runner.get_model().named_parameters()}

    ways = {"reload (vLLM's layer-wise)": False, "in place (yatt)": True}
    after: dict[str, tuple[dict, list]] = {}
    for name, in_place in ways.items():  # warm-up, and what each way leaves behind
        load(in_place)
        after[name] = (engine.llm.collective_rpc(state)[0],
                       [s.response_ids for s in engine.generate(PROMPTS, 1)])
    (p_a, g_a), (p_b, g_b) = after.values()
    same_params = p_a.keys() == p_b.keys() and all(torch.equal(p_a[k], p_b[k]) for k in p_a)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        order = list(ways.items()) if r % 2 == 0 else list(reversed(ways.items()))
        for name, in_place in order:
            times[name].append(load(in_place))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in times.items()),
              flush=True)
    engine.close()

    med = {name: statistics.median(v) for name, v in times.items()}
    reload_s, in_place_s = med.values()
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; `small` model "
        f"({n_bytes / 2**20:.1f} MiB of fp32 weights by HF name), sampler in "
        f"{sampler_dtype(cfg, 'cpu')}, one thread, {args.rounds} rounds per way in alternation "
        f"(median). Command: `PYTHONPATH=. .venv/bin/python bench/engine_load.py`.",
        "",
        "| way | median load (ms) |",
        "|---|---:|",
        *[f"| {name} | {s * 1e3:.1f} |" for name, s in med.items()],
        "",
        f"In place is **{reload_s / in_place_s:.2f}×** the speed of vLLM's reload. Same parameters bit "
        f"for bit: {'yes' if same_params else 'NO'}; same greedy output: {'yes' if g_a == g_b else 'NO'}.",
        "",
    ]
    text = "## Loading a policy into a CPU vLLM engine (issue 8 item 3)\n\n" + "\n".join(lines)
    print(text)
    if not args.no_docs:
        docs_section.write_section(SECTION, text)
    print(f"ratio: {reload_s / in_place_s:.2f}")
    if not (same_params and g_a == g_b):
        raise SystemExit("the two ways left the engine different")


if __name__ == "__main__":
    main()
