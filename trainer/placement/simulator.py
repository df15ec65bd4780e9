"""A discrete-event simulation of RL steps under each placement mode, with the cost model's
per-device costs and response lengths drawn from a long-tailed distribution.

Where the analytic model (`cost_model.phase_times`) uses the expected longest response, the
simulator draws every response, so each rollout replica finishes when its own longest one does
and the others wait: the idle time the long tail causes is counted device by device.

- colocate: every replica generates its share, scores it, then (all-reduce barrier) every
  device computes reference log-probs, trains, reloads weights in place, offloads/wakes.
- partial_colocate: every replica generates; `reward_devices` devices score samples as they
  finish, in order of finishing, once their own generation is done; then as colocate.
- disaggregated: the rollout pool generates batch t+1 with weights at most `staleness`
  versions old while the training pool scores and trains batch t; new weights cross the link.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from trainer.placement.cost_model import CostParams, Layout, Workload

__all__ = ["SimResult", "simulate"]


@dataclass
class SimResult:
    mode: str
    devices: int
    step_s: float
    samples_per_s: float
    gen_tokens_per_s: float
    idle_frac: float  # share of device-seconds no phase used
    rollout_s: float  # rollout (+ streamed scoring in partial_colocate) per step
    train_s: float  # reference + training per step
    split: str = ""

    def row(self) -> dict[str, float | str | int]:
        return {"mode": self.mode, "devices": self.devices, "split": self.split,
                "step_s": self.step_s, "samples_per_s": self.samples_per_s,
                "gen_tokens_per_s": self.gen_tokens_per_s, "idle_frac": self.idle_frac,
                "rollout_s": self.rollout_s, "train_s": self.train_s}


def _replica_lengths(w: Workload, replicas: int, rng: random.Random) -> list[list[float]]:
    lengths = w.response.sample(w.samples, rng)
    out: list[list[float]] = [[] for _ in range(replicas)]
    for i, x in enumerate(lengths):
        out[i % replicas].append(x)
    return out


def _gen_time(p: CostParams, lens: list[float]) -> float:
    if not lens:
        return 0.0
    tokens = sum(lens)
    steps = max(max(lens), tokens / p.gen_concurrency)
    return p.gen_fixed_s + p.gen_step_s * steps + p.gen_token_s * tokens


def _finish_times(p: CostParams, lens: list[float]) -> list[float]:
    """When each response of one replica finishes: a response of length l ends after decode
    step l, by which time the replica has produced sum(min(l_j, l)) tokens (continuous batching;
    a concurrency limit stretches the whole timeline in proportion)."""
    if not lens:
        return []
    xs = sorted(lens)
    n, out, prefix = len(xs), [], 0.0
    unconstrained = p.gen_step_s * xs[-1] + p.gen_token_s * sum(xs)
    scale = (_gen_time(p, xs) - p.gen_fixed_s) / unconstrained if unconstrained > 0 else 1.0
    for i, x in enumerate(xs):
        prefix += x
        upto = prefix + x * (n - 1 - i)
        out.append(p.gen_fixed_s + scale * (p.gen_step_s * x + p.gen_token_s * upto))
    return out


def _sync(p: CostParams, nbytes: float, local: bool) -> float:
    bw = p.sync_local_Bps if local else p.sync_link_Bps
    return p.sync_fixed_s + (nbytes / bw if bw != float("inf") else 0.0)


def _train_parts(p: CostParams, w: Workload, T: int) -> tuple[float, float]:
    tokens = w.train_tokens / T
    grad = w.param_bytes if w.grad_bytes is None else w.grad_bytes
    ar = 2 * (T - 1) / T * grad / p.allreduce_Bps if T > 1 and p.allreduce_Bps != float("inf") else 0.0
    ref = p.ref_token_s * tokens if w.reference else 0.0
    return ref, p.train_fixed_s + p.train_token_s * tokens + ar


def simulate(p: CostParams, w: Workload, layout: Layout, *, steps: int = 12, tp: int = 1,
             seed: int = 0) -> SimResult:
    """Simulate `steps` steps; steady-state step time, throughput and idle fraction."""
    rng = random.Random(seed)
    if layout.mode == "disaggregated":
        return _simulate_disaggregated(p, w, layout, steps, tp, rng)
    D = layout.devices
    replicas = max(1, D // tp)
    ref, train = _train_parts(p, w, D)
    sync = _sync(p, w.param_bytes, local=True)
    total_t, busy_t, roll_t = 0.0, 0.0, 0.0
    for _ in range(steps):
        lens = _replica_lengths(w, replicas, rng)
        gens = [_gen_time(p, L) for L in lens]
        busy = sum(g * tp for g in gens)
        if layout.mode == "colocate":
            # each controller scores its own samples once its rollout is back
            ends = [g + p.reward_sample_s * len(L) for g, L in zip(gens, lens, strict=True)]
            busy += sum(p.reward_sample_s * len(L) * tp for L in lens)
            rollout_end = max(ends)
        else:  # partial_colocate: streamed scoring on K devices
            K = layout.scoring_pool
            arrivals = sorted(t for L in lens for t in _finish_times(p, L))
            # the scorers are the replicas that hold their devices: free once their own share is done
            free = sorted(gens[: max(1, K // tp)] if tp > 1 else gens[:K]) or [0.0]
            free = (free * K)[:K]
            heapq.heapify(free)
            end = 0.0
            for a in arrivals:
                t = heapq.heappop(free)
                done = max(t, a) + p.reward_sample_s
                heapq.heappush(free, done)
                end = max(end, done)
            busy += p.reward_sample_s * w.samples
            rollout_end = max(max(gens), end)
        step = rollout_end + ref + train + sync + p.offload_s + p.overhead_s
        busy += D * (ref + train + sync + p.offload_s)
        total_t += step
        busy_t += busy
        roll_t += rollout_end
    step_s = total_t / steps
    return SimResult(layout.mode, D, step_s, w.samples / step_s, w.gen_tokens / step_s,
                     max(0.0, 1 - busy_t / (D * total_t)), roll_t / steps, ref + train,
                     split=f"{layout.scoring_pool} score" if layout.mode == "partial_colocate" else "")


def _simulate_disaggregated(p: CostParams, w: Workload, layout: Layout, steps: int, tp: int,
                            rng: random.Random) -> SimResult:
    R, T, s = layout.rollout_pool, layout.train_pool, layout.staleness
    D = layout.devices
    replicas = max(1, R // tp)
    ref, train = _train_parts(p, w, T)
    sync = _sync(p, w.param_bytes, local=False)
    reward = p.reward_sample_s * w.samples / T
    weights_ready = {0: 0.0}  # policy version → when the training pool has pushed it
    rollout_free = 0.0
    train_free = 0.0
    train_end: list[float] = []
    busy: list[float] = []
    roll: list[float] = []
    for t in range(1, steps + 1):
        need = max(0, t - 1 - s)  # batch t may be generated with weights of version t-1-s
        start = max(rollout_free, weights_ready[need])
        gens = [_gen_time(p, L) for L in _replica_lengths(w, replicas, rng)]
        gen_end = start + max(gens)
        rollout_free = gen_end + sync  # the workers load the newest weights between rollouts
        end = max(gen_end, train_free) + reward + ref + train + sync
        weights_ready[t] = end
        train_free = end + p.overhead_s
        train_end.append(train_free)
        busy.append(sum(g * tp for g in gens) + R * sync + T * (reward + ref + train + sync))
        roll.append(max(gens))
    warm = min(2, steps - 1)
    window = (train_end[-1] - train_end[warm - 1]) if steps > warm else train_end[-1]
    n = steps - warm
    step_s = window / n
    busy_w = sum(busy[warm:])
    return SimResult("disaggregated", D, step_s, w.samples / step_s, w.gen_tokens / step_s,
                     max(0.0, 1 - busy_w / (D * window)), sum(roll[warm:]) / n, ref + train,
                     split=f"{R} rollout / {T} train")
