"""Weight sync side by side: the object-store copy yatt used before against trainer/weight_sync.py.

    PYTHONPATH=. .venv/bin/python bench/weight_sync.py            # --receivers 1,2 --rounds 6
    PYTHONPATH=. .venv/bin/python bench/weight_sync.py --two-nodes   # receivers on a second node
    PYTHONPATH=. .venv/bin/python bench/weight_sync.py --two-nodes --receivers 1 --presets micro,small

One local Ray cluster; the `small` tiny model (17.4M parameters, bench-small, as
bench/trainer_vs_trl.py builds it); a source actor holding the policy in a real `Learner` (a
training rank) and R rollout-worker actors (`RolloutWorker`, in-process vLLM, one CPU each), as
disaggregated placement runs them. Each round moves the policy to every worker both ways, in
alternation, so both see the same machine:

- object store (yatt before this module): `ray.put(weights)` on the source, every worker pulls
  that copy from the object store and loads it (`engine.update_weights`);
- broadcast (trainer/weight_sync.py): one bucketed gloo broadcast from the source, each worker
  loading buckets into its engine as they arrive.

Prints, per way and receiver count: the median seconds until every worker has loaded the new
weights (end to end), the source's blocked time, the bytes created in the object store per sync,
and the ratio object-store / broadcast. The first round of each way is a warm-up and not counted.
Writes its section of docs/benchmarks.md (`--no-docs` to skip).

`--two-nodes` starts a second Ray node on this machine (`ray start --address ... --block`, its
own temp dir and resources; the script kills only that process when done) standing in for a
second host, pins the source to the head and the receivers to the second node, so the weights
cross nodes; it prints the broadcast's bandwidth, and fits the placement cost model's link term
(`sync_fixed_s`, `sync_link_Bps`; trainer/placement/link.py) to every counted broadcast of the
first receiver count: the seconds from the first byte to the end of the round (what a training
run reports as `time/weight_sync`) against the bytes moved. Policies of two sizes
(`--presets micro,small`: the demo's 4 MB and 70 MB) separate the fixed cost of a round from the
bandwidth. The calibration goes to `--link-out` (default `.yatt/link-calibration.json`), which
`bench/placement_calibration.py --link` and `yatt placement simulate --link` read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import docs_section  # noqa: E402 (bench/docs_section.py, beside this script)

ROOT = Path(__file__).resolve().parents[1]
SECTION = "weight_sync"


def model_dir(preset: str) -> Path:
    """bench-small as bench/trainer_vs_trl.py builds it; bench-micro the demo's shape."""
    return ROOT / ".yatt" / "models" / f"bench-{preset}"


def config(bucket_mb: float, preset: str = "small") -> dict[str, Any]:
    return {
        "model": {"path": str(model_dir(preset)), "preset": preset},
        "algorithm": {"name": "grpo", "kl_coef": 0.0},
        "rollout": {"engine": "vllm", "max_new_tokens": 8, "kv_cache_gb": 0.25,
                    "weight_sync_bucket_mb": bucket_mb},
        "placement": {"device_type": "cpu"},
    }


def remote_classes() -> tuple[Any, Any]:
    import ray
    import torch

    from trainer.controller import RolloutWorker

    class CopyLoadingWorker(RolloutWorker):
        """A rollout worker that can also load a copy pulled from the object store (the old way)."""

        def load_copy(self, version: int, weights: dict[str, torch.Tensor]) -> None:
            self.engine.update_weights(list(weights.items()))
            self.version = version

        def held_version(self) -> int:
            return self.version

    class Source:
        """A training rank: the policy in a Learner, and both ways of sending it."""

        def __init__(self, cfg_json: str):
            import json

            from trainer.config import parse_config
            from trainer.learner import Learner
            from trainer.weight_sync import TrainerWeightSync

            torch.set_num_threads(1)
            cfg = parse_config(json.loads(cfg_json))
            self.learner = Learner(cfg, cfg.model.path, device="cpu")
            self.sync = TrainerWeightSync(
                device=0, bucket_bytes=int(cfg.rollout.weight_sync_bucket_mb * 2**20))
            self.workers: list[Any] = []

        def address(self) -> tuple[str, int]:
            from trainer import rendezvous

            return rendezvous.host()  # the broadcast's source, rank 0 of its group, takes it

        def open_weight_broadcast(self, addr: str, port: int, receivers: list[Any], backend: str) -> None:
            self.sync.open_broadcast(addr, port, receivers, backend=backend)
            self.workers = receivers

        def by_object_store(self, version: int) -> dict[str, float]:
            t0 = time.perf_counter()
            ref = ray.put(self.learner.named_weights())  # one copy, pulled by every worker
            blocked = time.perf_counter() - t0
            ray.get([w.load_copy.remote(version, ref) for w in self.workers])
            return {"total_s": time.perf_counter() - t0, "source_s": blocked}

        def by_broadcast(self, version: int) -> dict[str, float]:
            t0 = time.perf_counter()
            metrics, spans = self.sync.push(version, lambda: self.learner.named_weights().items())
            self.sync.receiver_spans()
            total = time.perf_counter() - t0
            # first byte to the end of the round: a training step's `time/weight_sync`
            sync_s = sum(s["end"] - s["start"] for s in spans if s["phase"] == "weight_sync")
            return {"total_s": total, "source_s": total, "sync_s": sync_s,
                    "buckets": metrics["weight_sync/buckets"], "bytes": metrics["weight_sync/bytes"]}

    return ray.remote(CopyLoadingWorker), ray.remote(Source)


def object_store_created(ray: Any) -> int:
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return int(reply.store_stats.cumulative_created_bytes)


def measure(receivers: int, rounds: int, bucket_mb: float, *, two_nodes: bool = False,
            preset: str = "small") -> dict[str, Any]:
    import ray

    from trainer.weight_sync import connect_broadcast

    cfg_json = __import__("json").dumps(config(bucket_mb, preset))
    Worker, Source = remote_classes()
    env = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
                        "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "ERROR",
                        "PYTHONPATH": str(ROOT)}}
    # with two nodes: the source on the head, every receiver on the second node
    on_b = {"resources": {"bench_node_b": 1}} if two_nodes else {}
    on_a = {"resources": {"bench_node_a": 1}} if two_nodes else {}
    workers = [Worker.options(num_cpus=0, runtime_env=env, **on_b).remote(
        cfg_json, d + 1, str(model_dir(preset)), "cpu", 1.0) for d in range(receivers)]
    source = Source.options(num_cpus=0, runtime_env=env, **on_a).remote(cfg_json)
    try:
        connect_broadcast(source, workers, backend="gloo")
        out: dict[str, list[dict[str, float]]] = {"object_store": [], "broadcast": []}
        version = 0
        for r in range(rounds):
            for way in ("object_store", "broadcast"):
                version += 1
                before = object_store_created(ray)
                res = ray.get(getattr(source, f"by_{way}").remote(version), timeout=600)
                res["store_bytes"] = float(object_store_created(ray) - before)
                held = ray.get([w.held_version.remote() for w in workers])
                assert held == [version] * receivers, (way, held, version)
                if r > 0:  # the first round warms both ways up
                    out[way].append(res)
        return {"receivers": receivers, "two_nodes": two_nodes, "preset": preset,
                "broadcasts": [(r["bytes"], r["sync_s"]) for r in out["broadcast"]],
                **{way: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
                   for way, runs in out.items()}}
    finally:
        for actor in [*workers, source]:
            ray.kill(actor)


def link_calibration(results: list[dict[str, Any]], receivers: int, presets: list[str],
                     load: float, out: Path) -> str:
    """Fit the cost model's link term to the counted broadcasts to `receivers` workers, write it
    to `out`, and say what it is."""
    from trainer.placement.link import calibrate_link

    points = [pt for r in results if r["receivers"] == receivers for pt in r["broadcasts"]]
    cal = calibrate_link(points, source={
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_1min": round(load, 2),
        "receivers": receivers, "presets": presets,
        "command": "PYTHONPATH=. .venv/bin/python bench/weight_sync.py --two-nodes "
                   f"--receivers {receivers} --presets {','.join(presets)}"})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(cal.to_json())
    sizes = sorted({round(b / 2**20, 1) for b, _ in points})
    return (f"Link term fitted to {len(points)} broadcasts to {receivers} receiver(s) of "
            f"{' and '.join(f'{x} MiB' for x in sizes)} (first byte to the end of the round): "
            f"`sync_fixed_s` {cal.sync_fixed_s * 1e3:.1f} ms, `sync_link_Bps` "
            f"{cal.sync_link_Bps / 1e9:.3f} GB/s, mean |error| {cal.error:.1%} of the mean; "
            f"written to `{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}`.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--receivers", default="1,2", help="rollout workers, comma-separated counts")
    ap.add_argument("--rounds", type=int, default=6, help="syncs per way (the first is a warm-up)")
    ap.add_argument("--bucket-mb", type=float, default=16.0,
                    help="rollout.weight_sync_bucket_mb (16: the 70 MB policy in 5 buckets)")
    ap.add_argument("--two-nodes", action="store_true",
                    help="receivers on a second Ray node started here (weights cross nodes)")
    ap.add_argument("--presets", default="small",
                    help="policy sizes, comma-separated (micro: the demo's model, small: 70 MB)")
    ap.add_argument("--link-out", type=Path, default=ROOT / ".yatt" / "link-calibration.json",
                    help="--two-nodes: where the link term's calibration goes")
    ap.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()

    import ray

    from trainer.config import parse_config
    from trainer.models import ensure_model
    from trainer.placement.local_nodes import start_ray_node, stop_ray_node

    presets = [x.strip() for x in args.presets.split(",") if x.strip()]
    for preset in presets:
        ensure_model(parse_config(config(args.bucket_mb, preset)))
    counts = [int(x) for x in args.receivers.split(",")]
    ctx = ray.init(address="local", num_cpus=max(counts) + 1, include_dashboard=False,
                   resources={"bench_node_a": 8}, logging_level="ERROR",
                   runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    load = os.getloadavg()
    node_b = None
    with tempfile.TemporaryDirectory(prefix="yatt-node-b-") as temp_dir:
        try:
            if args.two_nodes:
                node_b, _node_id = start_ray_node(
                    ctx.address_info["gcs_address"], temp_dir=temp_dir, cpus=2,
                    resources={"yatt_device": 2, "bench_node_b": 8})
            results = [measure(n, args.rounds, args.bucket_mb, two_nodes=args.two_nodes, preset=preset)
                       for preset in presets for n in counts]
        finally:
            if node_b is not None:  # only the node this script started
                stop_ray_node(node_b)
            ray.shutdown()
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
        f"{load[0]:.1f} at the start; {', '.join(f'`{p}`' for p in presets)} model, "
        f"{args.rounds - 1} syncs per way (median), "
        f"buckets of {args.bucket_mb:g} MB"
        + ("; receivers on a second Ray node (this machine), source on the head" if args.two_nodes else "")
        + ". Command: `PYTHONPATH=. .venv/bin/python bench/weight_sync.py"
        + (" --two-nodes" if args.two_nodes else "")
        + (f" --receivers {args.receivers}" if args.receivers != "1,2" else "")
        + (f" --presets {args.presets}" if args.presets != "small" else "") + "`.",
        "",
        "| model | receivers | way | until every engine holds it (s) | source blocked (s) | object-store bytes per sync | buckets |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for res in results:
        for way in ("object_store", "broadcast"):
            r = res[way]
            lines.append(f"| {res['preset']} | {res['receivers']} | {way.replace('_', ' ')} | "
                         f"{r['total_s']:.3f} | {r['source_s']:.3f} | {r['store_bytes'] / 2**20:.1f} MiB | "
                         f"{r.get('buckets', 0):.0f} |")
    lines.append("")
    for res in results:
        ratio = res["object_store"]["total_s"] / res["broadcast"]["total_s"]
        lines.append(f"- {res['preset']}, {res['receivers']} receiver(s): broadcast is {ratio:.2f}x the "
                     f"speed of the object-store copy, end to end ({res['broadcast']['bytes'] / 2**20:.1f} "
                     f"MiB moved once).")
    for res in results:
        b = res["broadcast"]
        lines.append(f"- {res['preset']}, {res['receivers']} receiver(s): broadcast bandwidth "
                     f"{b['bytes'] / b['total_s'] / 1e9:.3f} GB/s, end to end (load included).")
    if args.two_nodes:
        lines += ["", link_calibration(results, counts[0], presets, load[0], args.link_out)]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_docs:
        section = SECTION + ("_two_nodes" if args.two_nodes else "")
        title = "across two Ray nodes" if args.two_nodes else "object store vs broadcast"
        docs_section.write_section(section, f"## Weight sync: {title} (issue 8 item 5, issue 9 item 5)\n\n" + text)
    ratios = [r["object_store"]["total_s"] / r["broadcast"]["total_s"] for r in results]
    print(f"ratio: {min(ratios):.2f}")


if __name__ == "__main__":
    main()
