"""The driver: the Ray job's entrypoint side of a run.

It builds the placement, starts the rollout workers and one controller actor per data-parallel
rank, and then only watches: it drains small records from the controllers (scalar metrics,
phase spans, events, checkpoint notices), combines the ranks' scalars per step and hands them
to the reporters. It never sees a sample or a tensor. When a controller dies, the whole gang is
restarted from the newest checkpoint (the gradient all-reduce needs every rank), up to
`controller.max_restarts` times, and the run goes on.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from trainer.config import TrainerConfig
from trainer.placement.partial_colocate import SCORER_SHARE
from trainer.telemetry import Reporter

__all__ = ["Driver", "RunFailed", "combine_rank_metrics"]


class RunFailed(RuntimeError):
    """The run cannot go on (restarts exhausted, or a failure before the first step)."""


def combine_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from every controller, combined as a reader of one run expects.

    Throughput and token counts add up across ranks; phase times take the slowest rank (the
    step waits for it); group counts and weight bytes moved add up; everything else (rewards, losses, device metrics
    of distinct devices) is the mean over the ranks that report it. `sampling/refills_max` is the
    most refills any rank made (what the cost model reads as the step's generate calls).
    """
    keys: dict[str, list[float]] = defaultdict(list)
    for m in per_rank:
        for k, v in m.items():
            keys[k].append(v)
    out = {}
    for k, vs in keys.items():
        if (k.startswith(("throughput/", "tokens/")) or k.endswith("_groups")
                or k in ("reward/failed_batches", "weight_sync/bytes", "weight_sync/buckets")):
            out[k] = sum(vs)
        elif k.startswith("time/") or k == "sampling/staleness":
            out[k] = max(vs)
        else:
            out[k] = sum(vs) / len(vs)
    if "sampling/refills" in keys:
        # the step waits for the rank that refilled most (each refill is another generate call)
        out["sampling/refills_max"] = max(keys["sampling/refills"])
    return out


def _remote_classes() -> tuple[Any, Any]:
    import ray

    from trainer import rendezvous
    from trainer.controller import ControllerLoop, RolloutWorker

    @ray.remote(max_concurrency=4)
    class ControllerActor:
        def __init__(self, **kwargs: Any):
            self.loop = ControllerLoop(**kwargs)

        def pid(self) -> int:
            return os.getpid()

        def address(self) -> tuple[str, int]:
            # where a group this rank hosts meets: its store bound here now (trainer.rendezvous)
            return rendezvous.host()

        def run(self, master_addr: str, master_port: int) -> dict[str, Any]:
            # the engine stays open at the end: the driver kills this process once every
            # rank's result is in (Driver._stop_gang), so its shutdown would only delay that
            return self.loop.run(master_addr, master_port, close_engine=False)

        def drain(self) -> list[dict[str, Any]]:
            return self.loop.drain()

        def open_weight_broadcast(self, master_addr: str, master_port: int, receivers: list[Any],
                                  backend: str) -> None:
            self.loop.open_weight_broadcast(master_addr, master_port, receivers, backend)

        def request_stop(self) -> None:
            self.loop.request_stop()

    # one call at a time, in submission order: a weight update never races a generate
    RolloutActor = ray.remote(RolloutWorker)
    return ControllerActor, RolloutActor


class Driver:
    def __init__(self, cfg: TrainerConfig, run_dir: str | Path, *, reporter: Reporter,
                 on_step: Callable[[int, dict[str, float], Driver], None] | None = None,
                 on_message: Callable[[str], None] | None = None):
        from trainer.config import parse_config

        self.cfg = parse_config(resolve_paths(cfg.model_dump()))
        self.run_dir = Path(run_dir).resolve()
        self.reporter = reporter
        self.on_step = on_step
        self.on_message = on_message or (lambda msg: None)
        self.controllers: list[Any] = []
        self.rollout_workers: list[Any] = []
        self.reward_scorers: list[Any] = []
        self.restarts = 0
        self.resumed_from: list[int] = []
        self._pending: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
        self._step_metrics: dict[int, dict[str, float]] = {}
        # the newest step whose reports (every rank's) were taken and logged, and the checkpoint
        # records held until their step is: a restart resumes from no newer checkpoint
        self._reported_step = 0
        self._held_checkpoints: list[dict[str, Any]] = []
        self._started_running = False
        self._proc = psutil.Process()
        # bytes of pickled payloads this process received / sent (driver/bytes_* per step)
        self._bytes_in = self._bytes_out = 0
        self._bytes_mark = (0, 0)
        self._cost_fit: Any = None  # the placement cost model, refitted as steps come in
        self._planner: Any = None  # placement.mode=auto: trainer.placement.auto.AutoPlanner
        self.replans: list[dict[str, Any]] = []  # switches applied: step, from, to

    # ------------------------------------------------------------------ public
    def run(self) -> dict[str, Any]:
        """Train to the end; returns the summary (also written to summary.json)."""

        from trainer import checkpoint as ckpt
        from trainer.models import ensure_model
        from trainer.placement import build_placement
        from trainer.placement.link import config_link_calibration

        t_start = time.time()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            # a link calibration that cannot be read fails the run before anything starts
            config_link_calibration(self.cfg)
            model_dir = str(ensure_model(self.cfg).resolve())
            cfg_json = self.cfg.model_dump_json()
            placement = build_placement(self.cfg)
            if self.cfg.placement.mode == "auto":
                cfg_json = self._start_auto(model_dir)
        except Exception as exc:
            self._fail(f"{type(exc).__name__}: {exc}")
            raise
        plan = placement.plan
        start_data = placement.to_event()  # with the node of each device on several nodes
        if self._planner is not None:
            start_data.update({"decision": "start", "switch": False, "plan": self._planner_label(),
                               "candidates": [{"plan": self._planner_label(lay), "fits": fits}
                                              for lay, fits in self._planner.candidates]})
        self.reporter.log_event("placement", f"{'auto: profiling in ' if self._planner else ''}"
                                f"{plan.mode} on {plan.devices} {plan.device_type} "
                                f"devices, {len(plan.train_devices)} controller(s)", start_data)
        for w in placement.warnings:
            self.reporter.log_event("warning", w, {})
        resume = ckpt.latest_checkpoint(self.run_dir)
        if resume is not None:
            self.reporter.log_event("restart", f"resuming from {resume.name}",
                                    {"resume_step": ckpt.step_of(resume),
                                     "attempt": os.environ.get("YATT_ATTEMPT")})
            self._reported_step = ckpt.step_of(resume)
            self.resumed_from.append(self._reported_step)
        ControllerActor, RolloutActor = _remote_classes()
        results: list[dict[str, Any]] = []
        try:
            while True:
                try:
                    self._start_gang(placement, ControllerActor, RolloutActor, cfg_json, model_dir)
                    results = self._watch()
                    if not (results and results[0].get("stopped")):
                        break
                    # every rank stopped after the same step, checkpointed: re-plan and go on
                    self._stop_gang()
                    placement, cfg_json = self._apply_switch(placement, int(results[0]["step"]))
                    continue
                except _ControllerDied as died:
                    self._stop_gang()
                    self.restarts += 1
                    if self.restarts > self.cfg.controller.max_restarts:
                        raise RunFailed(f"controller {died.rank} failed and "
                                        f"controller.max_restarts={self.cfg.controller.max_restarts} "
                                        f"restarts are used up: {died.reason}") from None
                    # the dead gang may have checkpointed steps whose reports it never handed
                    # over: resume from the newest checkpoint reported through, drop newer ones
                    latest = ckpt.latest_checkpoint(self.run_dir, at_most=self._reported_step)
                    step = ckpt.step_of(latest) if latest else 0
                    discarded = ckpt.discard_after(self.run_dir, step)
                    self.resumed_from.append(step)
                    self._pending.clear()
                    self._held_checkpoints.clear()
                    self._reported_step = step
                    if self._planner is not None and self._planner.pending is not None:
                        placement, cfg_json = self._apply_switch(placement, step)  # asked for before it died
                    msg = (f"controller {died.rank} failed ({died.reason}); restart "
                           f"{self.restarts}/{self.cfg.controller.max_restarts} from "
                           f"{'step ' + str(step) if latest else 'the beginning'}")
                    self.on_message(msg)
                    self.reporter.log_event("restart", msg, {"rank": died.rank, "restart": self.restarts,
                                                             "resume_step": step,
                                                             "discarded_checkpoints": discarded,
                                                             "reason": died.reason[:2000]})
        except Exception as exc:
            self._stop_gang()
            placement.remove()
            self._fail(str(exc))
            raise
        self._stop_gang()
        placement.remove()
        summary = self._summary(results, t_start)
        self.reporter.write_summary(summary)
        self.reporter.set_state("succeeded", summary=summary)
        return summary

    # ------------------------------------------------------------------ the gang
    def _start_gang(self, placement: Any, ControllerActor: Any, RolloutActor: Any, cfg_json: str,
                    model_dir: str) -> None:
        import ray

        plan = placement.plan
        env = {"YATT_RUN_DIR": str(self.run_dir)}
        from trainer.rollout.decode_delay import ENV_VAR

        if os.environ.get(ENV_VAR):  # the documented slow-down reaches the actors on any cluster
            env[ENV_VAR] = os.environ[ENV_VAR]
        workers = {}
        for d in plan.rollout_devices:
            workers[d] = RolloutActor.options(**placement.actor_options(d, env)).remote(
                cfg_json, d, model_dir, plan.device_type, plan.cpus_per_device)
        self.rollout_workers = list(workers.values())
        scorers = self._start_scorers(placement, cfg_json, env)
        world = len(plan.train_devices)
        self.controllers = [
            ControllerActor.options(**placement.actor_options(
                d, env, share=(1 - SCORER_SHARE) if d in scorers else 1.0)).remote(
                cfg_json=cfg_json, rank=r, world=world, device=d, device_type=plan.device_type,
                cores=plan.cpus_per_device, run_dir=str(self.run_dir),
                rollout_workers=[(w, workers[w]) for w in plan.rollout_assignment[r]],
                local_sampler=d in plan.local_sampler_devices, model_dir=model_dir,
                reward_scorers=list(scorers.items()),
                stoppable=self._planner is not None,
                # auto: one prompt shard per device, so any world size continues every shard
                prompt_shards=plan.devices if self._planner is not None else 0)
            for r, d in enumerate(plan.train_devices)
        ]
        try:
            addr, port = ray.get(self.controllers[0].address.remote(), timeout=600)
        except ray.exceptions.RayActorError as exc:
            # placed on a node that died before Ray noticed: a restart like any other, not the end
            raise _ControllerDied(0, f"{type(exc).__name__}: {_short(exc)}") from None
        if self.rollout_workers:  # controller 0 broadcasts each new policy to every worker
            from trainer.weight_sync import connect_broadcast

            connect_broadcast(self.controllers[0], self.rollout_workers,
                              backend="nccl" if plan.device_type == "gpu" else "gloo")
        self._runs = {c.run.remote(addr, port): r for r, c in enumerate(self.controllers)}

    def _start_scorers(self, placement: Any, cfg_json: str, env: dict[str, str]) -> dict[int, Any]:
        """partial_colocate: one reward scorer per scoring device, beside that device's controller."""
        import ray

        from trainer.rewards.scorer import RewardScorer

        plan = placement.plan
        ScorerActor = ray.remote(RewardScorer)  # one call at a time: its mailbox is the queue
        scorers = {d: ScorerActor.options(**placement.actor_options(d, env, share=SCORER_SHARE)).remote(
                       cfg_json, d, plan.cpus_per_device)
                   for d in plan.reward_devices}
        self.reward_scorers = list(scorers.values())
        return scorers

    def _stop_gang(self) -> None:
        import ray

        for handle in self.controllers + self.rollout_workers + self.reward_scorers:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:
                pass
        self.controllers, self.rollout_workers, self.reward_scorers = [], [], []

    def _watch(self) -> list[dict[str, Any]]:
        import ray

        results: dict[int, dict[str, Any]] = {}
        pending = dict(self._runs)
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
            self._drain(failed_ok=False)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except Exception as exc:
                    self._drain(failed_ok=True)
                    # A peer of a dead controller fails too (its all-reduce breaks): name the dead one.
                    dead = self._dead_ranks()
                    culprit = dead[0] if dead else rank
                    raise _ControllerDied(culprit, f"{type(exc).__name__}: {_short(exc)}") from None
        self._drain(failed_ok=True)
        return [results[r] for r in sorted(results)]

    def _dead_ranks(self) -> list[int]:
        import ray

        dead = []
        for rank, c in enumerate(self.controllers):
            try:
                ray.get(c.pid.remote(), timeout=10)
            except Exception:
                dead.append(rank)
        return dead

    def _drain(self, *, failed_ok: bool) -> None:
        import ray

        for rank, c in enumerate(self.controllers):
            try:
                records = ray.get(c.drain.remote(), timeout=60)
            except Exception as exc:
                if failed_ok:
                    continue
                raise _ControllerDied(rank, f"{type(exc).__name__}: {_short(exc)}") from None
            for rec in records:
                self._bytes_in += len(pickle.dumps(rec, protocol=5))  # counted into its own step
                self._handle(rec)

    # ------------------------------------------------------------------ records
    def _handle(self, rec: dict[str, Any]) -> None:
        kind = rec["type"]
        if kind == "event":
            if rec["kind"] == "resume":
                return  # each rank resumes; rank 0's "restart" event says it once
            self.reporter.log_event(rec["kind"], rec["message"], rec["data"])
            if rec["kind"] in ("eval", "warning", "restart", "warm_start"):
                self.on_message(rec["message"])
        elif kind == "progress":
            if rec["rank"] == 0:
                if rec.get("metrics"):
                    self.reporter.log_warm_start(rec["step"], rec["metrics"])
                if rec.get("print", True):
                    self.on_message(rec["message"])
        elif kind == "checkpoint":
            self._held_checkpoints.append(rec)  # logged once its step is (_release_checkpoints)
            self._release_checkpoints()
        elif kind == "metrics":
            step = rec["step"]
            self._pending[step][rec["rank"]] = rec
            if len(self._pending[step]) == len(self.controllers):
                self._complete_step(step, self._pending.pop(step))

    def _release_checkpoints(self) -> None:
        """Log the checkpoints whose step every rank has reported: a restart may discard a newer
        one (see `checkpoint.discard_after`), and the API must not list what is gone."""
        ready = [r for r in self._held_checkpoints if r["step"] <= self._reported_step]
        self._held_checkpoints = [r for r in self._held_checkpoints if r["step"] > self._reported_step]
        for rec in ready:
            self.reporter.log_checkpoint(rec["step"], rec["path"], rec["size_bytes"], rec["metrics"])

    def _complete_step(self, step: int, per_rank: dict[int, dict[str, Any]]) -> None:
        metrics = combine_rank_metrics([r["metrics"] for r in per_rank.values()])
        if step > 0:
            metrics["driver/rss_mb"] = self._proc.memory_info().rss / 2**20
            metrics["driver/rss_peak_mb"] = max(metrics["driver/rss_mb"],  # the kernel's mark lags
                                                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            metrics["driver/bytes_in"] = float(self._bytes_in - self._bytes_mark[0])
            metrics["driver/bytes_out"] = float(self._bytes_out - self._bytes_mark[1])
            metrics["controller/restarts"] = float(self.restarts)
            if self._cost_fit is None:
                from trainer.placement.cost_model import OnlineFit

                self._cost_fit = OnlineFit.for_config(self.cfg) or False
            if self._cost_fit:
                metrics.update(self._cost_fit.observe(step, metrics))
            if self._planner is not None:
                self._plan_step(step, metrics)
        self._bytes_mark = (self._bytes_in, self._bytes_out)
        if step > 0 and not self._started_running:
            self._started_running = True
            self.reporter.set_state("running")
        self._step_metrics[step] = metrics
        self.reporter.log_metrics(step, metrics)
        self._reported_step = max(self._reported_step, step)
        self._release_checkpoints()
        spans = [s for r in per_rank.values() for s in r.get("spans", [])]
        if spans:
            # a few scored samples ride along, so a reader can check what the reward said
            scored = [s for r in per_rank.values() for s in r.get("scored_samples", [])]
            self.reporter.log_event("phase_spans", f"step {step}",
                                    {"step": step, "spans": spans, "scored_samples": scored})
        if self.on_step is not None and step > 0:
            self.on_step(step, metrics, self)

    # ------------------------------------------------------------------ placement.mode=auto
    def _start_auto(self, model_dir: str) -> str:
        """Set up the planner and the cost model for the plan auto starts in; its config's JSON."""
        from trainer.placement.auto import AutoPlanner, layout_config
        from trainer.placement.cost_model import OnlineFit

        planner = AutoPlanner(self.cfg, param_bytes=_param_bytes(self.cfg, model_dir))
        self._planner = planner
        self._cost_fit = OnlineFit(planner.layout, param_bytes=planner.param_bytes, link=planner.link)
        return layout_config(self.cfg, planner.layout).model_dump_json()

    def _planner_label(self, layout: Any = None) -> str:
        from trainer.placement.auto import layout_label

        return layout_label(layout or self._planner.layout)

    def _plan_step(self, step: int, metrics: dict[str, float]) -> None:
        """Feed the planner one step; log its decisions and ask the gang to stop for a switch."""
        planner = self._planner
        metrics["placement/train_devices"] = float(planner.layout.train_pool)
        metrics["placement/rollout_devices"] = float(planner.layout.rollout_pool)
        for decision in planner.observe(step, metrics):
            self.reporter.log_event("placement", decision.message(), decision.to_event())
            self.on_message(decision.message())
            if decision.switch:
                for c in self.controllers:
                    c.request_stop.remote()

    def _apply_switch(self, placement: Any, step: int) -> tuple[Any, str]:
        """The placement and controller config of the plan the planner asked for, resuming at `step`."""
        from dataclasses import replace

        from trainer.placement.auto import layout_config
        from trainer.placement.plan import plan_placement

        planner = self._planner
        new = planner.pending
        if new is None:
            raise RunFailed(f"the controllers stopped at step {step} but no re-plan was asked for")
        planner.stopping()
        cfg = layout_config(self.cfg, new)
        # the placement group holds one identical bundle per device: only the roles move
        placement = replace(placement, plan=plan_placement(cfg, device_type=placement.plan.device_type))
        before = self._planner_label()
        planner.switched(new, step)
        self._cost_fit.layout = new
        self._pending.clear()
        self.replans.append({"step": step, "from": before, "to": self._planner_label()})
        msg = f"placement switched from {before} to {self._planner_label()} after step {step}"
        self.on_message(msg)
        self.reporter.log_event("placement", msg, {
            "decision": "applied", "switch": True, "step": step, "resume_step": step,
            "plan": self._planner_label(), "from": before, **placement.to_event()})
        return placement, cfg.model_dump_json()

    # ------------------------------------------------------------------ the end
    def _summary(self, results: list[dict[str, Any]], t_start: float) -> dict[str, Any]:
        ev = results[0]["eval"] if results else {}
        steps = sorted(s for s in self._step_metrics if s > 0)
        summary: dict[str, Any] = {
            "steps": results[0]["step"] if results else 0,
            "wall_time_s": time.time() - t_start,
            "restarts": self.restarts,
            "resumed_from_steps": self.resumed_from,
            "algorithm": self.cfg.algorithm.name,
            "placement": self.cfg.placement.mode,
            "controller": self.cfg.controller.mode,
            "rollout_engine": self.cfg.rollout.engine,
            "run_dir": str(self.run_dir),
        }
        if self._planner is not None:
            summary["placement_plan"] = self._planner_label()
            summary["placement_switches"] = self.replans
        for k, v in ev.items():
            summary[f"eval/{k}"] = v
        if steps:
            def mean(key: str) -> float:
                vals = [self._step_metrics[s][key] for s in steps if key in self._step_metrics[s]]
                return sum(vals) / len(vals) if vals else 0.0

            keys = {k for s in steps for k in self._step_metrics[s]}
            for k in sorted(keys):
                if k.startswith(("throughput/", "time/")):
                    summary[f"{k}_mean"] = mean(k)
            last = self._step_metrics[steps[-1]]
            for k in ("reward/mean", "loss/policy", "kl/mean", "entropy", "grad_norm", "lr"):
                if k in last:
                    summary[f"last/{k}"] = last[k]
            summary["reward/mean_first"] = self._step_metrics[steps[0]].get("reward/mean")
        if (self.run_dir / "final").exists():
            summary["final_model"] = str(self.run_dir / "final")
        return summary

    def _fail(self, reason: str) -> None:
        self.reporter.log_event("warning", f"run failed: {reason}", {})
        self.reporter.set_state("failed", reason=reason[:4000])
        try:
            (self.run_dir / "error.txt").write_text(reason)
        except OSError:
            pass


class _ControllerDied(Exception):
    def __init__(self, rank: int, reason: str):
        super().__init__(reason)
        self.rank, self.reason = rank, reason


def _param_bytes(cfg: TrainerConfig, model_dir: str) -> float:
    """Bytes of the policy's weights: from its shape, else the size of its weight files."""
    from trainer.placement.memory import DTYPE_BYTES, model_shape

    shape = model_shape(cfg)
    if shape is not None:
        return float(shape.params * DTYPE_BYTES[cfg.model.dtype])
    return float(sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")))


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) < 3000 else text[:1500] + " … " + text[-1500:]


def resolve_paths(data: dict[str, Any], base: Path | None = None) -> dict[str, Any]:
    """Make relative model/data paths (and a link calibration's) absolute, so actors with another
    working dir find them."""
    base = base or Path.cwd()
    out = json.loads(json.dumps(data))
    model = out.setdefault("model", {})
    path = model.get("path", ".yatt/models/arith-micro")
    if path.startswith((".", "/")) or (base / path).exists() or model.get("preset"):
        model["path"] = str((base / path).resolve())
    d = out.get("data", {})
    for key in ("path", "eval_path"):
        if d.get(key) and (base / d[key]).exists():
            d[key] = str((base / d[key]).resolve())
    p = out.get("placement", {})
    if p.get("link_calibration"):
        p["link_calibration"] = str((base / p["link_calibration"]).resolve())
    return out
