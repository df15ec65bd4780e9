"""Cost model and memory estimate against measured runs at 2 devices.

    PYTHONPATH=$PWD .venv/bin/python bench/placement_runs.py --out .yatt/placement-runs
    PYTHONPATH=$PWD .venv/bin/python bench/placement_calibration.py --runs .yatt/placement-runs

The first command trains `configs/demo-arithmetic.yaml` once per placement mode (colocate, then
disaggregated, one at a time) and records the peak RSS of every Ray actor; this one reads each
run's metrics.jsonl, fits one set of cost-model parameters to all their steps, and prints per
mode the measured mean step time against (a) the analytic model on each step's own lengths and
(b) the discrete-event simulator on the runs' length distribution; then the memory estimate of
each kind of device against its measured peak RSS. It writes the `placement` section of
docs/benchmarks.md. Timings on this shared 2-core machine are noisy: the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from docs_section import write_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parent.parent


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    from trainer.config import parse_config
    from trainer.placement.cost_model import (
        Layout,
        LengthDist,
        Workload,
        fit,
        observations_from_metrics,
    )
    from trainer.placement.memory import GiB, ModelShape, estimate_memory
    from trainer.placement.simulator import simulate

    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default=".yatt/placement-runs")
    ap.add_argument("--modes", default="colocate,disaggregated")
    ap.add_argument("--write-docs", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    runs = Path(args.runs)
    load = os.getloadavg()
    obs_by_mode, cfgs, rss, run_info = {}, {}, {}, {}
    for mode in args.modes.split(","):
        d = runs / mode
        cfg = parse_config(json.loads((d / "config.json").read_text()))
        shape = ModelShape.from_config(json.loads((Path(cfg.model.path) / "config.json").read_text()))
        layout = Layout(mode, cfg.placement.devices, rollout_devices=cfg.placement.rollout_devices,
                        staleness=cfg.placement.staleness)
        param_bytes = shape.params * 4.0
        obs_by_mode[mode] = observations_from_metrics(_rows(d / "metrics.jsonl"), layout,
                                                      param_bytes=param_bytes)
        cfgs[mode] = (cfg, shape, layout)
        if (d / "rss.json").exists():
            run_info[mode] = json.loads((d / "rss.json").read_text())
            rss[mode] = run_info[mode]["processes"]
    all_obs = [o for obs in obs_by_mode.values() for o in obs]
    result = fit(all_obs)
    run_loads = "; ".join(f"{m} run {r['load_start'][0]:.1f} at start, {r['load_end'][0]:.1f} at end"
                          for m, r in run_info.items() if "load_start" in r)
    lines = [f"load average (1 min): {run_loads or 'not recorded by the runs'}; "
             f"{load[0]:.1f} while analysing", "",
             f"fitted on {result.observations} steps; mean |error| per step, relative to the mean, {result.step_error:.1%}; "
             + ", ".join(f"{k} {v:.0%}" for k, v in result.phase_error.items()), "",
             "| mode (2 devices) | measured step s | analytic model s | error | simulator s | error |",
             "|---|---|---|---|---|---|"]
    table = {}
    for mode, obs in obs_by_mode.items():
        cfg, _shape, layout = cfgs[mode]
        by = result.by_mode[mode]
        mean = statistics.mean(o.get("response/length_mean") for o in obs)
        longest = statistics.mean(o.get("response/length_max") for o in obs)
        samples = statistics.mean(o.samples for o in obs)
        prompt = statistics.mean(max(0.0, o.get("tokens/trained") / o.samples - o.get("response/length_mean"))
                                 for o in obs)
        w = Workload(prompts=cfg.train.batch_size, n=cfg.rollout.n,
                     response=LengthDist.from_mean_max(mean, longest, samples, cap=cfg.rollout.max_new_tokens),
                     prompt_tokens=prompt, param_bytes=obs[0].param_bytes,
                     reference=cfg.algorithm.kl_coef > 0 or any(o.get("time/reference") > 0 for o in obs))
        sim = simulate(result.params, w, layout, steps=40, seed=0)
        err_sim = (sim.step_s - by["measured_s"]) / by["measured_s"]
        table[mode] = {**by, "simulated_s": sim.step_s, "simulated_error": err_sim,
                       "simulated_idle": sim.idle_frac}
        lines.append(f"| {mode} | {by['measured_s']:.3f} | {by['predicted_s']:.3f} | {by['error']:+.1%} | "
                     f"{sim.step_s:.3f} | {err_sim:+.1%} |")
    p = result.params
    lines += ["", "fitted parameters: " + ", ".join(
        f"{k.removeprefix('placement/cost/')} {v:.4g}" for k, v in p.as_metrics().items()), ""]
    # memory
    lines += ["| device (mode) | estimated GiB | measured peak RSS GiB | error |", "|---|---|---|---|"]
    for mode, procs in rss.items():
        cfg, shape, _layout = cfgs[mode]
        est = estimate_memory(cfg, device_type="cpu", shape=shape)
        assert est is not None
        for role_est, role_meas in (("train+rollout", "ControllerActor"), ("train", "ControllerActor"),
                                    ("rollout", "RolloutWorker")):
            if role_est not in est.devices:
                continue
            peaks = [max(r["hwm"], r["rss_peak"]) for r in procs if r["role"] == role_meas]
            if not peaks:
                continue
            meas = max(peaks) / GiB
            e = sum(est.devices[role_est].values()) / GiB
            lines.append(f"| {role_est} ({mode}) | {e:.2f} | {meas:.2f} | {(e - meas) / meas:+.1%} |")
    text = "\n".join(lines)
    print(text)
    out = {"load": load, "modes": table, "params": p.as_metrics(), "step_error": result.step_error}
    (runs / "calibration.json").write_text(json.dumps(out, indent=2))
    if args.write_docs:
        write_section("placement",
                       "## Placement cost model and memory estimate at 2 devices\n\n"
                       "Command: `PYTHONPATH=$PWD .venv/bin/python bench/placement_runs.py` then "
                       "`PYTHONPATH=$PWD .venv/bin/python bench/placement_calibration.py`\n\n" + text + "\n")



if __name__ == "__main__":
    main()
