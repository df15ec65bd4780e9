"""`yatt placement simulate`: step time, throughput and idle devices per placement mode, from 8 to
1,024 GPUs, with the cost model's H100 defaults (docs/placement.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["register", "run_simulation"]


def _best_split(mode: str, devices: int, params_for, w, candidates: list[int]):  # noqa: ANN001
    from trainer.placement.cost_model import Layout, phase_times

    best = None
    for c in candidates:
        if mode == "disaggregated":
            if not 1 <= c < devices:
                continue
            layout = Layout(mode, devices, rollout_devices=c)
        else:
            if not 1 <= c <= devices:
                continue
            layout = Layout(mode, devices, reward_devices=c)
        p, tp = params_for(layout)
        t = phase_times(p, w, layout).step
        if best is None or t < best[0]:
            best = (t, layout, p, tp)
    return best


def run_simulation(*, model_size: str, devices: list[int], modes: list[str], prompts: int, n: int,
                   prompt_tokens: float, mean_response: float, tail_sigma: float,
                   max_response: float, reward_model_size: str | None, steps: int,
                   seed: int, link: Path | None = None) -> list[dict]:
    """Simulate every (mode, device count); the best split per mode by the analytic model.
    `link`: a measured link term (trainer/placement/link.py) in place of the profile's."""
    from trainer.placement.cost_model import Layout
    from trainer.placement.hardware import H100, cost_params_for, default_workload, model_spec
    from trainer.placement.link import load_link_calibration
    from trainer.placement.simulator import simulate

    model = model_spec(model_size)
    rm = model_spec(reward_model_size) if reward_model_size else None
    w = default_workload(model, prompts=prompts, n=n, prompt_tokens=prompt_tokens,
                         mean_response=mean_response, sigma=tail_sigma, max_response=max_response)

    measured_link = load_link_calibration(link) if link is not None else None

    def params_for(layout: Layout):  # noqa: ANN202
        p, tp = cost_params_for(model, H100, layout, w, reward_model=rm)
        return (measured_link.apply(p) if measured_link else p), tp

    rows = []
    for d in devices:
        for mode in modes:
            if mode == "colocate":
                layout = Layout("colocate", d)
                p, tp = params_for(layout)
            else:
                if mode == "disaggregated" and d < 2:
                    continue
                fracs = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8)
                cands = sorted({max(1, round(d * f)) for f in fracs})
                _t, layout, p, tp = _best_split(mode, d, params_for, w, cands)
            r = simulate(p, w, layout, steps=steps, tp=tp, seed=seed)
            rows.append({**r.row(), "tp": tp})
    return rows


def _plots(rows: list[dict], out: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label, fname in (("step_s", "step time (s)", "step_time.png"),
                              ("samples_per_s", "samples / s", "throughput.png"),
                              ("idle_frac", "device idle fraction", "idle_fraction.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = [(r["devices"], r[key]) for r in rows if r["mode"] == mode]
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        if key != "idle_frac":
            ax.set_yscale("log")
        ax.set_xlabel("devices (GPUs)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def format_table(rows: list[dict]) -> str:
    lines = [f"{'devices':>7}  {'mode':<17} {'split':<22} {'tp':>2}  {'step s':>8}  "
             f"{'samples/s':>9}  {'gen tok/s':>10}  {'idle':>5}"]
    for r in rows:
        lines.append(f"{r['devices']:>7}  {r['mode']:<17} {r['split']:<22} {r['tp']:>2}  "
                     f"{r['step_s']:>8.1f}  {r['samples_per_s']:>9.1f}  "
                     f"{r['gen_tokens_per_s']:>10,.0f}  {r['idle_frac']:>5.1%}")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    group = typer.Typer(no_args_is_help=True, help="Placement: simulate clusters this machine cannot hold.")
    app.add_typer(group, name="placement")

    @group.command("simulate")
    def simulate_cmd(
        model_size: Annotated[str, typer.Option("--model-size", help="0.5b 1.5b 7b 14b 32b 72b or <N>b")] = "7b",
        devices: Annotated[str, typer.Option("--devices", help="Comma-separated GPU counts.")] = "8,64,512,1024",
        modes: Annotated[str, typer.Option("--modes")] = "colocate,disaggregated,partial_colocate",
        prompts: Annotated[int, typer.Option("--prompts", help="Prompts per step.")] = 512,
        n: Annotated[int, typer.Option("--n", help="Responses per prompt.")] = 16,
        prompt_tokens: Annotated[float, typer.Option("--prompt-tokens")] = 512,
        mean_response: Annotated[float, typer.Option("--mean-response", help="Mean response tokens.")] = 2000,
        tail_sigma: Annotated[float, typer.Option("--tail-sigma", help="Log-normal spread of lengths.")] = 0.8,
        max_response: Annotated[float, typer.Option("--max-response", help="Max new tokens.")] = 8192,
        reward_model_size: Annotated[str | None, typer.Option(
            "--reward-model-size", help="Score with a reward model of this size (default: a rule).")] = None,
        steps: Annotated[int, typer.Option("--steps", min=3)] = 8,
        seed: Annotated[int, typer.Option("--seed")] = 0,
        link: Annotated[Path | None, typer.Option(
            "--link", help="A measured link term (bench/weight_sync.py --two-nodes writes one) "
            "instead of the H100 profile's network.", exists=True, dir_okay=False)] = None,
        out: Annotated[Path, typer.Option("--out", help="Where the plots and simulate.json go.")] = Path(
            "placement-sim"),
    ) -> None:
        """Discrete-event simulation of RL steps per placement mode and device count."""
        from trainer.placement.cost_model import MODES

        try:
            counts = [int(x) for x in devices.split(",") if x.strip()]
        except ValueError:
            typer.echo(f"--devices: expected comma-separated integers, got {devices!r}", err=True)
            raise typer.Exit(2) from None
        wanted = [m.strip() for m in modes.split(",") if m.strip()]
        bad = [m for m in wanted if m not in MODES]
        if bad or not wanted or not counts or min(counts) < 1:
            typer.echo(f"--modes must be among {', '.join(MODES)} and --devices positive", err=True)
            raise typer.Exit(2)
        try:
            rows = run_simulation(model_size=model_size, devices=counts, modes=wanted,
                                  prompts=prompts, n=n, prompt_tokens=prompt_tokens,
                                  mean_response=mean_response, tail_sigma=tail_sigma,
                                  max_response=max_response, reward_model_size=reward_model_size,
                                  steps=steps, seed=seed, link=link)
        except ValueError as exc:
            typer.echo(f"--model-size: {exc}", err=True)
            raise typer.Exit(2) from None
        title = (f"{model_size} on H100s, {prompts}×{n} samples, responses mean {mean_response:g} "
                 f"(σ {tail_sigma:g}, max {max_response:g})"
                 + (f", {reward_model_size} reward model" if reward_model_size else "")
                 + (f", link term from {link}" if link else ""))
        typer.echo(title)
        typer.echo(format_table(rows))
        out.mkdir(parents=True, exist_ok=True)
        (out / "simulate.json").write_text(json.dumps({"title": title, "rows": rows}, indent=2))
        for path in _plots(rows, out, title):
            typer.echo(f"wrote {path}")
