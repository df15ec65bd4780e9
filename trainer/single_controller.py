"""The single-controller baseline (`controller.mode: single`): the driver holds the RL loop.

yatt's default is the YATT parallel-controller model: the driver only starts and watches one
controller per data-parallel rank, and each controller runs the whole loop for its shard. The
verl/HybridFlow design puts that loop in one process instead. This module is that design, kept
as a faithful baseline so the difference can be measured: the same placement plan, devices,
rank count, samplers, learner and algorithm as the parallel mode; only the control flow (and so
what passes through the driver) differs.

```
 parallel (default)                           single (this module)

 driver ── start, watch, drain scalars        driver ── prompts ──► rank r's sampler(s)
   │                                            ▲  ◄── samples ──────┘   (every sample)
   ├─► controller 0 ─┐  prompts → rollout       │  rewards, dynamic sampling, batch split
   │    (rank 0)     │  → reward → batch        │  ── batch shard r ──► training rank r
   │                 │  → rl_step ◄─ all-reduce │  ◄── rank metrics ─────┘   (all-reduce
   └─► controller 1 ─┘  → push weights          │                         between ranks)
        (rank 1)          → scalars ─► driver   └─ "push weights" ─► ranks ─► their samplers
```

Per step the driver of this mode sends every prompt to the sampler of the rank that owns it
(rank r's shard of the prompts, as in parallel mode, so both modes see the same data), receives
every sample, scores them with the reward function, runs dynamic sampling over the whole batch,
splits the kept groups into one shard per rank, sends each rank its shard, and gathers the
ranks' training metrics. Advantages are computed inside `Learner.rl_step` on each rank, the
code path both modes share: a group-relative advantage needs only its own group's scores and
groups are never split across ranks, so where it runs changes no number, and one code path
keeps the algorithm identical. (verl also brings per-token old/reference log-probs back to the
driver; this baseline does not, so its driver traffic is a lower bound of verl's.) Weights go
from each rank to its own samplers, never through the driver, as in verl's hybrid engine.

Checked on 2026-11-30 with `yatt train configs/demo-arithmetic.yaml` (seed 0, vLLM, 2 devices)
in both modes: the same reward and policy loss at every one of the 100 steps, held-out accuracy
65.6% → 94.9% in both; the single driver carried 18 KB per step against the parallel one's 3 KB
(8 prompts × 8 samples × ≤8 tokens per rank); bench/controller_scaling.py measures larger batches.

Everything the driver sends or receives travels as a pickled payload whose length is counted:
`driver/bytes_in` and `driver/bytes_out` per step are exact, in both modes (the parallel driver
counts the pickled records it drains).
"""

from __future__ import annotations

import math
import os
import pickle
import random
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from trainer.driver import Driver, _ControllerDied, _short
from trainer.placement.plan import PlacementPlan
from trainer.weight_sync import TrainerWeightSync, sampler_wire_dtype

__all__ = ["SingleControllerDriver", "TrainingRank", "pack_payload", "unpack_payload",
           "split_evenly", "step_overhead"]

# The phases a step's wall time is made of; the rest is control-flow overhead.
OWN_PHASES = ("rollout", "reward", "train", "reference", "weight_sync", "eval", "checkpoint")


def pack_payload(obj: Any) -> bytes:
    """What crosses a process boundary in single mode: one pickle, so its length is its cost."""
    return pickle.dumps(obj, protocol=5)


def unpack_payload(data: bytes) -> Any:
    return pickle.loads(data)


def split_evenly(items: list[Any], parts: int) -> list[list[Any]]:
    """`items` cut into `parts` contiguous shares whose sizes differ by at most one."""
    k = len(items)
    sizes = [k // parts + (1 if i < k % parts else 0) for i in range(parts)]
    out, start = [], 0
    for size in sizes:
        out.append(items[start : start + size])
        start += size
    return out


def step_overhead(metrics: dict[str, float]) -> float:
    """Step time minus the phases' own time (`time/*` as both modes report them)."""
    own = sum(metrics.get(f"time/{p}", 0.0) for p in OWN_PHASES)
    return max(0.0, metrics.get("time/step", 0.0) - own)


class TrainingRank:
    """One data-parallel training rank that does what the driver tells it (a Ray actor's body).

    It holds the same parts as a parallel controller — a `Learner` in the ranks' gradient
    all-reduce group, and in colocate mode its own sampler — but no loop: the driver calls
    `generate`, `train`, `push_weights`, ... one at a time, with pickled payloads.
    """

    def __init__(self, cfg_json: str, *, rank: int, world: int, device: int, device_type: str,
                 cores: float, run_dir: str, rollout_workers: list[tuple[int, Any]],
                 local_sampler: bool, model_dir: str):
        import json

        import torch

        from trainer.config import parse_config
        from trainer.host_memory import steady_heap
        from trainer.telemetry import DeviceMonitor

        steady_heap()
        self.cfg = parse_config(json.loads(cfg_json))
        self.rank, self.world, self.device = rank, world, device
        self.device_type, self.cores = device_type, cores
        self.run_dir = Path(run_dir)
        self.rollout_workers = rollout_workers
        self.local_sampler = local_sampler
        self.model_dir = model_dir
        self.monitor = DeviceMonitor(device, device_type=device_type, cores=cores)
        self.weight_sync = TrainerWeightSync(
            device=device, bucket_bytes=int(self.cfg.rollout.weight_sync_bucket_mb * 2**20),
            wire_dtype=sampler_wire_dtype(self.cfg, device_type))
        torch.set_num_threads(max(1, int(cores)))

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        """Where a group this rank hosts meets (its store bound here now, `trainer.rendezvous`)."""
        from trainer import rendezvous

        return rendezvous.host()

    def open_weight_broadcast(self, master_addr: str, master_port: int, receivers: list[Any],
                              backend: str) -> None:
        """Make this rank the source of the weight broadcast to every rollout worker."""
        self.weight_sync.open_broadcast(master_addr, master_port, receivers, backend=backend)

    # ------------------------------------------------------------------ set-up (as a controller)
    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the all-reduce group, load the policy (from the newest checkpoint if any) and the
        sampler, in the same order as a parallel controller (so the same seeds draw the same
        numbers). Returns the EOS id and, when resuming, this rank's stream position and sampler state."""
        import torch

        from trainer import checkpoint as ckpt
        from trainer.learner import DataParallelGroup, Learner

        cfg = self.cfg
        threads = max(1, int(self.cores))
        torch.manual_seed(cfg.seed + self.rank)
        random.seed(cfg.seed + self.rank)
        self.group = None
        if self.world > 1:
            self.group = DataParallelGroup(master_addr, master_port, self.rank, self.world,
                                           backend="nccl" if self.device_type == "gpu" else "gloo")
        resume = ckpt.latest_checkpoint(self.run_dir)
        model_dir = str(resume / "policy") if resume else self.model_dir
        self.learner = Learner(cfg, model_dir, device="cuda" if self.device_type == "gpu" else "cpu",
                               dist_group=self.group)
        record: dict[str, Any] = {"eos_id": self.learner.eos_id}
        if resume is not None:
            lr = self.learner
            ckpt.load_shared(resume, optimizer=lr.optimizer, scheduler=lr.scheduler,
                             critic=lr.critic, critic_opt=lr.critic_opt, reference=lr.reference)
            mine = ckpt.load_rank(resume, self.rank)
            if mine is not None:
                ckpt.set_rng_state(mine["rng"])
                record.update(position=mine["position"], sampling=mine["sampling"])
        self.engine = None
        if self.local_sampler:
            from trainer.rollout import make_engine

            self.engine = make_engine(cfg, model_dir, threads=threads, seed=cfg.seed + 101 * self.device)
        self.weight_sync.engine = self.engine
        return record

    # ------------------------------------------------------------------ warm start
    def warm_start_begin(self, lr: float) -> None:
        import torch

        self._sft_opt = torch.optim.AdamW(self.learner.policy.parameters(), lr=lr)

    def sft_step(self, payload: bytes) -> bytes:
        prompts, targets = unpack_payload(payload)
        return pack_payload(self.learner.sft_step(prompts, targets, self._sft_opt))

    def warm_start_end(self) -> None:
        if self.learner.reference is not None:  # KL is measured from the warmed-up policy
            self.learner.reference.load_state_dict(self.learner.policy.state_dict())
        self._sft_opt = None

    # ------------------------------------------------------------------ the step's parts
    def generate(self, payload: bytes) -> bytes:
        """Samples for the prompts in `payload` from this rank's own (colocated) sampler."""
        prompts, n = unpack_payload(payload)
        assert self.engine is not None, "generate() needs a colocated sampler"
        if hasattr(self.engine, "wake"):
            self.engine.wake()
        start = time.time()
        samples = self.engine.generate(prompts, n)
        return pack_payload({"samples": samples, "spans": [self._span("rollout", start)]})

    def train(self, payload: bytes) -> bytes:
        """One `Learner.rl_step` on this rank's shard (gradients all-reduced with the others)."""
        from trainer.telemetry import PhaseRecorder

        batch = unpack_payload(payload)
        if self.engine is not None and hasattr(self.engine, "sleep"):
            self.engine.sleep()  # colocated: free the KV cache while the policy trains
        recorder = PhaseRecorder(self.device)
        with recorder.span("train"):
            metrics = self.learner.rl_step(batch, recorder=recorder)
        return pack_payload({"metrics": metrics, "spans": [s.to_dict() for s in recorder.take()],
                             "device_metrics": self.monitor.sample()})

    def sft_train(self, payload: bytes) -> bytes:
        """One step of `algorithm: sft` (the run's own optimizer and schedule)."""
        prompts, targets = unpack_payload(payload)
        start = time.time()
        m = self.learner.sft_step(prompts, targets, self.learner.optimizer)
        m["lr"] = self.learner.scheduler.get_last_lr()[0]
        self.learner.scheduler.step()
        return pack_payload({"metrics": m, "spans": [self._span("train", start)],
                             "device_metrics": self.monitor.sample()})

    def push_weights(self, version: int) -> dict[str, Any]:
        """New weights into the samplers (trainer.weight_sync: in place into this rank's own, and
        from the source rank one broadcast to every rollout worker). Returns this push's
        `weight_sync/*` metrics and the spans of the syncs finished so far."""
        metrics: dict[str, float] = {}
        spans: list[dict[str, Any]] = []
        if self.weight_sync.has_destination:
            metrics, spans = self.weight_sync.push(version,
                                                   lambda: self.learner.named_weights().items())
        return {"metrics": metrics, "spans": spans + self.weight_sync.receiver_spans()}

    def greedy(self, payload: bytes) -> bytes:
        prompts, max_new_tokens = unpack_payload(payload)
        start = time.time()
        texts = self.learner.greedy(prompts, max_new_tokens)
        return pack_payload({"texts": texts, "spans": [self._span("eval", start)]})

    def save(self, path: str, position: int, sampling: dict[str, float]) -> int:
        """This rank's part of a checkpoint (rank 0 also writes the shared part)."""
        from trainer import checkpoint as ckpt

        p = Path(path)
        lr = self.learner
        if self.rank == 0:
            ckpt.save_shared(p, policy=lr.policy, tokenizer=lr.tokenizer, optimizer=lr.optimizer,
                             scheduler=lr.scheduler, critic=lr.critic, critic_opt=lr.critic_opt,
                             reference=lr.reference)
        ckpt.save_rank(p, self.rank, {"position": position, "sampling": sampling,
                                      "rng": ckpt.rng_state()})
        return self.rank

    def export_final(self, path: str) -> None:
        from trainer import checkpoint as ckpt

        ckpt.export_final(Path(path), policy=self.learner.policy, tokenizer=self.learner.tokenizer)

    def _span(self, phase: str, start: float) -> dict[str, Any]:
        return {"device": self.device, "phase": phase, "start": start, "end": time.time()}


def _rollout_worker_class() -> Any:
    from trainer.controller import RolloutWorker

    class PayloadRolloutWorker(RolloutWorker):
        """A disaggregated rollout worker that the driver talks to with counted payloads."""

        def generate_payload(self, payload: bytes) -> bytes:
            prompts, n = unpack_payload(payload)
            out = self.generate(prompts, n)
            out.pop("device_metrics", None)
            return pack_payload(out)

    return PayloadRolloutWorker


@dataclass
class _Draw:
    """Prompts sent to the samplers and not yet collected, by rank."""

    examples: list[list[Any]]  # per rank
    refs: list[list[tuple[list[Any], Any]]]  # per rank: (its examples, the pending payload)
    version: int


@dataclass
class _StepLog:
    spans: list[dict[str, Any]] = field(default_factory=list)
    reward_time: float = 0.0
    reward_failures: int = 0
    staleness: int = 0


class SingleControllerDriver(Driver):
    """The `Driver` of `controller.mode: single`: same placement, restarts and reporting, but
    `_watch` runs the RL loop itself instead of watching controllers (see the module doc)."""

    # ------------------------------------------------------------------ the gang
    def _start_gang(self, placement: Any, ControllerActor: Any, RolloutActor: Any, cfg_json: str,
                    model_dir: str) -> None:
        import ray

        plan: PlacementPlan = placement.plan
        self.plan = plan
        env = {"YATT_RUN_DIR": str(self.run_dir)}
        worker_cls = ray.remote(_rollout_worker_class())
        workers = {}
        for d in plan.rollout_devices:
            workers[d] = worker_cls.options(**placement.actor_options(d, env)).remote(
                cfg_json, d, model_dir, plan.device_type, plan.cpus_per_device)
        self.rollout_workers = list(workers.values())
        self._workers_of = [[(w, workers[w]) for w in plan.rollout_assignment[r]]
                            for r in range(len(plan.train_devices))]
        rank_cls = ray.remote(TrainingRank)
        world = len(plan.train_devices)
        self.controllers = [
            rank_cls.options(**placement.actor_options(d, env)).remote(
                cfg_json, rank=r, world=world, device=d, device_type=plan.device_type,
                cores=plan.cpus_per_device, run_dir=str(self.run_dir),
                rollout_workers=self._workers_of[r],
                local_sampler=d in plan.local_sampler_devices, model_dir=model_dir)
            for r, d in enumerate(plan.train_devices)
        ]
        self._master = ray.get(self.controllers[0].address.remote(), timeout=600)
        if self.rollout_workers:  # rank 0 broadcasts each new policy to every worker
            from trainer.weight_sync import connect_broadcast

            connect_broadcast(self.controllers[0], self.rollout_workers,
                              backend="nccl" if plan.device_type == "gpu" else "gloo")

    def _watch(self) -> list[dict[str, Any]]:
        try:
            return self._loop()
        except _ControllerDied:
            raise
        except Exception as exc:
            import ray

            if not isinstance(exc, ray.exceptions.RayError):
                self.reporter.log_event("warning", f"single controller failed: {exc}",
                                        {"traceback": traceback.format_exc()[-4000:]})
                raise
            dead = self._dead_ranks()
            raise _ControllerDied(dead[0] if dead else 0, f"{type(exc).__name__}: {_short(exc)}") from None

    # ------------------------------------------------------------------ counted calls
    def _send(self, obj: Any) -> bytes:
        data = pack_payload(obj)
        self._bytes_out += len(data)
        return data

    def _receive(self, ref: Any) -> Any:
        import ray

        data = ray.get(ref)
        self._bytes_in += len(data)
        return unpack_payload(data)

    def _call_all(self, method: str, payloads: list[bytes]) -> list[Any]:
        refs = [getattr(c, method).remote(p) for c, p in zip(self.controllers, payloads, strict=True)]
        return [self._receive(r) for r in refs]

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> list[dict[str, Any]]:
        import ray

        from trainer import checkpoint as ckpt
        from trainer.controller import PromptStream
        from trainer.data import load_task
        from trainer.rewards import build_reward
        from trainer.sampling import DynamicSampler

        cfg = self.cfg
        world = len(self.controllers)
        self.world = world
        addr, port = self._master
        records = ray.get([c.setup.remote(addr, port) for c in self.controllers])
        self._eos_id = int(records[0]["eos_id"])
        self.train_examples, eval_examples = load_task(cfg)
        evals = eval_examples[: cfg.eval.size]
        self.can_eval = bool(evals) and all(e.answer is not None for e in evals)
        self.eval_examples = evals
        self.reward_fn = build_reward(cfg)
        # the same per-rank prompt shards a parallel controller reads, held here
        self.streams = [PromptStream(self.train_examples, rank=r, world=world, seed=cfg.seed, salt="rl")
                        for r in range(world)]
        self.sampler = DynamicSampler.from_config(cfg.sampling)
        self.state: dict[str, Any] = {"step": 0, "eval": {}, "warm_start_done": False}
        resume = ckpt.latest_checkpoint(self.run_dir)
        if resume is not None:
            self.state = ckpt.read_trainer_state(resume)
            for r, rec in enumerate(records):
                if "position" in rec:
                    self.streams[r].position = rec["position"]
                    self.sampler.load_state_dict(rec["sampling"])
        self._warm_start()
        self._push_weights(self.state["step"])
        if "accuracy_start" not in self.state["eval"]:
            self._evaluate("start")
        n = cfg.rollout.n
        overlap = self.plan.overlap and not self.plan.local_sampler_devices
        prefetch: deque[_Draw] = deque()
        for step in range(self.state["step"] + 1, cfg.train.max_steps + 1):
            t0 = time.time()
            self._log = _StepLog()
            metrics: dict[str, float] = {}
            train_results: list[dict[str, Any]]
            if cfg.algorithm.name == "sft":
                from trainer.data import sft_target

                batches = [s.take(cfg.train.batch_size // world) for s in self.streams]
                train_results = self._call_all("sft_train", [
                    self._send(([e.prompt for e in b], [sft_target(e) for e in b])) for b in batches])
                drawn_samples: list[Any] = []
                samples_n = sum(len(b) for b in batches)
                rewards_all: list[float] = []
            else:
                from trainer.learner import RLBatch

                self._drawn: list[Any] = []
                first = None
                if prefetch:
                    first = self._collect(prefetch.popleft(), step)
                    self._drawn.extend(first)
                groups, smetrics = self.sampler.fill(cfg.train.batch_size,
                                                     partial(self._draw, step=step), first=first)
                metrics.update(smetrics)
                if overlap:  # the next rollouts run on the rollout pool while the ranks train
                    while len(prefetch) < cfg.placement.staleness and step + len(prefetch) < cfg.train.max_steps:
                        prefetch.append(self._submit(self.sampler.request_size(cfg.train.batch_size), step))
                payloads = []
                for share in split_evenly(groups, world):
                    samples = [s for g in share for s in g.samples]
                    payloads.append(self._send(RLBatch(
                        prompt_ids=[list(s.prompt_ids) for s in samples],
                        response_ids=[list(s.response_ids) or [self._eos_id] for s in samples],
                        scores=[r for g in share for r in g.rewards], n=n,
                        truncated=[s.finish_reason == "length" for s in samples],
                        # the behaviour policy, as the parallel controllers train on it
                        sample_logprobs=[list(s.logprobs) for s in samples],
                        staleness=[g.extra.get("staleness", 0) for g in share for _ in g.samples])))
                train_results = self._call_all("train", payloads)
                drawn_samples = [s for g in self._drawn for s in g.samples]
                rewards_all = [r for g in self._drawn for r in g.rewards]
                samples_n = len(drawn_samples)
            for res in train_results:
                self._log.spans.extend(res["spans"])
            metrics.update(self._push_weights(step))
            metrics.update(self._combine_train(train_results))
            if drawn_samples:
                metrics.update(_sample_metrics(drawn_samples, rewards_all))
            if cfg.algorithm.name != "sft":
                metrics["reward/failed_batches"] = float(self._log.reward_failures)
                metrics["sampling/staleness"] = float(self._log.staleness)
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < cfg.train.max_steps:
                acc = self._evaluate(f"step_{step}")
                if acc is not None:
                    metrics["eval/accuracy"] = acc
            t1 = time.time()
            gen_tokens = sum(len(s.response_ids) for s in drawn_samples)
            metrics.update(self._timing(t0, t1, gen_tokens, samples_n,
                                        metrics.pop("trained_tokens", 0.0), train_results))
            self.state["step"] = step
            spans = self._log.spans
            last = step == cfg.train.max_steps
            self._complete_step(step, {0: {"metrics": metrics, "spans": spans}})
            if step % cfg.checkpoint.every_steps == 0 or last:
                self._checkpoint(step, {k: v for k, v in metrics.items() if k.startswith("reward/")})
        self._evaluate("end")
        if cfg.checkpoint.export_final:
            ray.get(self.controllers[0].export_final.remote(str(self.run_dir / "final")))
        # the ranks' engines are not closed: Driver.run kills the gang right after (as for the
        # parallel controllers, whose actors leave theirs open at the end of the run)
        return [{"rank": 0, "step": self.state["step"], "eval": self.state["eval"]}]

    # ------------------------------------------------------------------ sampling
    def _submit(self, k: int, step: int) -> _Draw:
        """Take k prompts, spread over the ranks' shards, and send each rank's share to its own
        sampler(s): the colocated engine first, then its rollout workers (as a controller does)."""
        n = self.cfg.rollout.n
        per_rank = [self.streams[r].take(size) for r, size in
                    enumerate(len(x) for x in split_evenly(list(range(k)), self.world))]
        refs: list[list[tuple[list[Any], Any]]] = []
        for r, examples in enumerate(per_rank):
            local = self.plan.train_devices[r] in self.plan.local_sampler_devices
            slots = (1 if local else 0) + len(self._workers_of[r])
            shares = split_evenly(examples, slots)
            mine = []
            if local:
                share = shares.pop(0)
                if share:
                    mine.append((share, self.controllers[r].generate.remote(
                        self._send(([e.prompt for e in share], n)))))
            for (_d, worker), share in zip(self._workers_of[r], shares, strict=True):
                if share:
                    mine.append((share, worker.generate_payload.remote(
                        self._send(([e.prompt for e in share], n)))))
            refs.append(mine)
        return _Draw(per_rank, refs, step - 1)

    def _collect(self, draw: _Draw, step: int) -> list[Any]:
        from trainer.sampling import Group

        n = self.cfg.rollout.n
        groups = []
        lag = max(0, step - 1 - draw.version)  # versions between the sampling and the trained policy
        self._log.staleness = max(self._log.staleness, lag)
        for mine in draw.refs:
            for share, ref in mine:
                out = self._receive(ref)
                self._log.spans.extend(out["spans"])
                samples = out["samples"]
                if len(samples) != len(share) * n:
                    raise RuntimeError(f"sampler returned {len(samples)} samples for "
                                       f"{len(share)} prompts × n={n}")
                t = time.time()
                try:
                    rewards = self.reward_fn([s.prompt for s in samples],
                                             [s.response_text for s in samples],
                                             [e.answer for e in share for _ in range(n)])
                except Exception as exc:  # a failed scorer marks the step, it does not kill it
                    self.reporter.log_event("warning", f"reward failed on {len(share)} prompts: {exc}",
                                            {"step": step})
                    self._log.reward_failures += 1
                    continue
                finally:
                    self._log.reward_time += time.time() - t
                for i, e in enumerate(share):
                    groups.append(Group(e, samples[i * n : (i + 1) * n], rewards[i * n : (i + 1) * n],
                                        {"staleness": lag}))
        return groups

    def _draw(self, k: int, *, step: int) -> list[Any]:
        groups = self._collect(self._submit(k, step), step)
        self._drawn.extend(groups)
        return groups

    # ------------------------------------------------------------------ other phases
    def _push_weights(self, version: int) -> dict[str, float]:
        """Every rank pushes to its samplers; returns the step's `weight_sync/*`."""
        import ray

        from trainer.driver import combine_rank_metrics

        pushed = ray.get([c.push_weights.remote(version) for c in self.controllers])
        for out in pushed:
            self._bytes_in += len(pack_payload(out))
            if hasattr(self, "_log"):
                self._log.spans.extend(out["spans"])
        return combine_rank_metrics([out["metrics"] for out in pushed])

    def _warm_start(self) -> None:
        import ray

        from trainer.controller import PromptStream
        from trainer.data import sft_target

        ws, world = self.cfg.algorithm.warm_start, self.world
        if ws.steps == 0 or self.cfg.algorithm.name == "sft" or self.state["warm_start_done"]:
            return
        streams = [PromptStream(self.train_examples, rank=r, world=world, seed=self.cfg.seed, salt="sft")
                   for r in range(world)]
        ray.get([c.warm_start_begin.remote(ws.lr) for c in self.controllers])
        per_rank = max(1, ws.batch_size // world)
        t0 = time.time()
        for i in range(ws.steps):
            batches = [s.take(per_rank) for s in streams]
            results = self._call_all("sft_step", [
                self._send(([e.prompt for e in b], [sft_target(e) for e in b])) for b in batches])
            if (i + 1) % 25 == 0 or i + 1 == ws.steps:
                loss = sum(m["loss/sft"] for m in results) / len(results)
                self.reporter.log_warm_start(i + 1, {"warm_start/loss": results[0]["loss/sft"]})
                if (i + 1) % 100 == 0 or i + 1 == ws.steps:
                    self.on_message(f"warm start {i + 1}/{ws.steps}: loss {loss:.3f}")
        ray.get([c.warm_start_end.remote() for c in self.controllers])
        self.state["warm_start_done"] = True
        self._complete_step(0, {0: {"metrics": {"warm_start/time_s": time.time() - t0,
                                                "warm_start/steps": float(ws.steps)}}})

    def _evaluate(self, when: str) -> float | None:
        from trainer.rewards import exact_match

        if not self.can_eval:
            return None
        t = time.time()
        shards = [self.eval_examples[r :: self.world] for r in range(self.world)]
        outs = self._call_all("greedy", [
            self._send(([e.prompt for e in s], self.cfg.rollout.max_new_tokens)) for s in shards])
        scores: list[float] = []
        for shard, out in zip(shards, outs, strict=True):
            if hasattr(self, "_log"):
                self._log.spans.extend(out["spans"])
            scores += exact_match([e.prompt for e in shard], out["texts"], [e.answer for e in shard])
        acc = sum(scores) / max(len(scores), 1)
        self.state["eval"][f"accuracy_{when}"] = acc
        msg = f"held-out accuracy at {when}: {acc:.3f}"
        self.reporter.log_event("eval", msg, {"when": when, "accuracy": acc, "n": float(len(scores)),
                                              "step": self.state["step"], "time_s": time.time() - t})
        self.on_message(msg)
        return acc

    def _checkpoint(self, step: int, metrics: dict[str, float]) -> None:
        import ray

        from trainer import checkpoint as ckpt

        path = ckpt.checkpoint_dir(self.run_dir, step)
        # rank 0 writes the shared part before the others write theirs into its directory
        ray.get(self.controllers[0].save.remote(str(path), self.streams[0].position,
                                                self.sampler.state_dict()))
        ray.get([c.save.remote(str(path), self.streams[r].position, self.sampler.state_dict())
                 for r, c in enumerate(self.controllers) if r > 0])
        ckpt.mark_complete(path, {**self.state, "step": step})
        ckpt.prune(self.run_dir, self.cfg.checkpoint.keep)
        self.reporter.log_checkpoint(step, str(path), ckpt.dir_size(path), metrics)

    # ------------------------------------------------------------------ metrics
    def _combine_train(self, results: list[dict[str, Any]]) -> dict[str, float]:
        from trainer.driver import combine_rank_metrics

        per_rank = [dict(r["metrics"]) for r in results]
        trained = sum(m.pop("trained_tokens", 0.0) for m in per_rank)
        out = combine_rank_metrics(per_rank)
        out["trained_tokens"] = trained  # a total over the ranks, not a mean
        for r in results:
            out.update(r.get("device_metrics", {}))
        return out

    def _timing(self, t0: float, t1: float, gen_tokens: int, samples_n: int, trained_tokens: float,
                train_results: list[dict[str, Any]]) -> dict[str, float]:
        """time/* as a parallel controller reports them: each phase's own time on the slowest
        device that ran it; what is left of the step is the driver's control-flow overhead."""
        from trainer.telemetry import PhaseRecorder, PhaseSpan

        spans = [PhaseSpan(int(s["device"]), str(s["phase"]), float(s["start"]), float(s["end"]),
                           self.state["step"] + 1) for s in self._log.spans]
        per_device = {}
        for d in {s.device for s in spans}:
            per_device[d] = PhaseRecorder.durations(spans, device=d)
        wall = max(t1 - t0, 1e-9)

        def slowest(phase: str) -> float:
            return max((p.get(phase, 0.0) for p in per_device.values()), default=0.0)

        out = {"time/step": wall, "time/rollout_wait": 0.0}
        for phase in ("rollout", "train", "reference", "weight_sync", "eval", "checkpoint"):
            out[f"time/{phase}"] = slowest(phase)
        out["time/train"] = max(0.0, out["time/train"] - out["time/reference"])  # nested span
        out["time/reward"] = self._log.reward_time
        out["time/idle"] = step_overhead(out)
        out["time/overhead"] = out["time/idle"]
        rollout_time = out["time/rollout"]
        out["throughput/gen_tokens_per_s"] = gen_tokens / rollout_time if rollout_time else 0.0
        out["throughput/tokens_per_s"] = gen_tokens / wall
        out["throughput/samples_per_s"] = samples_n / wall
        train_t = out["time/train"] + out["time/reference"]
        out["throughput/trained_tokens_per_s"] = trained_tokens / train_t if train_t else 0.0
        out["tokens/generated"] = float(gen_tokens)
        out["tokens/trained"] = float(trained_tokens)
        for d in per_device:
            out[f"device/{d}/busy_frac"] = PhaseRecorder.busy_fraction(spans, d, t0, t1)
        return out


def _sample_metrics(drawn: list[Any], rewards: list[float]) -> dict[str, float]:
    """reward/* and response/* over everything sampled in a step (dropped groups too)."""
    lengths = [len(s.response_ids) for s in drawn]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    out = {
        "response/length_mean": sum(lengths) / len(lengths),
        "response/length_max": float(max(lengths)),
        "response/length_min": float(min(lengths)),
        "response/truncated_frac": sum(s.finish_reason == "length" for s in drawn) / len(drawn),
    }
    if rewards:
        out.update({"reward/mean": mean,
                    "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
                    "reward/max": max(rewards), "reward/min": min(rewards)})
    return out
