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

Two nodes (docs/placement.md, "Predicted against measured on two nodes", runs them in five
pairs, alternating which goes first, since the load drifts):

    PYTHONPATH=$PWD .venv/bin/python bench/weight_sync.py --two-nodes --receivers 1 --presets micro,small
    PYTHONPATH=$PWD .venv/bin/python bench/placement_runs.py --out .yatt/pairs/pair1 --modes disaggregated
    PYTHONPATH=$PWD .venv/bin/python bench/placement_runs.py --out .yatt/pairs/pair1 --modes disaggregated \
        --two-nodes
    PYTHONPATH=$PWD .venv/bin/python bench/placement_calibration.py --two-nodes --modes disaggregated \
        --runs .yatt/pairs/pair1[,.yatt/pairs/pair2,...] --link .yatt/link-calibration.json

With `--two-nodes`, per run directory the parameters are fitted on its one-node runs only
(`--modes`), and its two-node run (`<runs>/disaggregated-two-nodes`, whose steps the fit never
saw) is predicted with them: with the link term the one-node fit found (a broadcast between two
processes of one node), with the link term calibrated from the two-node broadcast (`--link`,
written by bench/weight_sync.py --two-nodes), and, for reference, with one fit over both runs.
It writes the `placement_two_nodes` section instead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from docs_section import write_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parent.parent


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    from trainer.placement.cost_model import LengthDist, Workload, fit
    from trainer.placement.memory import GiB, estimate_memory
    from trainer.placement.simulator import simulate

    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default=".yatt/placement-runs",
                    help="run directory (--two-nodes: several, comma-separated, each a pair)")
    ap.add_argument("--modes", default="colocate,disaggregated")
    ap.add_argument("--write-docs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--two-nodes", action="store_true",
                    help="predict <runs>/disaggregated-two-nodes from a fit on the one-node runs")
    ap.add_argument("--link", type=Path, default=None,
                    help="--two-nodes: the link calibration of bench/weight_sync.py --two-nodes")
    args = ap.parse_args()
    load = os.getloadavg()
    if args.two_nodes:
        two_nodes([Path(r) for r in args.runs.split(",")], args.modes.split(","), load, args.link,
                  write_docs=args.write_docs)
        return
    runs = Path(args.runs)
    obs_by_mode, cfgs, rss, run_info = {}, {}, {}, {}
    for mode in args.modes.split(","):
        d = runs / mode
        cfg, shape, layout, obs_by_mode[mode] = load_run(d)
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


def load_run(d: Path) -> tuple[Any, Any, Any, list[Any]]:
    """A run directory's config, model shape, layout and observed steps."""
    from trainer.config import parse_config
    from trainer.placement.cost_model import Layout, observations_from_metrics
    from trainer.placement.memory import ModelShape

    cfg = parse_config(json.loads((d / "config.json").read_text()))
    shape = ModelShape.from_config(json.loads((Path(cfg.model.path) / "config.json").read_text()))
    layout = Layout(cfg.placement.mode, cfg.placement.devices,
                    rollout_devices=cfg.placement.rollout_devices, staleness=cfg.placement.staleness)
    obs = observations_from_metrics(_rows(d / "metrics.jsonl"), layout, param_bytes=shape.params * 4.0)
    return cfg, shape, layout, obs


def two_node_pair(runs: Path, modes: list[str], link: Any) -> tuple[list[str], dict[str, Any]]:
    """Fit on the one-node runs `<runs>/<mode>` and predict `<runs>/disaggregated-two-nodes`,
    whose steps the fit never saw: with the fit's own link term, with the calibrated `link`,
    and (for reference) with one fit over all of them."""
    from trainer.placement.cost_model import fit, predicted_steps

    one_obs = {m: load_run(runs / m)[3] for m in modes}
    one_node = fit([o for obs in one_obs.values() for o in obs])
    d = runs / "disaggregated-two-nodes"
    _cfg, _shape, _layout, obs = load_run(d)
    info = json.loads((d / "rss.json").read_text()) if (d / "rss.json").exists() else {}
    placement = [e["data"] for e in _rows(d / "events.jsonl") if e.get("kind") == "placement"][0]
    nodes = placement.get("nodes") or []
    train_node = {nodes[i] for i in placement["train_devices"]} if nodes else set()
    rollout_node = {nodes[i] for i in placement["rollout_devices"]} if nodes else set()
    if len(set(nodes)) < 2 or train_node & rollout_node:
        raise SystemExit(f"{d}: its placement event does not put training and rollout on two "
                         f"nodes ({nodes})")
    measured = statistics.mean(o.get("time/step") for o in obs)
    sync_meas = statistics.mean(o.get("time/weight_sync") for o in obs)
    candidates = [("one-node fit, its own link term", one_node.params)]
    if link is not None:
        candidates.append(("one-node fit, link term from the two-node broadcast", link.apply(one_node.params)))
    candidates.append(("in-sample: one fit over both nodes' runs",
                       fit([*[o for v in one_obs.values() for o in v], *obs]).params))
    loads = {m: json.loads((runs / m / "rss.json").read_text()) for m in modes
             if (runs / m / "rss.json").exists()}
    lines = [f"`{runs}`: two-node run {len(obs)} steps (steps 1–2 skipped), training on node "
             f"{', '.join(n[:8] for n in train_node)}…, rollout on node "
             f"{', '.join(n[:8] for n in rollout_node)}…"
             + (f", `uptime` 1-minute load {info['load_start'][0]:.1f} → {info['load_end'][0]:.1f}"
                if info.get("load_start") else "")
             + "; fitted on " + ", ".join(
                 f"one-node {m} ({v['steps']:.0f} steps, measured {v['measured_s']:.3f} s/step"
                 + (f", load {loads[m]['load_start'][0]:.1f} → {loads[m]['load_end'][0]:.1f}"
                    if m in loads else "") + ")" for m, v in one_node.by_mode.items())
             + f": `sync_fixed_s` {one_node.params.sync_fixed_s * 1e3:.1f} ms, `sync_link_Bps` "
             f"{one_node.params.sync_link_Bps / 1e9:.3f} GB/s", "",
             "| parameters | predicted step s | measured step s | error | predicted weight sync s | measured weight sync s |",
             "|---|---:|---:|---:|---:|---:|"]
    out: dict[str, Any] = {"runs": str(runs), "measured_s": measured, "measured_weight_sync_s": sync_meas,
                           "one_node_measured_s": {m: v["measured_s"] for m, v in one_node.by_mode.items()},
                           "load": info.get("load_start"), "steps": len(obs), "nodes": nodes,
                           "predictions": {}}
    for label, params in candidates:
        pred = statistics.mean(predicted_steps(params, obs))
        sync_pred = params.sync_fixed_s + (obs[0].param_bytes / params.sync_link_Bps
                                           if params.sync_link_Bps != float("inf") else 0.0)
        err = (pred - measured) / measured
        out["predictions"][label] = {"step_s": pred, "error": err, "weight_sync_s": sync_pred}
        lines.append(f"| {label} | {pred:.3f} | {measured:.3f} | {err:+.1%} | {sync_pred:.4f} | {sync_meas:.4f} |")
    return lines, out


def two_nodes(runs: list[Path], modes: list[str], load: tuple[float, float, float],
              link_path: Path | None, *, write_docs: bool) -> None:
    """Predicted against measured for every pair of runs in `runs`, then one line per pair."""
    from trainer.placement.link import load_link_calibration

    link = load_link_calibration(link_path) if link_path is not None else None
    lines: list[str] = []
    if link is not None:
        src = link.source
        lines += [f"link term (`{link_path}`, measured {src.get('measured', '?')} at load "
                  f"{src.get('load_1min', '?')}): `sync_fixed_s` {link.sync_fixed_s * 1e3:.1f} ms, "
                  f"`sync_link_Bps` {link.sync_link_Bps / 1e9:.3f} GB/s from {len(link.measurements)} "
                  f"broadcasts (mean |error| {link.error:.1%}); analysed at load {load[0]:.1f}", ""]
    results = []
    for r in runs:
        pair_lines, out = two_node_pair(r, modes, link)
        lines += [*pair_lines, ""]
        results.append(out)
        (r / "calibration-two-nodes.json").write_text(json.dumps(out, indent=2))
    label = ("one-node fit, link term from the two-node broadcast" if link is not None
             else "one-node fit, its own link term")
    lines += [f"Summary ({label}):", "",
              "| runs | one-node measured s | two-node measured s | predicted s | error |",
              "|---|---:|---:|---:|---:|"]
    for out in results:
        one = " / ".join(f"{v:.3f}" for v in out["one_node_measured_s"].values())
        pred = out["predictions"][label]
        lines.append(f"| `{out['runs']}` | {one} | {out['measured_s']:.3f} | {pred['step_s']:.3f} | "
                     f"{pred['error']:+.1%} |")
    text = "\n".join(lines)
    print(text)
    if write_docs:
        write_section("placement_two_nodes",
                      "## Placement cost model on two Ray nodes (issue 9 items 5 and 7)\n\n"
                      "Commands in docs/placement.md (\"Predicted against measured on two nodes\").\n\n"
                      + text + "\n")

if __name__ == "__main__":
    main()
