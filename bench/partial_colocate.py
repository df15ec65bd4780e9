"""partial_colocate against colocate on the same work, with the same model reward: rollout plus
scoring per step, measured side by side in one command, and the cost model's prediction of both.

    PYTHONPATH=$PWD .venv/bin/python bench/partial_colocate.py

Builds the reward preset once (`.yatt/models/arith-reward`, `yatt make-tiny-model --preset
reward`) and the micro policy, then trains the same config (2 devices, vLLM rollouts, 16 prompts
× 8 samples of up to 128 tokens, `reward.kind: model`, no warm start and no dynamic sampling: the
same work in both modes, and the random policy's end-of-sequence at 1/258 a token spreads the
lengths: about 60% run to the cap, the rest end anywhere before it) once with `placement.mode=colocate` and once with `=partial_colocate` (1 scoring device),
one after the other, each in its own `yatt train` process. Per mode it prints the mean over the
steps after the first two (warm-up) of `time/rollout_scored` (generation start to the last score
in: rollout + reward in colocate, where scoring follows generation), `time/rollout`,
`time/reward`, the share of scoring done while generation still ran, and the step time; then the
cost model fitted to the colocate run's steps predicts rollout + scoring for both modes. It
writes the `partial_colocate` section of docs/benchmarks.md. Timings on the shared 2-core machine
are noisy: the load average is printed; compare the two modes as a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from docs_section import write_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parent.parent
MODES = ("colocate", "partial_colocate")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ensure_reward_model(path: Path, budget_s: float) -> dict:
    if not path.exists():
        subprocess.run([sys.executable, "-m", "backend.cli", "make-tiny-model", str(path),
                        "--preset", "reward", "--time-budget-s", str(budget_s)], cwd=ROOT, check=True)
    return json.loads((path / "reward_model.json").read_text())


def run_mode(mode: str, out: Path, sets: list[str]) -> dict:
    run_dir = out / mode
    cmd = [sys.executable, "-m", "backend.cli", "train", "configs/demo-arithmetic.yaml",
           "--out", str(run_dir), "--set", f"placement.mode={mode}",
           *[a for s in sets for a in ("--set", s)]]
    load_start = os.getloadavg()[0]
    t0 = time.time()
    with (out / f"{mode}.log").open("w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{mode} run failed (rc={rc}); see {out / f'{mode}.log'}")
    return {"wall_s": time.time() - t0, "load_start": load_start, "load_end": os.getloadavg()[0],
            "rows": [r for r in _rows(run_dir / "metrics.jsonl") if r.get("step", 0) > 2
                     and "time/step" in r]}


def main() -> None:
    from trainer.config import parse_config
    from trainer.placement.cost_model import (
        Layout,
        LengthDist,
        Workload,
        fit,
        observations_from_metrics,
        phase_times,
    )
    from trainer.placement.memory import ModelShape

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".yatt/partial-colocate")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reward-model", default=".yatt/models/arith-reward")
    ap.add_argument("--reward-budget-s", type=float, default=120.0)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--write-docs", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rm_path = (ROOT / args.reward_model).resolve()
    rm = _ensure_reward_model(rm_path, args.reward_budget_s)
    sets = [f"train.max_steps={args.steps}", "algorithm.warm_start.steps=0",
            "algorithm.warm_start.target_accuracy=null",
            "rollout.max_new_tokens=128", "sampling.dynamic=false", "reward.kind=model", f"reward.model_path={rm_path}",
            "placement.reward_devices=1", "checkpoint.every_steps=1000", "eval.size=16", *args.sets]
    runs = {}
    for mode in MODES:
        for old in (out / mode).glob("*"):
            if old.is_file():
                old.unlink()
        runs[mode] = run_mode(mode, out, sets)
        print(f"{mode}: {len(runs[mode]['rows'])} steps measured, {runs[mode]['wall_s']:.0f}s, "
              f"load {runs[mode]['load_start']:.1f} → {runs[mode]['load_end']:.1f}", flush=True)

    def mean(mode: str, key: str) -> float:
        vals = [r.get(key, 0.0) for r in runs[mode]["rows"]]
        return statistics.mean(vals) if vals else float("nan")

    cfg = parse_config(json.loads((out / "colocate" / "config.json").read_text()))
    shape = ModelShape.from_config(json.loads((Path(cfg.model.path) / "config.json").read_text()))
    colo_rows = runs["colocate"]["rows"]
    obs = observations_from_metrics(colo_rows, Layout("colocate", 2), param_bytes=shape.params * 4.0,
                                    skip_first=0)
    params = fit(obs).params
    samples = statistics.mean(o.samples for o in obs)
    w = Workload(prompts=cfg.train.batch_size, n=cfg.rollout.n,
                 response=LengthDist.from_mean_max(mean("colocate", "response/length_mean"),
                                                   mean("colocate", "response/length_max"), samples,
                                                   cap=cfg.rollout.max_new_tokens),
                 prompt_tokens=statistics.mean(max(0.0, o.get("tokens/trained") / o.samples
                                                   - o.get("response/length_mean")) for o in obs),
                 param_bytes=shape.params * 4.0, reference=cfg.algorithm.kl_coef > 0)

    predicted = {}
    for mode in MODES:
        pt = phase_times(params, w, Layout(mode, 2, reward_devices=1))
        predicted[mode] = pt.rollout + pt.reward
    measured = {m: mean(m, "time/rollout_scored") for m in MODES}
    lines = [f"reward model: {rm_path.name} ({rm['held_out_agreement']:.1%} held-out agreement); "
             f"policy {Path(cfg.model.path).name}, {cfg.train.batch_size} prompts × {cfg.rollout.n} "
             f"samples ≤ {cfg.rollout.max_new_tokens} tokens per step, 2 devices, steps 3–{args.steps}",
             "load average (1 min): " + "; ".join(
                 f"{m} {runs[m]['load_start']:.1f} → {runs[m]['load_end']:.1f}" for m in MODES), "",
             "| mode | rollout + scoring s | rollout s | reward s (scorer busy) | scored during generation | step s | cost model: rollout + scoring s |",
             "|---|---|---|---|---|---|---|"]
    for m in MODES:
        overlap = mean(m, "placement/scoring_overlap_frac") if m == "partial_colocate" else 0.0
        lines.append(f"| {m} | {measured[m]:.3f} | {mean(m, 'time/rollout'):.3f} | "
                     f"{mean(m, 'time/reward'):.3f} | {overlap:.0%} | {mean(m, 'time/step'):.3f} | "
                     f"{predicted[m]:.3f} |")
    ratio = measured["partial_colocate"] / measured["colocate"]
    lines += ["", f"partial_colocate / colocate, rollout + scoring: measured {ratio:.2f}×, "
              f"cost model {predicted['partial_colocate'] / predicted['colocate']:.2f}× "
              f"(fitted on the colocate run's steps: reward {params.reward_sample_s * 1e3:.2f} ms/sample, "
              f"generation {params.gen_fixed_s:.3f} s + {params.gen_step_s * 1e3:.2f} ms/decode step "
              f"+ {params.gen_token_s * 1e3:.3f} ms/token)"]
    text = "\n".join(lines)
    print(text)
    (out / "partial_colocate.json").write_text(json.dumps(
        {"measured": measured, "predicted": predicted, "ratio": ratio,
         "load": {m: [runs[m]["load_start"], runs[m]["load_end"]] for m in MODES}}, indent=2))
    if args.write_docs:
        write_section("partial_colocate",
                      "## partial_colocate against colocate (same work, same model reward)\n\n"
                      "Command: `PYTHONPATH=$PWD .venv/bin/python bench/partial_colocate.py`\n\n"
                      + text + "\n")


if __name__ == "__main__":
    main()
