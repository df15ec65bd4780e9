"""Parallel against single controller: what the driver carries as the batch grows.

    .venv/bin/python bench/controller_scaling.py

Runs the same GRPO steps twice per size on a real local Ray — `controller.mode: parallel` (one RL
loop per data-parallel rank, the YATT model) and `controller.mode: single` (the driver holds the
loop, verl-style; trainer/single_controller.py) — on the `nano` model, 2 colocated devices (one
core each), HF-`generate` rollouts (quick to start; the engine is not what is compared), n=8
samples per prompt, batches of 64 → 4,096 samples per step with responses of up to 16 tokens and
64 and 256 samples with up to 256 tokens (1,024 × 256 takes minutes per step on 2 shared cores:
with 3 steps × 2 modes it would double the benchmark's time).
Each (mode, size) runs in a fresh process, 3 steps, step 1 is warm-up; figures are the means of
steps 2-3. Reported per step:

- driver peak memory: the driver process's peak RSS (`driver/rss_peak_mb`, getrusage);
- bytes through the driver: the exact length of the pickled payloads it received and sent
  (`driver/bytes_in` + `driver/bytes_out`: samples, batches, metrics; for parallel, the drained
  scalar records);
- overhead: step time minus the phases' own time (`time/idle`: rollout, reward, train, weight
  sync on the slowest device; what is left is control flow, serialization and waiting).

Then a small model of its own, fitted to the single-controller points, extrapolates the same
quantities to 64-1,024 devices and a 7B policy (assumptions next to the plot). Writes the
`controller_scaling` section of docs/benchmarks.md and docs/controller_scaling.png; the last
line printed is `ratio: X`, single's driver bytes over parallel's at 4,096 samples (16 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from docs_section import write_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parent.parent
SIZES = {16: [64, 256, 1024, 4096], 256: [64, 256]}
N_PER_PROMPT = 8
STEPS = 3
MODES = ("parallel", "single")


# ---------------------------------------------------------------------- one measured run
def run_config(model: str, mode: str, samples: int, tokens: int) -> dict[str, Any]:
    return {
        "model": {"path": model},
        "data": {"task": "arithmetic", "arithmetic": {"digits": 2, "train_size": 20_000, "eval_size": 8}},
        "algorithm": {"name": "grpo", "kl_coef": 0.0, "warm_start": {"steps": 0}},
        "train": {"max_steps": STEPS, "batch_size": samples // N_PER_PROMPT, "lr": 1e-5,
                  "micro_batch_size": 128},
        "rollout": {"engine": "hf", "n": N_PER_PROMPT, "max_new_tokens": tokens},
        "controller": {"mode": mode},
        "placement": {"mode": "colocate", "devices": 2},
        "checkpoint": {"every_steps": 1000, "export_final": False},
        "eval": {"size": 8},
        "report": {"flush_interval_s": 1.0},
    }


def one(model: str, mode: str, samples: int, tokens: int, out: Path) -> None:
    """The body of a child process: train, then leave metrics.jsonl in `out`."""
    from trainer.config import parse_config
    from trainer.entry import run_training

    run_training(parse_config(run_config(model, mode, samples, tokens)), out, env={})


def measure(model: str, mode: str, samples: int, tokens: int, work: Path) -> dict[str, Any]:
    out = work / f"{mode}-{samples}-{tokens}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t = time.time()
    proc = subprocess.run([sys.executable, __file__, "--one", mode, str(samples), str(tokens),
                           str(out), "--model", model], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} {samples}x{tokens} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 2]

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in steps) / len(steps)

    return {
        "mode": mode, "samples": samples, "max_tokens": tokens,
        "length_mean": mean("response/length_mean"),
        "peak_mb": max(r["driver/rss_peak_mb"] for r in rows if "driver/rss_peak_mb" in r),
        "bytes": mean("driver/bytes_in") + mean("driver/bytes_out"),
        "step_s": mean("time/step"), "overhead_s": mean("time/idle"),
        "gen_tokens": mean("tokens/generated"), "wall_s": time.time() - t,
    }


# ---------------------------------------------------------------------- on paper, at scale
PAPER = {
    "policy": "7B", "samples_per_device": 64, "prompt_tokens": 512, "response_tokens": 4096,
    "devices": [64, 128, 256, 512, 1024], "link_gb_s": 12.5, "call_ms": 1.0, "calls_per_rank": 4,
}


def fit(points: list[dict[str, Any]]) -> dict[str, float]:
    """Per-token driver bytes, driver RSS per byte carried, overhead seconds per byte: least
    squares through the single-controller points (intercepts from the smallest batches)."""
    single = [p for p in points if p["mode"] == "single"]
    par = [p for p in points if p["mode"] == "parallel"]
    tokens = [p["samples"] * (p["length_mean"] + 10.0) for p in single]  # ~10 prompt tokens here

    def slope(xs: list[float], ys: list[float]) -> tuple[float, float]:
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs) or 1.0
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        return b, my - b * mx

    bytes_per_token, _ = slope(tokens, [p["bytes"] for p in single])
    mem_per_byte, mem0 = slope([p["bytes"] for p in single], [p["peak_mb"] * 2**20 for p in single])
    s_per_byte, o0 = slope([p["bytes"] for p in single], [p["overhead_s"] for p in single])
    return {
        "bytes_per_token": bytes_per_token, "rss_per_byte": max(mem_per_byte, 0.0),
        "s_per_byte": max(s_per_byte, 0.0), "single_overhead0_s": max(o0, 0.0),
        "single_mem0_mb": mem0 / 2**20,
        "parallel_bytes_per_rank": sum(p["bytes"] for p in par) / len(par) / 2,
        "parallel_mem_mb": max(p["peak_mb"] for p in par),
        "parallel_overhead_s": sum(p["overhead_s"] for p in par) / len(par),
    }


def at_scale(f: dict[str, float]) -> list[dict[str, float]]:
    P = PAPER
    out = []
    for d in P["devices"]:
        samples = P["samples_per_device"] * d
        tokens = samples * (P["prompt_tokens"] + P["response_tokens"])
        single_bytes = tokens * f["bytes_per_token"]
        calls = d * P["calls_per_rank"] * P["call_ms"] / 1000
        out.append({
            "devices": d, "samples": samples,
            "single_bytes": single_bytes, "parallel_bytes": d * f["parallel_bytes_per_rank"],
            "single_mem_gb": (f["single_mem0_mb"] * 2**20 + f["rss_per_byte"] * single_bytes) / 2**30,
            "parallel_mem_gb": (f["parallel_mem_mb"] * 2**20 + d * f["parallel_bytes_per_rank"]) / 2**30,
            "single_overhead_s": (f["single_overhead0_s"] + f["s_per_byte"] * single_bytes
                                  + single_bytes / (P["link_gb_s"] * 1e9) + calls),
            "parallel_overhead_s": f["parallel_overhead_s"],
        })
    return out


# ---------------------------------------------------------------------- report
def plot(points: list[dict[str, Any]], scale: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    series = [("peak_mb", "driver peak RSS (MB)"), ("bytes", "bytes through the driver / step"),
              ("overhead_s", "overhead / step (s)")]
    for ax, (key, label) in zip(axes[:3], series, strict=True):
        for mode, style in (("parallel", "-o"), ("single", "--s")):
            for tokens in SIZES:
                pts = [p for p in points if p["mode"] == mode and p["max_tokens"] == tokens]
                ax.plot([p["samples"] for p in pts], [p[key] for p in pts], style,
                        label=f"{mode}, ≤{tokens} tok")
        ax.set_xscale("log", base=2)
        if key == "bytes":
            ax.set_yscale("log")
        ax.set_xlabel("samples per step (nano, 2 devices)")
        ax.set_title(label)
        ax.legend(fontsize=7)
    ax = axes[3]
    ds = [s["devices"] for s in scale]
    ax.plot(ds, [s["single_bytes"] / 2**30 for s in scale], "--s", label="single: GiB through driver")
    ax.plot(ds, [s["parallel_bytes"] / 2**30 for s in scale], "-o", label="parallel: GiB through driver")
    ax.plot(ds, [s["single_mem_gb"] for s in scale], "--^", label="single: driver RSS GiB")
    ax.plot(ds, [s["parallel_mem_gb"] for s in scale], "-^", label="parallel: driver RSS GiB")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices (7B policy, on paper)")
    ax.set_title("at scale (model fitted above)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(points: list[dict[str, Any]], f: dict[str, float], scale: list[dict[str, float]],
             ratio: float, load: str, minutes: float) -> str:
    P = PAPER
    lines = [
        "## Parallel against single controller",
        "",
        f"`.venv/bin/python bench/controller_scaling.py` — {datetime.now(UTC):%Y-%m-%d}, 2 shared "
        f"cores (load average {load}), {minutes:.0f} min. `nano` model, 2 colocated devices, "
        f"GRPO, n={N_PER_PROMPT}, HF rollouts, mean of steps 2-{STEPS} of a fresh process per row.",
        "",
        "| mode | tokens ≤ (mean) | samples/step | driver peak RSS MB | driver bytes/step | "
        "step s | overhead s | overhead % |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in sorted(points, key=lambda p: (p["max_tokens"], p["samples"], p["mode"])):
        lines.append(
            f"| {p['mode']} | {p['max_tokens']} ({p['length_mean']:.1f}) | {p['samples']:,} | "
            f"{p['peak_mb']:,.0f} | {p['bytes']:,.0f} | {p['step_s']:.2f} | {p['overhead_s']:.3f} | "
            f"{100 * p['overhead_s'] / max(p['step_s'], 1e-9):.1f} |")
    lines += ["", "![controller scaling](controller_scaling.png)", ""]
    for tokens in SIZES:
        for mode in MODES:
            pts = sorted((p for p in points if p["mode"] == mode and p["max_tokens"] == tokens),
                         key=lambda p: p["samples"])
            if len(pts) > 1:
                lines.append(f"- {mode}, ≤{tokens} tokens: driver peak RSS ×"
                             f"{pts[-1]['peak_mb'] / pts[0]['peak_mb']:.2f} and bytes ×"
                             f"{pts[-1]['bytes'] / pts[0]['bytes']:.1f} from {pts[0]['samples']:,} to "
                             f"{pts[-1]['samples']:,} samples.")
    worse = [f"{p['samples']:,}×≤{p['max_tokens']}" for p in points if p["mode"] == "parallel"
             and any(q["mode"] == "single" and q["samples"] == p["samples"] and q["max_tokens"] == p["max_tokens"]
                     and q["overhead_s"] < p["overhead_s"] for q in points)]
    lines += [
        "- Parallel overhead no higher than single's at every size: "
        + ("yes." if not worse else f"no, at {', '.join(worse)} (noise on shared cores, or real).")
        + " Overheads of tens of ms swing by ×3 between runs here (load average above 20).",
        f"- Single's driver bytes over parallel's at 4,096 samples (≤16 tokens): **{ratio:,.0f}×**.",
        "",
        "**At scale, on paper** (right panel; the same three quantities for a "
        f"{P['policy']} policy on 64-1,024 devices):",
        "",
        "| devices | samples/step | single: through driver | parallel: through driver | "
        "single: driver RSS | parallel: driver RSS | single: overhead s | parallel: overhead s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in scale:
        lines.append(
            f"| {s['devices']:,} | {s['samples']:,} | {s['single_bytes'] / 2**30:,.1f} GiB | "
            f"{s['parallel_bytes'] / 2**20:,.2f} MiB | {s['single_mem_gb']:,.1f} GiB | "
            f"{s['parallel_mem_gb']:,.2f} GiB | {s['single_overhead_s']:,.1f} | "
            f"{s['parallel_overhead_s']:,.2f} |")
    lines += [
        "",
        "Assumptions of the model (fitted to the single-controller rows above, least squares):",
        f"- a step samples {P['samples_per_device']} responses per device, {P['prompt_tokens']} prompt + "
        f"{P['response_tokens']} response tokens each; the single driver moves "
        f"{f['bytes_per_token']:.1f} bytes per token (the measured slope; prompt tokens counted like "
        "response tokens; verl's extra round trips of old/reference log-probs would add more);",
        f"- driver RSS grows {f['rss_per_byte']:.2f} bytes per byte carried (measured slope) over "
        f"{f['single_mem0_mb']:.0f} MB; the parallel driver stays at {f['parallel_mem_mb']:.0f} MB plus "
        f"{f['parallel_bytes_per_rank'] / 1024:.1f} KiB of scalar records per rank;",
        f"- single overhead = {f['single_overhead0_s']:.3f} s + {f['s_per_byte'] * 1e9:.2f} s/GB "
        f"(measured: pickling, copying, unpickling on one core) + the driver's link at "
        f"{P['link_gb_s']} GB/s + {P['calls_per_rank']} calls of {P['call_ms']:.0f} ms per rank "
        "issued one after another; parallel overhead stays at its measured "
        f"{f['parallel_overhead_s']:.3f} s (each rank's own loop; the gradient all-reduce is the same "
        "in both modes and counted in train);",
        "- the 7B weights never pass through either driver (ranks push them to their samplers).",
    ]
    return "\n".join(lines) + "\n"


def update_doc(section: str) -> None:
    write_section("controller_scaling", section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", nargs=4, metavar=("MODE", "SAMPLES", "TOKENS", "OUT"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--model", default=str(ROOT / ".yatt" / "models" / "bench-nano"))
    parser.add_argument("--tokens", type=int, nargs="*", default=list(SIZES),
                        help="response lengths to run (16, 256)")
    parser.add_argument("--no-write", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument("--report", metavar="JSON", help="only redo the report from saved points "
                        "(.yatt/controller_scaling.json, written by every run)")
    parser.add_argument("--load-start", default="(not recorded)", help="with --report: the load "
                        "average the run printed at its start")
    args = parser.parse_args()
    if args.report:
        report(json.loads(Path(args.report).read_text()), args, args.load_start, time.time())
        return
    if args.one:
        mode, samples, tokens, out = args.one
        one(args.model, mode, int(samples), int(tokens), Path(out))
        return

    from trainer.config import parse_config
    from trainer.models import ensure_model

    ensure_model(parse_config({"model": {"path": args.model, "preset": "nano"},
                               "data": {"arithmetic": {"digits": 2}}}))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average at start: {load}", flush=True)
    t0 = time.time()
    points = []
    with tempfile.TemporaryDirectory(prefix="yatt-ctl-bench-") as tmp:
        for tokens in args.tokens:
            for samples in SIZES[tokens]:
                for mode in MODES:  # side by side, one size at a time
                    p = measure(args.model, mode, samples, tokens, Path(tmp))
                    points.append(p)
                    print(f"{mode:>8} ≤{tokens:>3} tok (mean {p['length_mean']:5.1f}) {samples:>5} "
                          f"samples: peak {p['peak_mb']:7.0f} MB  {p['bytes']:>12,.0f} B/step  step "
                          f"{p['step_s']:6.2f} s  overhead {p['overhead_s']:6.3f} s  ({p['wall_s']:.0f} s)",
                          flush=True)
    (work_dir := ROOT / ".yatt").mkdir(exist_ok=True)
    (work_dir / "controller_scaling.json").write_text(json.dumps(points, indent=1))
    report(points, args, load, t0)


def report(points: list[dict[str, Any]], args: argparse.Namespace, load: str, t0: float) -> None:
    f = fit(points)
    scale = at_scale(f)
    for s in scale:
        print(f"on paper {s['devices']:>5} devices: single {s['single_bytes'] / 2**30:9.1f} GiB/step "
              f"{s['single_mem_gb']:8.1f} GiB RSS {s['single_overhead_s']:7.1f} s | parallel "
              f"{s['parallel_bytes'] / 2**20:7.2f} MiB/step {s['parallel_mem_gb']:5.2f} GiB RSS "
              f"{s['parallel_overhead_s']:5.2f} s")
    big = [p for p in points if p["samples"] == 4096 and p["max_tokens"] == 16]
    by_mode = {p["mode"]: p for p in big}
    ratio = by_mode["single"]["bytes"] / by_mode["parallel"]["bytes"] if len(by_mode) == 2 else float("nan")
    load_end = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average at end: {load_end}")
    if not args.no_write:
        plot(points, scale, ROOT / "docs" / "controller_scaling.png")
        update_doc(markdown(points, f, scale, ratio, f"{load} at the start, {load_end} at the end",
                            sum(p["wall_s"] for p in points) / 60))
        print("written to docs/benchmarks.md and docs/controller_scaling.png")
    print(f"ratio: {ratio:.1f}")


if __name__ == "__main__":
    main()
