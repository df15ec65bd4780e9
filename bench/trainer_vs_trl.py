"""yatt against TRL's GRPOTrainer on the same work, and against the limit of this machine.

    PYTHONPATH=. .venv/bin/python bench/trainer_vs_trl.py            # needs `pip install -e .[bench]`

Same `small` tiny model (built with `yatt make-tiny-model --preset small`), same 2-digit addition
prompts, 4 prompts x 8 samples per step, lr 1e-4, KL 0.04, no warm start; two workloads: 32 new
tokens ("short") and 256 ("generation-heavy"). Cases, each in its own process, one after the
other in this one run: yatt colocate and disaggregated on 2 devices (`yatt train`, its default
precision), each also with its opt-in compilation (`train.compile`, `rollout.compile`; the
compile time lands in its first step, shown beside the medians), yatt colocate with
`train.balance_ranks: deal` and `off` (groups dealt across the ranks by tokens at a meeting, and each
rank training its own groups: the A/B of the default, micro-batches shared through a queue), TRL GRPOTrainer default (HF generate, fp32), on one thread, with its own CPU mixed
precision (`bf16=True`; skipped on a CPU that would only emulate bf16), and TRL's vLLM colocate mode (recorded if it fails), and the limit: each
phase alone at its best on all cores (vLLM generating the step's samples, as one engine on every
core or as an engine per core at once, whichever is faster; the reference pass; one
training pass; each timed 5 times after an untimed run and counted at its median, the statistic
a case reports, with the fastest run beside it), at the precision yatt runs (fp32 figures beside
them), measured twice: with
yatt's defaults (`limit`) and with the engines and blocks compiled (`limit-compiled`), each phase
counting at the faster of the two; its sum bounds a
colocated step and its max a disaggregated one; each case is judged against it at the case's
own work too (the passes scaled to the case's tokens a step: the limit's one draw of samples is
as long or as short as it happens to be, `limit_at`). Prints samples/s, generated tokens/s,
tokens a step, median step and phase split per case (a colocated case's training phase with the
part of it its ranks waited for each other, `time/rank_wait` and `time/grad_sync`) and the share
of the machine's CPU time the hypervisor gave to others while it ran (steal) with one core's
matmul speed right before and after it (`core_speed`), writes a reward-curve PNG per workload and
its section of docs/benchmarks.md; the last line is `ratio: X` = yatt's best samples/s over the
fastest TRL setting that ran, on the generation-heavy workload (the same in tokens/s beside it).
Opt-in case suffixes (e.g. `--cases yatt-colocate,yatt-colocate-dynheap,yatt-colocate-tp2,limit`):
`-dynheap`, the same yatt case with `YATT_STEADY_HEAP=0`, glibc's dynamic malloc thresholds
(trainer/host_memory.py); `-gloo`, with `YATT_SHM_GRADS=0`, the ranks' gradients averaged
over gloo instead of in shared memory (trainer/shm_grads.py); `-nativenorm`, with
`YATT_VLLM_CPU_NORMS=0`, the eager engine's RMSNorms on vLLM's native PyTorch path instead of
its C++ kernels (trainer/rollout/vllm_cpu_norms.py); `-tp2`, with `rollout.tensor_parallel_size: 2` (the two controllers
share one vLLM engine sharded over their cores instead of an engine each); `-refhome`, with
`placement.reference_on_rollout: 0` (disaggregated: the training rank runs the whole reference
pass, the A/B of the rollout worker taking a share of it); `-exact`, with `train.pad_to_multiple: 1`
(each micro-batch cut at its own longest row instead of rounded up to a shape bucket); `-wide`, one device holding both
cores (one controller, its engine and learner threaded over both) instead of two of a core each;
`-ppo`, PPO in place of GRPO (a critic, advantages whitened over the batch; with `-dealt`, the
A/B of the queue sharing the passes before the advantages), on the same work but not TRL's.
Steps per case: 20 on the short workload and 6 on the generation-heavy one (the issue's runs;
`--steps` sets both); medians and samples/s skip each case's first step (its warm-up, and a
compiled case's compile), whose time is its own column.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import docs_section  # noqa: E402 (bench/docs_section.py, beside this script)
import psutil

from trainer.host_memory import steady_heap
from trainer.precision import cpu_native_bf16

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / ".yatt" / "models" / "bench-small"
PROMPTS, N, LR, KL = 4, 8, 1e-4, 0.04
MICRO_BATCH_TOKENS = 1024
SECTION = "trainer_vs_trl"
# timed runs of each of the limit's phases, after an untimed one: the limit counts their median,
# the statistic a case reports (its median step), and shows the fastest beside it
TIMED = 5


def yatt_config(tokens: int, steps: int, mode: str, compiled: bool = False, balance: str = "queue",
                tensor_parallel: int = 1, reference_on_rollout: float | str = "auto",
                devices: int = 2, pad_to_multiple: int | None = None, algorithm: str = "grpo") -> dict:
    """``compiled``: `train.compile` and `rollout.compile` (opt-in: faster steps for a slower start);
    ``balance``: `train.balance_ranks` (queue, the default: a rank out of work takes the others'
    micro-batches; deal: groups dealt across ranks by tokens; off: each rank its own rows);
    ``tensor_parallel``: `rollout.tensor_parallel_size` (one engine sharded over that many controllers);
    ``reference_on_rollout``: `placement.reference_on_rollout` (disaggregated: the rollout
    worker's share of the reference pass; the default, auto, balances it from phase times);
    ``devices``: 2 devices of a core each, or 1 device holding every core (its controller's engine
    and learner threaded over all of them); ``pad_to_multiple``: `train.pad_to_multiple` (None:
    yatt's default); ``algorithm``: grpo, or ppo (a critic; advantages whitened over the batch)."""
    pad = {} if pad_to_multiple is None else {"pad_to_multiple": pad_to_multiple}
    return {
        "model": {"path": str(MODEL), "preset": "small"},
        "data": {"task": "arithmetic", "arithmetic": {"digits": 2, "ops": ["+"]}},
        "algorithm": {"name": algorithm, "kl_coef": KL},
        # micro-batches of at most 1024 padded tokens, rows sorted by length: a chunk of short
        # responses is not padded to the batch's longest (about 4 chunks per rank at 256 tokens)
        "train": {"max_steps": steps, "lr": LR, "batch_size": PROMPTS, "micro_batch_size": 64,
                  "micro_batch_tokens": MICRO_BATCH_TOKENS, "compile": compiled,
                  "balance_ranks": balance, **pad},
        "rollout": {"engine": "vllm", "n": N, "max_new_tokens": tokens, "temperature": 1.0,
                    "compile": compiled, "tensor_parallel_size": tensor_parallel},
        "placement": {"mode": mode, "devices": devices, "device_type": "cpu",
                      "cpus_per_device": 2 // devices, "reference_on_rollout": reference_on_rollout},
        "checkpoint": {"every_steps": 10_000, "export_final": False},
        "eval": {"size": 8},
        "seed": 0,
    }


# ----------------------------------------------------------------------------- cases (children)
def case_yatt(mode: str, tokens: int, steps: int) -> dict:
    import yaml

    # -dynheap: glibc's dynamic malloc thresholds, the A/B of trainer/host_memory.py's steady heap
    env: dict[str, str] | None = None
    if mode.endswith("-dynheap"):
        env = {**os.environ, "YATT_STEADY_HEAP": "0"}
        mode = mode.removesuffix("-dynheap")
    # -gloo: the ranks' gradients averaged over gloo, the A/B of trainer/shm_grads.py
    if mode.endswith("-gloo"):
        env = {**(env or os.environ), "YATT_SHM_GRADS": "0"}
        mode = mode.removesuffix("-gloo")
    # -nativenorm: vLLM's RMSNorms on their native PyTorch path, the A/B of trainer/rollout/vllm_cpu_norms.py
    if mode.endswith("-nativenorm"):
        env = {**(env or os.environ), "YATT_VLLM_CPU_NORMS": "0"}
        mode = mode.removesuffix("-nativenorm")
    # -ppo: PPO (a critic, advantages whitened over the batch) in place of GRPO, with TRL's work
    algorithm = "ppo" if mode.endswith("-ppo") else "grpo"
    mode = mode.removesuffix("-ppo")
    # -tp2: the controllers share one vLLM engine sharded over their devices
    tensor_parallel = 2 if mode.endswith("-tp2") else 1
    mode = mode.removesuffix("-tp2")
    # -wide: one device holding both cores (one controller, its engine and learner on 2 threads)
    devices = 1 if mode.endswith("-wide") else 2
    mode = mode.removesuffix("-wide")
    # -refhome: the training rank runs the whole reference pass (placement.reference_on_rollout: 0)
    reference_on_rollout: float | str = 0 if mode.endswith("-refhome") else "auto"
    mode = mode.removesuffix("-refhome")
    # -exact: each micro-batch at its own longest row (train.pad_to_multiple: 1), the A/B of the
    # shape buckets
    pad_to_multiple = 1 if mode.endswith("-exact") else None
    mode = mode.removesuffix("-exact")
    # the A/B of train.balance_ranks, in the same run: -dealt (groups dealt by tokens at a meeting)
    # and -unbalanced (each rank its own rows) against the default, micro-batches shared by a queue
    balance = "queue"
    for suffix, setting in (("-dealt", "deal"), ("-unbalanced", "off")):
        if mode.endswith(suffix):
            balance, mode = setting, mode.removesuffix(suffix)
    compiled = mode.endswith("-compiled")
    mode = mode.removesuffix("-compiled")

    with tempfile.TemporaryDirectory(prefix="yatt-bench-") as tmp:
        cfg_path = Path(tmp) / "cfg.yaml"
        cfg_path.write_text(yaml.safe_dump(yatt_config(tokens, steps, mode, compiled, balance, tensor_parallel,
                                                       reference_on_rollout, devices, pad_to_multiple,
                                                       algorithm)))
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "backend.cli", "train", str(cfg_path), "--out", str(run_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"yatt train failed: {proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] > 0]
    return {
        "steps": [{"step": r["step"], "time": r["time/step"], "samples": PROMPTS * N,  # dynamic sampling is off
                   "gen_tokens": r["tokens/generated"], "reward": r.get("reward/mean", 0.0),
                   "phases": {k: r.get(f"time/{k}", 0.0) for k in
                              ("rollout", "reward", "reference", "reference_rollout", "train",
                               "weight_sync", "idle", "rank_wait", "grad_sync")},
                   "reference_share": r.get("placement/reference_on_rollout"),
                   "logprob_diff": r.get("rollout/logprob_diff")}
                  for r in rows],
    }


def case_trl(tokens: int, steps: int, vllm: bool, threads: int, bf16: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.config import parse_config
    from trainer.data import load_task
    from trainer.rewards import exact_match

    torch.set_num_threads(threads)
    train, _ = load_task(parse_config(yatt_config(tokens, steps, "colocate")))
    data = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in train[:2000]])

    def reward(prompts, completions, answer, **_kw):
        return exact_match(prompts, completions, answer)

    out = tempfile.mkdtemp(prefix="trl-bench-")
    args = GRPOConfig(
        output_dir=out, max_steps=steps, learning_rate=LR, beta=KL, num_generations=N,
        per_device_train_batch_size=PROMPTS * N, gradient_accumulation_steps=1,
        max_completion_length=tokens, temperature=1.0, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, bf16=bf16, seed=0, disable_tqdm=True,
        dataloader_num_workers=0, use_vllm=vllm,
        **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3} if vllm else {}),
    )
    phases: dict[str, list[float]] = {"rollout": [], "prepare": []}
    steps_out: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            steps_out.append({"step": state.global_step, "time": time.perf_counter() - self.t0})

    trainer = GRPOTrainer(model=str(MODEL), reward_funcs=reward, args=args, train_dataset=data)
    trainer.add_callback(Timer())
    gen, prep = trainer._generate, trainer._generate_and_score_completions

    def timed_gen(*a, **kw):
        t = time.perf_counter()
        try:
            return gen(*a, **kw)
        finally:
            phases["rollout"].append(time.perf_counter() - t)

    def timed_prep(*a, **kw):
        t = time.perf_counter()
        try:
            return prep(*a, **kw)
        finally:
            phases["prepare"].append(time.perf_counter() - t)

    trainer._generate, trainer._generate_and_score_completions = timed_gen, timed_prep
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for i, s in enumerate(steps_out):
        log = logs[i] if i < len(logs) else {}
        roll = phases["rollout"][i] if i < len(phases["rollout"]) else 0.0
        prep_t = phases["prepare"][i] if i < len(phases["prepare"]) else 0.0
        s["samples"] = PROMPTS * N
        s["gen_tokens"] = log.get("completions/mean_length", 0.0) * PROMPTS * N
        s["reward"] = log.get("reward", 0.0)
        s["phases"] = {"rollout": roll, "reward+reference": max(0.0, prep_t - roll),
                       "train": max(0.0, s["time"] - prep_t)}
    return {"steps": steps_out}


def case_limit(tokens: int, compiled: bool = False) -> dict:
    """Each phase alone on all cores, at the step's size: vLLM generation (one engine on every
    core, or an engine per core at once, whichever is faster here), reference, training.

    The reference and training passes are timed at the precision yatt runs them
    (`train.mixed_precision`, resolved for this machine) and, beside it, in plain fp32.
    ``compiled`` (the `limit-compiled` case): the engines with `rollout.compile` and the passes
    through `train.compile`'s compiled blocks, each compiled in an untimed warm-up; the report
    takes each phase's faster time of the two limits (`phase_best`).
    """
    import contextlib

    import torch

    from trainer.config import parse_config
    from trainer.data import load_task
    from trainer.learner import Learner
    from trainer.precision import sampler_dtype

    cores = os.cpu_count() or 2
    # each micro-batch at its own longest row: the limit times one batch again and again, so its
    # shapes repeat without yatt's shape buckets (`train.pad_to_multiple`) and their padding
    cfg = parse_config(yatt_config(tokens, 1, "colocate", compiled, pad_to_multiple=1))
    train, _ = load_task(cfg)
    prompts = [e.prompt for e in train[:PROMPTS]]
    # generation in both layouts, the faster one counting: one engine threaded over every core,
    # and an engine per core at once, each with its share of the prompts (small models often
    # generate faster that way: no thread syncs inside each tiny GEMM)
    per_core = _generation_per_core(tokens, cores, compiled) if cores > 1 and PROMPTS % cores == 0 else None
    gen_s, gen_fastest, samples, _ = _timed_generation(cfg, prompts, cores)
    gen_tokens = sum(len(s.response_ids) for s in samples)
    one_engine = {"seconds": gen_s, "fastest": gen_fastest, "tokens": gen_tokens}
    if per_core is not None and per_core["seconds"] / per_core["tokens"] < gen_s / gen_tokens:
        gen_s, gen_fastest, gen_tokens = per_core["seconds"], per_core["fastest"], per_core["tokens"]
        layout = f"an engine per core ({cores} at once)"
    else:
        layout = f"one engine on {cores} cores"
    torch.set_num_threads(cores)
    learner = Learner(cfg, MODEL)
    ids, attn, index, mask = learner._layout([s.prompt_ids for s in samples],
                                             [s.response_ids or [learner.eos_id] for s in samples])
    assert learner.reference is not None
    # the same micro-batches yatt trains on (rows sorted by length, each cut to its longest)
    chunks = learner._micro_batches(attn.sum(dim=1))
    precisions = {"fp32": contextlib.nullcontext}
    if learner.autocast_dtype is not None:
        precisions["bf16"] = learner.autocast

    def passes(precision) -> tuple[float, float]:
        """One reference pass and one training pass over the step's samples: their seconds."""
        t = time.perf_counter()
        with torch.no_grad(), precision():
            for c in chunks:
                learner._chunk_logprobs(learner.reference, ids, attn, index, mask, c)
        ref = time.perf_counter() - t
        t = time.perf_counter()
        learner.optimizer.zero_grad(set_to_none=True)
        for c in chunks:
            with precision():
                lp, _ = learner._chunk_logprobs(learner.policy, ids, attn, index, mask, c)
            (-(lp * mask[c]).sum() / mask.sum()).backward()
        torch.nn.utils.clip_grad_norm_(learner.policy.parameters(), 1.0)
        learner.optimizer.step()
        return ref, time.perf_counter() - t

    times: dict[str, list[tuple[float, float]]] = {p: [] for p in precisions}
    # untimed: compiles every block variant the step's micro-batches need (`limit-compiled`), and
    # creates the kernels of each batch shape, as a case's first step (left out of its median) does
    for precision in precisions.values():
        passes(precision)
    for _ in range(TIMED):
        for name, precision in precisions.items():
            times[name].append(passes(precision))
    used = "bf16" if learner.autocast_dtype is not None else "fp32"
    # disaggregated on 2 devices: one training device, with its own cores only, trains every sample
    torch.set_num_threads(max(1, int(cfg.placement.cpus_per_device)))
    one_device = statistics.median(sum(passes(precisions[used])) for _ in range(3))
    med = {name: (statistics.median(r for r, _ in ts), statistics.median(t for _, t in ts))
           for name, ts in times.items()}
    return {"generation": gen_s, "reference": med[used][0], "train": med[used][1],
            "fastest": {"generation": gen_fastest, "reference": min(r for r, _ in times[used]),
                        "train": min(t for _, t in times[used])},
            "timed_runs": TIMED, "gen_tokens": gen_tokens, "precision": used,
            "generation_layout": layout, "generation_one_engine": one_engine,
            "generation_per_core": per_core,
            "rollout_dtype": sampler_dtype(cfg, "cpu"),
            "reference_fp32": med["fp32"][0], "train_fp32": med["fp32"][1],
            "train_device_cores": cfg.placement.cpus_per_device, "train_device_passes": one_device}


def _timed_generation(cfg, prompts: list[str], threads: int, ready=None) -> tuple[float, float, list, list]:
    """`TIMED` generations (after a warm-up) of ``prompts`` × N by one vLLM engine: the median
    one's seconds, the fastest one's, the median one's samples (each draw is as long as it
    happens to be; the median draw's tokens go with its time), and the wall-clock window
    (start, end) of the timed ones. ``ready``: called after the warm-up, before the first timed
    generation (the per-core engines' barrier, `_shard_barrier`)."""
    from trainer.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(MODEL, cfg, threads=threads)
    try:
        engine.generate(prompts, N)  # warm-up
        if ready is not None:
            ready()
        runs = []
        start = time.time()
        for _ in range(TIMED):
            t = time.perf_counter()
            out = engine.generate(prompts, N)
            runs.append((time.perf_counter() - t, out))
        window = [start, time.time()]
    finally:
        engine.close()
    runs.sort(key=lambda r: r[0])
    return runs[len(runs) // 2][0], runs[0][0], runs[len(runs) // 2][1], window


def _shard_barrier(folder: Path, shard: int, shards: int, timeout: float = 300.0) -> None:
    """Wait until every per-core engine has started and warmed up (a file each in ``folder``), so
    that their timed generations run at once, as colocated controllers' do. Without it the
    engines' start-up (seconds each, uneven) decided how much of their timing overlapped: none
    on the short workload in the run that found it (2026-12-07), so each engine had been timed
    with the other core idle. ``timeout`` bounds the wait when another shard died starting (a
    compiled engine starts in 20-36 s here the first time, 6 s from its saved model)."""
    (folder / f"ready-{shard}").touch()
    deadline = time.time() + timeout
    while sum(1 for _ in folder.glob("ready-*")) < shards:
        if time.time() > deadline:
            raise TimeoutError(f"the other per-core engines were not ready in {timeout:.0f} s")
        time.sleep(0.005)


def case_gen_shard(tokens: int, shard: int, shards: int, compiled: bool = False,
                   barrier: Path | None = None) -> dict:
    """One core's engine of the per-core layout: its share of the step's prompts, 1 thread; with
    ``barrier``, its timed generations start when every shard's engine is ready."""
    import torch

    from trainer.config import parse_config
    from trainer.data import load_task

    torch.set_num_threads(1)
    cfg = parse_config(yatt_config(tokens, 1, "colocate", compiled))
    train, _ = load_task(cfg)
    share = PROMPTS // shards
    ready = (lambda: _shard_barrier(barrier, shard, shards)) if barrier is not None else None
    seconds, fastest, samples, window = _timed_generation(
        cfg, [e.prompt for e in train[shard * share:(shard + 1) * share]], 1, ready)
    return {"seconds": seconds, "fastest": fastest, "tokens": sum(len(s.response_ids) for s in samples),
            "window": window}


def _generation_per_core(tokens: int, cores: int, compiled: bool = False) -> dict | None:
    """An engine per core at once (as colocated controllers run them): the slowest one's median
    (and fastest) time, and all their tokens; None if a shard failed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory(prefix="gen-shard-") as tmp:
        outs = [Path(tmp) / f"{i}.json" for i in range(cores)]
        procs = [subprocess.Popen(["taskset", "-c", str(i), sys.executable, __file__, "--child",
                                   f"gen-shard-{i}-{cores}" + ("-compiled" if compiled else ""),
                                   "--tokens", str(tokens), "--json", str(outs[i]), "--barrier", tmp],
                                  env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for i in range(cores)]
        if any(p.wait(timeout=900) != 0 for p in procs):
            return None
        shards = [json.loads(o.read_text()) for o in outs]
    return {"seconds": max(r["seconds"] for r in shards), "fastest": max(r["fastest"] for r in shards),
            "tokens": sum(r["tokens"] for r in shards), "overlap": overlap([r["window"] for r in shards])}


def overlap(windows: list[list[float]]) -> float:
    """The share of the longest of these (start, end) windows during which all of them ran."""
    common = min(e for _, e in windows) - max(s for s, _ in windows)
    return max(0.0, common) / max(max(e - s for s, e in windows), 1e-9)


def run_child(case: str, tokens: int, steps: int, out: Path, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, __file__, "--child", case, "--tokens", str(tokens), "--steps", str(steps),
           "--json", str(out)]
    speed0 = core_speed()
    t0, cpu0 = time.time(), psutil.cpu_times()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    if proc.returncode != 0 or not out.exists():
        tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-1:]
        return {"error": (tail[0] if tail else f"exit {proc.returncode}")[:300]}
    data = json.loads(out.read_text())
    data["wall_s"] = time.time() - t0
    data["stolen"] = stolen(cpu0, psutil.cpu_times())
    data["core_gflops"] = [speed0, core_speed()]
    out.write_text(json.dumps(data))  # what the parent measured, for a re-render (`--report-from`)
    return data


def core_speed(rounds: int = 50) -> float:
    """One core's fp32 matmul speed now, in GFLOP/s: a 512 × 384 by 384 × 1536 product (the
    `small` policy's MLP shape), the median of ``rounds`` (about 0.6 s on a Zen 3 core). A virtual
    core can be slow for reasons the guest does not see as steal (another tenant on its SMT
    sibling, the host's clocks), and a case timed then reads slow; this probe, taken right before
    and after each case, shows it. It is a snapshot: on the Zen 3 EPYC (2026-12-07) ten probes in
    a row read 62–78 GFLOP/s with no steal."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 384), torch.randn(384, 1536)
        for _ in range(3):
            a @ b
        times = []
        for _ in range(rounds):
            t = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return 2 * 512 * 384 * 1536 / statistics.median(times) / 1e9


def stolen(before, after) -> float | None:
    """The share of the machine's CPU time between two `psutil.cpu_times()` that its hypervisor
    gave to others (steal): a virtual machine's cores are shared, and a case that ran while the
    host took them reads slow for reasons of its own. None where the kernel reports no steal."""
    if not hasattr(after, "steal"):
        return None
    total = sum(after) - sum(before)
    return (after.steal - before.steal) / total if total > 0 else None


# ----------------------------------------------------------------------------- report (parent)
def _waits(phases: dict[str, float]) -> str:
    """The part of the training phase spent waiting for the other ranks (each the largest over the
    ranks, as every `time/` metric): at the step's first meeting, for the last rank's rollout
    (`time/rank_wait`), and in the gradient average, for the slowest backward plus the reduce
    itself (`time/grad_sync`)."""
    rank, grad = phases.get("rank_wait", 0.0), phases.get("grad_sync", 0.0)
    if rank < 0.005 and grad < 0.005:
        return ""
    return f" (of it waiting for the other ranks: their rollout {rank:.2f}, the gradient average {grad:.2f})"


def _host(s: dict) -> str:
    """The host's column: the steal share while the case ran, and the core speed probes around
    each of its runs (— for results saved before either was taken)."""
    taken = "—" if s.get("stolen") is None else f"{100 * s['stolen']:.1f}%"
    speeds = s.get("core_gflops") or []
    pairs = "; ".join(f"{a:.0f}, {b:.0f}" for a, b in zip(speeds[::2], speeds[1::2], strict=True))
    return f"{taken}; {pairs or '—'}"


def summarize(runs: list[dict]) -> dict | None:
    """One case's figures over its runs (``--repeat``): the timed steps of every run pooled, each
    run's first step left out (it pays for warm-up); the first run's first step and rewards."""
    runs = [r for r in runs if r.get("steps")]
    if not runs:
        return None
    timed = [s for r in runs for s in (r["steps"][1:] or r["steps"])]
    med = statistics.median(s["time"] for s in timed)
    total_t = sum(s["time"] for s in timed)
    phases = {k: statistics.median(s["phases"].get(k, 0.0) for s in timed) for k in timed[0]["phases"]}
    shares = [s["reference_share"] for s in timed if s.get("reference_share") is not None]
    return {"median_step": med, "first_step": runs[0]["steps"][0]["time"],
            "reference_share": statistics.median(shares) if shares else None,
            "samples_s": sum(s["samples"] for s in timed) / total_t,
            "gen_tok_s": sum(s["gen_tokens"] for s in timed) / total_t, "phases": phases,
            "tokens_step": sum(s["gen_tokens"] for s in timed) / len(timed),
            "rewards": [s["reward"] for s in runs[0]["steps"]], "runs": len(runs),
            "stolen": max((r["stolen"] for r in runs if r.get("stolen") is not None), default=None),
            "core_gflops": [g for r in runs for g in r.get("core_gflops", [])]}


def limit_at(lim: dict, tokens: float) -> tuple[float, float]:
    """The limit's sum and max at a case's own work: its reference and training passes scaled to
    ``tokens`` generated (and trained) a step, its generation as measured.

    The limit draws its own samples once, and a random-init policy's lengths vary from draw to
    draw (5,229 tokens for the limit against 5,300-6,600 a step for the yatt cases in one run),
    while a pass costs about 6 x parameters x tokens. Generation is not scaled: it lasts as many
    decode steps as the longest response (usually the cap), each about as long for fewer rows.
    """
    passes = (lim["reference"] + lim["train"]) * work_scale(lim, tokens)
    return lim["generation"] + passes, max(lim["generation"], passes)


def work_scale(lim: dict, tokens: float) -> float:
    """A case's tokens a step over the limit's own draw: what its passes are scaled by."""
    return tokens / lim["gen_tokens"] if lim.get("gen_tokens") else 1.0


def best_limit(runs: list[dict]) -> dict:
    """The limit over its runs (``--repeat``): the run whose phases sum to the least."""
    ok = [r for r in runs if "generation" in r]
    if not ok:
        return runs[0] if runs else {}
    return min(ok, key=lambda r: r["generation"] + r["reference"] + r["train"])


def phase_best(eager: dict, compiled: dict) -> dict:
    """The limit at its best: each phase's faster time of the eager limit and the compiled one
    (`rollout.compile`, `train.compile`), on the eager limit's draw of samples (the compiled
    limit's passes scaled to it by tokens, as `limit_at` scales them to a case's work).

    ``from`` names where each phase came from. A compiled engine has generated faster on one core
    than the eager engines on two (1.74 s against the limit's 2.21 s, AMX Xeon, 2026-12-05), so a
    limit without it bounds nothing that compiles.
    """
    if "generation" not in compiled:
        return {**eager, "from": {k: "eager" for k in ("generation", "reference", "train")}} if eager else eager
    if "generation" not in eager:
        return {**compiled, "from": {k: "compiled" for k in ("generation", "reference", "train")}}
    scale = eager["gen_tokens"] / compiled["gen_tokens"]
    best, source = dict(eager), {}
    fastest = dict(eager.get("fastest", {}))
    if compiled["generation"] < eager["generation"]:
        best.update({k: compiled[k] for k in ("generation", "generation_layout", "generation_one_engine",
                                              "generation_per_core")})
        source["generation"] = "compiled"
        if "generation" in compiled.get("fastest", {}):
            fastest["generation"] = compiled["fastest"]["generation"]
    else:
        source["generation"] = "eager"
    for k in ("reference", "train", "train_device_passes"):
        if k in compiled and compiled[k] * scale < eager.get(k, float("inf")):
            best[k], source[k] = compiled[k] * scale, "compiled"
            if k in compiled.get("fastest", {}):
                fastest[k] = compiled["fastest"][k] * scale
        else:
            source[k] = "eager"
    best["from"], best["fastest"] = source, fastest
    return best


def _layouts(lim: dict) -> str:
    """Which generation layout the limit took, and the other one's rate beside it."""
    one, per = lim.get("generation_one_engine"), lim.get("generation_per_core")
    if not one or not per:
        return ""
    rate = {"one engine": one["tokens"] / one["seconds"], "an engine per core": per["tokens"] / per["seconds"]}
    # saved results from before the barrier (`_shard_barrier`) have no overlap: their engines'
    # timed runs overlapped by chance, if at all
    at_once = (f" (their timed runs {per['overlap']:.0%} at once)" if "overlap" in per
               else " (not synchronized: they may not have run at once)")
    return (f", {lim['generation_layout']}; " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in rate.items())
            + at_once)


def plot(curves: dict[str, list[float]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_section(text: str) -> None:
    docs_section.write_section(SECTION, text.rstrip() + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--barrier", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per case (default 20 on a short workload, 6 on a generation-heavy one)")
    ap.add_argument("--workloads", default="32,256", help="new tokens per sample, comma-separated")
    ap.add_argument("--cases", default="yatt-colocate,yatt-colocate-dealt,yatt-colocate-unbalanced,yatt-colocate-compiled,"
                    "yatt-disaggregated,yatt-disaggregated-compiled,trl,"
                    "trl-1t,trl-bf16,trl-vllm,limit,limit-compiled")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per case")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every case, in alternating order; a case's timed steps are pooled "
                         "over its runs and the limit is its best run")
    ap.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    ap.add_argument("--report-from", type=Path, help="re-render the report from a run's JSON folder")
    ap.add_argument("--note", default="", help="a paragraph added to the report (how it was run)")
    a = ap.parse_args()
    if a.child:
        kind = a.child
        if kind.startswith("yatt-"):
            res = case_yatt(kind.removeprefix("yatt-"), a.tokens, a.steps)
        elif kind.startswith("trl"):
            # trl: torch's default threads (all cores); trl-1t: one thread, which on a loaded
            # machine avoids OpenMP threads spin-waiting on each other (the faster one counts)
            threads = 1 if kind == "trl-1t" else (os.cpu_count() or 2)
            res = case_trl(a.tokens, a.steps, vllm=kind == "trl-vllm", threads=threads,
                           bf16=kind == "trl-bf16")
        else:  # the limit's processes hold their heap as yatt's do (trainer/host_memory.py)
            steady_heap()
            compiled = kind.endswith("-compiled")
            kind = kind.removesuffix("-compiled")
            if kind.startswith("gen-shard-"):
                shard, shards = (int(x) for x in kind.removeprefix("gen-shard-").split("-"))
                res = case_gen_shard(a.tokens, shard, shards, compiled, a.barrier)
            else:
                res = case_limit(a.tokens, compiled)
        a.json.write_text(json.dumps(res))
        return

    if not MODEL.exists():
        from trainer.config import parse_config
        from trainer.models import ensure_model

        ensure_model(parse_config(yatt_config(32, 1, "colocate")))
    cases = a.cases.split(",")
    load = os.getloadavg()
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {os.cpu_count()} cores, "
             f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the start "
             "(shared machine: compare within one run only).", "",
             "Command: `PYTHONPATH=. .venv/bin/python bench/trainer_vs_trl.py`", ""]
    if a.report_from:
        lines[0] = (f"Re-rendered {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} from saved case results "
                    "(`--report-from`); when and how the cases ran is in the note below.")
    if a.note:
        lines += [a.note, ""]
    ratio = None
    native_bf16 = cpu_native_bf16()
    tmp = a.report_from or Path(tempfile.mkdtemp(prefix="vs-trl-"))
    print(f"case results in {tmp}", flush=True)
    for tokens in [int(t) for t in a.workloads.split(",")]:
        # the issue's own runs: 20 steps short, 6 generation-heavy. Medians skip the first step; a
        # compiled case's one recompile (the first new length, usually step 2) and the oneDNN
        # kernels created for each new batch shape in the next few steps still weigh on a median
        # of 5 (short, AVX2-only EPYC, 2026-12-03: yatt-colocate 3.46 s over steps 2-6 of 6,
        # 2.50 s over steps 2-16 of 16, while TRL's moved from 2.88 to 3.25 s)
        steps = a.steps or (20 if tokens <= 64 else 6)
        name = "short" if tokens <= 64 else "generation-heavy"
        print(f"== {name}: {PROMPTS} prompts x {N} samples x {tokens} new tokens, {steps} steps", flush=True)
        runs: dict[str, list[dict]] = {case: [] for case in cases}
        for r in range(a.repeat):
            # runs in alternating order (ABC, CBA, ...): no case always goes first or last
            for case in cases if r % 2 == 0 else cases[::-1]:
                out = tmp / (f"{case}-{tokens}.json" if r == 0 else f"{case}-{tokens}-r{r}.json")
                if a.report_from:
                    if r > 0 and not out.exists():
                        continue
                    res = json.loads(out.read_text()) if out.exists() else {"error": "not run"}
                elif case == "trl-bf16" and not native_bf16:
                    # emulated bf16 is many times slower than fp32 (36.7 s/step against TRL fp32's
                    # 2.9 s on the short workload of an AVX2-only EPYC, 2026-12-01): not a setting anyone would pick
                    res = {"error": "skipped: this CPU has no native bf16 (no AVX512-BF16 or AMX), TRL's bf16 would be emulated"}
                    out.write_text(json.dumps(res))
                else:
                    res = run_child(case, tokens, steps, out, a.timeout)
                    if "error" in res:  # keep the failure for a re-rendered report
                        out.write_text(json.dumps(res))
                runs[case].append(res)
                print(f"   {case}{f' (run {r + 1})' if a.repeat > 1 else ''}: "
                      f"{'error: ' + res['error'] if 'error' in res else 'done'} "
                      f"({res.get('wall_s', 0):.0f}s)", flush=True)
        results = {case: [r for r in rs if "error" not in r] or rs[:1] for case, rs in runs.items()}
        per_case = f"{steps} steps per case" + (f", each case run {a.repeat} times in alternating order (steps "
                                                 "pooled; the limit's best run)" if a.repeat > 1 else "")
        rows = [f"### {name}: {PROMPTS} prompts × {N} samples × {tokens} new tokens, {per_case}", "",
                "| case | median step | samples/s | generated tok/s | tokens a step | phase split (median s) | first step "
                "| the host: CPU it took; one core's GFLOP/s before, after |",
                "|---|---:|---:|---:|---:|---|---:|---:|"]
        sums: dict[str, dict] = {}
        for case, case_runs in results.items():
            if case.startswith("limit"):
                continue
            s = summarize(case_runs)
            if s is None:
                err = case_runs[0].get("error", "no steps") if case_runs else "not run"
                rows.append(f"| {case} | — | — | — | — | did not run: {err} | — | — |")
                continue
            sums[case] = s
            split = ", ".join(f"{k.replace('_rollout', ' on the rollout worker')} {v:.2f}"
                              + (_waits(s["phases"]) if k == "train" else "")
                              for k, v in s["phases"].items()
                              if v > 0.005 and k not in ("rank_wait", "grad_sync"))
            if s.get("reference_share"):
                split += f" (its share of the samples {s['reference_share']:.2f})"
            rows.append(f"| {case} | {s['median_step']:.2f} s | {s['samples_s']:.2f} | {s['gen_tok_s']:.0f} | "
                        f"{s['tokens_step']:,.0f} | {split} | {s['first_step']:.1f} s | {_host(s)} |")
        limits = {"eager": best_limit(results.get("limit", [])),
                  "compiled": best_limit(results.get("limit-compiled", []))}
        lim = phase_best(limits["eager"], limits["compiled"])
        if "generation" in lim:
            ssum = lim["generation"] + lim["reference"] + lim["train"]
            smax = max(lim["generation"], lim["reference"] + lim["train"])
            rows.append("")
            for kind, one in limits.items():
                if "generation" not in one:
                    if one:
                        rows.append(f"Limit, {kind}: did not run: {one.get('error')}")
                    continue
                precision = one.get("precision", "fp32")
                fp32_note = (f" (in fp32: reference {one['reference_fp32']:.2f} s, training pass "
                             f"{one['train_fp32']:.2f} s)" if precision != "fp32" and "train_fp32" in one else "")
                how = ("`rollout.compile` and `train.compile`, compiled before timing" if kind == "compiled"
                       else "no compilation, yatt's defaults")
                timed = (f"; the median of {one['timed_runs']} timed runs of each phase, the fastest "
                         + ", ".join(f"{one['fastest'][k]:.2f}" for k in ("generation", "reference", "train"))
                         + " s" if "fastest" in one else "; the faster of 2 timed runs of each phase")
                rows += [f"Limit, {kind} ({how}; each phase alone on all cores, at yatt's precision: generation in "
                         f"{one.get('rollout_dtype', 'float32')}, reference and training pass in {precision}"
                         f"{timed}): generation {one['generation']:.2f} s "
                         f"({one['gen_tokens'] / one['generation']:.0f} tok/s for {one['gen_tokens']:,} tokens"
                         f"{_layouts(one)}), reference {one['reference']:.2f} s, "
                         f"training pass {one['train']:.2f} s{fp32_note}"
                         + (f"; the host: {_host(one)}" if "core_gflops" in one else "") + ".", ""]
            picked = ", ".join(f"{k} {lim['from'][k]}" for k in ("generation", "reference", "train"))
            rows.append(f"**The limit, each phase at its best** ({picked}): generation {lim['generation']:.2f} s, "
                        f"reference {lim['reference']:.2f} s, training pass {lim['train']:.2f} s at "
                        f"{lim['gen_tokens']:,} tokens; sum {ssum:.2f} s, max {smax:.2f} s.")
            rows.append("")
            rows.append("Each case is judged at its own work too (tokens a step in the table): the limit's "
                        "reference and training passes scaled to it, its generation as measured (`limit_at`); "
                        "beside it, the case against the limit measured with its own compile setting.")
            for case in (c for c in sums if c.startswith("yatt-disaggregated")):
                if "train_device_passes" not in lim:
                    break
                # the all-core max assumes the training phase gets every core; this split gives it one
                dis = sums[case]
                own = lim["train_device_passes"] * work_scale(lim, dis["tokens_step"])
                rows.append(f"- {case} splits the {os.cpu_count()} cores into a rollout device "
                            f"and a training device of {lim['train_device_cores']:g} core(s): reference + "
                            f"training pass on that device alone take {lim['train_device_passes']:.2f} s "
                            f"({own:.2f} s at the case's {dis['tokens_step']:,.0f} tokens), "
                            f"so its step ({dis['median_step']:.2f} s) is "
                            f"{dis['median_step'] / own:.2f}× that"
                            + (f" (the rollout worker ran {dis['reference_share']:.2f} of the reference pass)"
                               if dis.get("reference_share") else "")
                            + "; the all-core max below cannot be reached with this split.")
            for case in sums:
                if not case.startswith(("yatt-colocate", "yatt-disaggregated")):
                    continue
                colocated = case.startswith("yatt-colocate")
                bound, what = (ssum, "sum") if colocated else (smax, "max")
                at_sum, at_max = limit_at(lim, sums[case]["tokens_step"])
                own = at_sum if colocated else at_max
                step = sums[case]["median_step"]
                setting = "compiled" if "-compiled" in case else "eager"
                alike = ""
                if "generation" in limits[setting]:
                    at = limit_at(limits[setting], sums[case]["tokens_step"])[0 if colocated else 1]
                    alike = f"; {step / at:.2f}× the {setting} limit's {what} at its work"
                fast = lim.get("fastest", {})
                if all(k in fast for k in ("generation", "reference", "train")):
                    quick = limit_at({**lim, **fast}, sums[case]["tokens_step"])[0 if colocated else 1]
                    alike += f"; {step / quick:.2f}× the limit's fastest runs at its work"
                rows.append(f"- {case}: median step {step:.2f} s = {step / bound:.2f}× the limit "
                            f"({what} {bound:.2f} s), {step / own:.2f}× it at the case's own work "
                            f"({own:.2f} s){alike}; goal ≤ 1.15× at the same work: "
                            + ("no verdict: the step beat the 'limit', which is then no bound"
                               if step < own else "met" if step <= 1.15 * own else "NOT met"))
        elif lim:
            rows += ["", f"Limit: did not run: {lim.get('error')}"]
        yatt = [c for c in sums if c.startswith("yatt")]
        trl = [c for c in sums if c.startswith("trl")]
        if yatt and trl:
            best = max(yatt, key=lambda c: sums[c]["samples_s"])
            fastest = max(trl, key=lambda c: sums[c]["samples_s"])
            r = sums[best]["samples_s"] / sums[fastest]["samples_s"]
            goal = 2.0 if tokens > 64 else 1.0
            verdict = "met" if r >= goal else f"NOT met: {goal / r:.2f}× short"
            tok_r = sums[best]["gen_tok_s"] / sums[fastest]["gen_tok_s"]
            rows += ["", f"yatt best ({best}) / fastest TRL setting that ran ({fastest}) (samples/s): "
                     f"**{r:.2f}×** (goal ≥ {goal:.1f}×: {verdict})",
                     f"- in generated tokens/s the same two are {tok_r:.2f}× ({sums[best]['tokens_step']:,.0f} "
                     f"against {sums[fastest]['tokens_step']:,.0f} tokens a step)"]
            if "generation" in lim:
                # what the goal needs of this machine: a colocated step exactly at the limit's sum,
                # doing the TRL case's work
                ceiling = sums[fastest]["median_step"] / limit_at(lim, sums[fastest]["tokens_step"])[0]
                rows.append(f"- ceiling on this machine: a colocated yatt step exactly at the limit's sum "
                            f"would be {ceiling:.2f}× {fastest}; "
                            + ("the goal is within the limit's reach" if ceiling >= goal else
                               f"the goal needs phases {goal / ceiling:.2f}× faster than the limit measures "
                               "here, not a smaller gap to it"))
            if tokens > 64:
                ratio = r
        png = ROOT / "docs" / f"trainer_vs_trl_{tokens}.png"
        curves = {c: s["rewards"] for c, s in sums.items()}
        if curves and not a.no_docs:  # the PNGs belong to the docs section
            plot(curves, f"reward, {tokens} new tokens", png)
            rows += ["", f"![reward curves, {tokens} new tokens]({png.name})"]
        rows.append("")
        text = "\n".join(rows)
        print(text, flush=True)
        lines.append(text)
        if not a.no_docs:  # after each workload, so a cut-short run still leaves its figures
            write_section("## yatt vs TRL GRPOTrainer (issue 8)\n\n" + "\n".join(lines))
    end_load = os.getloadavg()
    if not a.report_from:  # a re-render's load says nothing about the run (its note does)
        lines.append(f"Load average at the end: {end_load[0]:.1f} / {end_load[1]:.1f} / {end_load[2]:.1f}.")
        if not a.no_docs:
            write_section("## yatt vs TRL GRPOTrainer (issue 8)\n\n" + "\n".join(lines))
        print(f"load average at the end: {end_load[0]:.1f}")
    print(f"ratio: {ratio:.2f}" if ratio is not None else "ratio: n/a")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
