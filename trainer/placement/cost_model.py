"""The cost model of one RL step (DESIGN §3.5): phase times from the work a step does, the step
time each placement mode makes of them, and a fit of its parameters to measured phase times.

Phases of a step and what drives their time on one device:

- generation: ``gen_fixed_s + gen_step_s × decode steps + gen_token_s × tokens`` per generate
  call. A decode step costs a latency floor (the weights are read once per step) plus a
  per-token share; the longest response of a device (the long tail) sets how many decode steps
  it runs, and with at most ``gen_concurrency`` sequences decoding at once (KV cache, continuous
  batching) it runs at least tokens / concurrency of them. Dynamic sampling's refills are more
  calls in the same step (``Workload.calls``): each pays the fixed cost and decodes to its own
  longest response again.
- scoring: ``reward_sample_s`` per sample on a scoring device.
- reference and training: per trained token (FLOP-bound), plus ``train_fixed_s`` (optimizer
  step) and the gradient all-reduce (``2 (T-1)/T × grad bytes / allreduce_Bps``).
- weight movement: ``sync_fixed_s + bytes / bandwidth``, in place on the device when sampler and
  trainer share it (``sync_local_Bps``), over a link otherwise (``sync_link_Bps``).
- offload/wake (colocate): the trainer's state leaves the device while the sampler generates
  and comes back (``offload_s`` per step; a no-op on vLLM's CPU backend, so 0 here).

Modes: ``colocate`` runs the phases in turn on every device; ``disaggregated`` overlaps the
rollout pool's generation of step t+1 with the training pool's step t (staleness ≥ 1), so the
step takes the slower of the two sides; ``partial_colocate`` generates on every device while a
reward model on a subset scores finished samples as they stream in, then trains everywhere.

The fit is ordinary least squares with non-negative coefficients, one linear problem per phase,
on the ``time/*``, ``tokens/*`` and ``response/*`` metrics the controllers report per step.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.placement.link import LinkCalibration

__all__ = [
    "MODES",
    "CostParams",
    "FitResult",
    "Layout",
    "LengthDist",
    "OnlineFit",
    "PhaseTimes",
    "StepObservation",
    "Workload",
    "fit",
    "measured_phase",
    "observations_from_metrics",
    "phase_times",
    "predict_step_time",
    "predicted_steps",
]

MODES = ("colocate", "disaggregated", "partial_colocate")


@dataclass(frozen=True)
class LengthDist:
    """Response lengths in tokens: log-normal with the given mean and spread, capped at `cap`
    (the max new tokens). ``sigma`` sets the long tail: 0 means every response has `mean`."""

    mean: float
    sigma: float = 0.0
    cap: float | None = None

    @property
    def _mu(self) -> float:
        return math.log(max(self.mean, 1e-9)) - self.sigma**2 / 2

    def quantile(self, q: float) -> float:
        q = min(max(q, 1e-9), 1 - 1e-9)
        x = math.exp(self._mu + self.sigma * NormalDist().inv_cdf(q)) if self.sigma else self.mean
        return min(x, self.cap) if self.cap else x

    def expected_max(self, k: float) -> float:
        """About the mean of the longest of `k` responses (Blom's plotting position)."""
        if k <= 1:
            return self.mean
        return max(self.mean, self.quantile((k - 0.375) / (k + 0.25)))

    def sample(self, k: int, rng: Any) -> list[float]:
        """`k` lengths drawn with `rng` (a random.Random), at least 1 token each."""
        out = []
        for _ in range(k):
            x = math.exp(rng.gauss(self._mu, self.sigma)) if self.sigma else self.mean
            out.append(max(1.0, min(x, self.cap) if self.cap else x))
        return out

    @classmethod
    def from_mean_max(cls, mean: float, longest: float, k: float, cap: float | None = None) -> LengthDist:
        """The spread that makes the expected longest of `k` responses equal `longest`."""
        if longest <= mean * 1.001 or k <= 1:
            return cls(mean, 0.0, cap)
        lo, hi = 0.0, 3.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if cls(mean, mid, None).expected_max(k) < longest:
                lo = mid
            else:
                hi = mid
        return cls(mean, (lo + hi) / 2, cap)


@dataclass(frozen=True)
class Workload:
    """The work of one step, across all devices."""

    prompts: int
    n: int
    response: LengthDist
    prompt_tokens: float
    param_bytes: float  # weights as the sampler holds them: what weight movement moves
    grad_bytes: float | None = None  # gradient bytes all-reduced per step (default param_bytes)
    reference: bool = True
    # generate calls per step on the slowest rollout device: 1, plus dynamic sampling's refills
    # (each decodes to its own longest response again); `samples` counts all of them
    calls: float = 1.0

    @property
    def samples(self) -> int:
        return self.prompts * self.n

    @property
    def gen_tokens(self) -> float:
        return self.samples * self.response.mean

    @property
    def train_tokens(self) -> float:
        return self.samples * (self.prompt_tokens + self.response.mean)


@dataclass(frozen=True)
class Layout:
    """A placement: mode and how the devices split."""

    mode: str
    devices: int
    rollout_devices: int | None = None  # disaggregated: the rollout pool (default half)
    reward_devices: int | None = None  # partial_colocate: devices that also score (default 1)
    staleness: int = 1
    # disaggregated: the rollout workers' share of the reference pass (`placement.reference_on_rollout`);
    # None: the share that evens the two sides (auto), 0: the training pool runs all of it
    reference_on_rollout: float | None = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown placement mode {self.mode!r}; choose one of {MODES}")
        if self.mode == "disaggregated" and self.devices < 2:
            raise ValueError("disaggregated placement needs at least 2 devices")

    @property
    def rollout_pool(self) -> int:
        if self.mode != "disaggregated":
            return self.devices
        return self.rollout_devices or max(1, self.devices // 2)

    @property
    def train_pool(self) -> int:
        return self.devices - self.rollout_pool if self.mode == "disaggregated" else self.devices

    @property
    def scoring_pool(self) -> int:
        if self.mode == "partial_colocate":
            return min(self.devices, self.reward_devices or 1)
        return self.train_pool  # rule rewards and colocated reward models score on the trainers


@dataclass
class CostParams:
    """Seconds per unit of work on one device; bandwidths in bytes/s (inf: free)."""

    gen_fixed_s: float = 0.0
    gen_step_s: float = 0.0
    gen_token_s: float = 0.0
    gen_concurrency: float = math.inf
    reward_sample_s: float = 0.0
    ref_token_s: float = 0.0
    train_token_s: float = 0.0
    train_fixed_s: float = 0.0
    allreduce_Bps: float = math.inf
    sync_fixed_s: float = 0.0
    sync_local_Bps: float = math.inf
    sync_link_Bps: float = math.inf
    offload_s: float = 0.0
    overhead_s: float = 0.0

    def as_metrics(self, prefix: str = "placement/cost/") -> dict[str, float]:
        """Finite parameters as flat metrics (bandwidths in GB/s)."""
        out = {}
        for k, v in asdict(self).items():
            if not math.isfinite(v):
                continue
            if k.endswith("_Bps"):
                out[prefix + k.removesuffix("_Bps") + "_GBps"] = v / 1e9
            else:
                out[prefix + k] = v
        return out


@dataclass
class PhaseTimes:
    rollout: float  # generation on the busiest rollout device (the step waits for it)
    reward: float
    reference: float
    train: float
    weight_sync: float
    offload: float
    overhead: float
    step: float
    rollout_side: float = 0.0  # disaggregated: the rollout pool's share of a step
    train_side: float = 0.0  # disaggregated: the training pool's share of a step

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _gen_time(p: CostParams, seqs: float, longest: float, tokens: float, calls: float = 1.0) -> float:
    """A device's generation of `seqs` sequences, `tokens` in all, in `calls` generate calls whose
    longest response is `longest` each."""
    if seqs <= 0:
        return 0.0
    calls = max(1.0, calls)
    # continuous batching: at most `gen_concurrency` sequences decode at once, so a call runs at
    # least its tokens / concurrency decode steps, and never fewer than its longest response
    per_call = tokens / calls
    steps = max(longest, per_call / p.gen_concurrency) if math.isfinite(p.gen_concurrency) else longest
    return calls * (p.gen_fixed_s + p.gen_step_s * steps) + p.gen_token_s * tokens


def _sync(p: CostParams, nbytes: float, *, local: bool) -> float:
    bw = p.sync_local_Bps if local else p.sync_link_Bps
    return p.sync_fixed_s + (nbytes / bw if math.isfinite(bw) else 0.0)


def _allreduce(p: CostParams, nbytes: float, ranks: int) -> float:
    if ranks <= 1 or not math.isfinite(p.allreduce_Bps):
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / p.allreduce_Bps


def _streamed_scoring(p: CostParams, gen: float, own: float, score_all: float, scorers: int) -> float:
    """partial_colocate: scoring time left after generation ends. A scoring device has no spare
    capacity while it generates itself, so scoring hides only in the tail between its own last
    response (`own`) and the step's longest one (`gen`); the step's last response is scored after
    generation ends."""
    return max(gen, own + score_all / scorers) + p.reward_sample_s - gen


def phase_times(p: CostParams, w: Workload, layout: Layout) -> PhaseTimes:
    """Expected phase times and step time of `w` under `layout` (steady state)."""
    R, T, K = layout.rollout_pool, layout.train_pool, layout.scoring_pool
    grad_bytes = w.param_bytes if w.grad_bytes is None else w.grad_bytes
    seqs_r = w.samples / R
    # The step waits for the slowest rollout device: the longest of all responses sets it (and,
    # as the fit reads a step's refills, each of its calls' decode steps).
    gen = _gen_time(p, seqs_r, w.response.expected_max(w.samples), seqs_r * w.response.mean, w.calls)
    tokens_t = w.train_tokens / T
    ref = p.ref_token_s * tokens_t if w.reference else 0.0
    train = p.train_fixed_s + p.train_token_s * tokens_t + _allreduce(p, grad_bytes, T)
    score_all = p.reward_sample_s * w.samples
    if layout.mode == "colocate":
        reward = score_all / T
        sync = _sync(p, w.param_bytes, local=True)
        step = gen + reward + ref + train + sync + p.offload_s + p.overhead_s
        return PhaseTimes(gen, reward, ref, train, sync, p.offload_s, p.overhead_s, step)
    if layout.mode == "partial_colocate":
        own = _gen_time(p, seqs_r, w.response.expected_max(seqs_r), seqs_r * w.response.mean, w.calls)
        reward = _streamed_scoring(p, gen, own, score_all, K)
        rollout_scored = gen + reward
        sync = _sync(p, w.param_bytes, local=True)
        step = rollout_scored + ref + train + sync + p.offload_s + p.overhead_s
        return PhaseTimes(gen, reward, ref, train, sync, p.offload_s, p.overhead_s, step)
    # disaggregated: the rollout pool generates step t+1 while the training pool trains step t
    reward = score_all / T
    sync_push = _sync(p, w.param_bytes, local=False)
    # the workers' share of the reference pass: on R devices, for the T training devices' tokens
    ref_worker = ref * T / R
    share = _reference_share(layout, gen + sync_push, reward + ref + train + sync_push, ref, ref_worker)
    ref_here = ref * (1.0 - share)
    rollout_side = gen + sync_push + share * ref_worker  # the workers load the new weights between rollouts
    train_side = reward + ref_here + train + sync_push
    if layout.staleness >= 1:
        step = max(rollout_side, train_side) + p.overhead_s
    else:
        step = rollout_side + train_side + p.overhead_s
    return PhaseTimes(gen, reward, ref_here, train, sync_push, 0.0, p.overhead_s, step,
                      rollout_side=rollout_side, train_side=train_side)


def _reference_share(layout: Layout, rollout_side: float, train_side: float, ref: float,
                     ref_worker: float) -> float:
    """The share of the reference pass the rollout workers run: the layout's, or (None) the one
    that evens the two sides, ``rollout_side + f ref_worker = train_side - f ref`` within [0, 1]
    (trainer.controller.ReferenceSplit measures it as the run goes)."""
    if layout.mode != "disaggregated" or layout.staleness < 1 or ref <= 0:
        return 0.0
    if layout.reference_on_rollout is not None:
        return layout.reference_on_rollout
    return evening_share(rollout_side, train_side, moved_to_rollout=ref_worker, moved_from_train=ref)


def evening_share(rollout_side: float, train_side: float, *, moved_to_rollout: float,
                  moved_from_train: float) -> float:
    """The share ``f`` of a piece of work, costing ``moved_to_rollout`` on the rollout side and
    ``moved_from_train`` on the training side, whose move evens the two sides:
    ``rollout_side + f moved_to_rollout = train_side - f moved_from_train``, within [0, 1]."""
    total = moved_to_rollout + moved_from_train
    if total <= 0:
        return 0.0
    return min(1.0, max(0.0, (train_side - rollout_side) / total))


def layout_reference_share(cfg: Any) -> float | None:
    """`placement.reference_on_rollout` as a Layout takes it (None: auto; 0 where auto keeps 0)."""
    setting = cfg.placement.reference_on_rollout
    if setting == "auto":
        kind = cfg.placement.device_type
        if kind == "auto":
            import torch

            kind = "gpu" if torch.cuda.is_available() else "cpu"
        return 0.0 if kind == "gpu" else None
    return float(setting)


def predict_step_time(p: CostParams, w: Workload, layout: Layout) -> float:
    return phase_times(p, w, layout).step


# ---------------------------------------------------------------------------------------- fit


@dataclass
class StepObservation:
    """One measured step: its layout, model bytes and the metrics the driver reported."""

    layout: Layout
    param_bytes: float
    metrics: dict[str, float]
    grad_bytes: float | None = None
    prompt_tokens: float = 0.0

    def get(self, key: str) -> float:
        return float(self.metrics.get(key, 0.0))

    @property
    def samples(self) -> float:
        mean = self.get("response/length_mean")
        return self.get("tokens/generated") / mean if mean else 0.0

    @property
    def calls(self) -> float:
        """Generate calls the step's slowest rank made: 1, plus its dynamic-sampling refills."""
        refills = self.metrics.get("sampling/refills_max", self.metrics.get("sampling/refills", 0.0))
        return 1.0 + float(refills)

    def workload(self, prompts_n: tuple[int, int] | None = None) -> Workload:
        """The step's work as a Workload (lengths from its mean and longest response)."""
        samples = self.samples
        prompts, n = prompts_n or (max(1, round(samples)), 1)
        mean = self.get("response/length_mean")
        tokens_trained = self.get("tokens/trained")
        prompt_tokens = self.prompt_tokens or max(0.0, tokens_trained / samples - mean if samples else 0.0)
        return Workload(prompts=prompts, n=n,
                        response=LengthDist.from_mean_max(mean, self.get("response/length_max"), samples),
                        prompt_tokens=prompt_tokens, param_bytes=self.param_bytes,
                        grad_bytes=self.grad_bytes, calls=self.calls)


@dataclass
class FitResult:
    params: CostParams
    step_error: float  # mean |predicted - measured| / mean measured step time
    phase_error: dict[str, float] = field(default_factory=dict)
    observations: int = 0
    by_mode: dict[str, dict[str, float]] = field(default_factory=dict)  # measured/predicted means

    def as_metrics(self, prefix: str = "placement/") -> dict[str, float]:
        out = self.params.as_metrics(prefix + "cost/")
        out[prefix + "fit/step_error"] = self.step_error
        out[prefix + "fit/observations"] = float(self.observations)
        for k, v in self.phase_error.items():
            out[f"{prefix}fit/{k}_error"] = v
        return out


def _nnls(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with coefficients ≥ 0: the best of the unconstrained solutions on every
    subset of columns (exact for the few terms of a phase)."""
    from itertools import combinations

    import numpy as np

    A, y = np.asarray(rows, dtype=float), np.asarray(ys, dtype=float)
    k = A.shape[1]
    scale = np.maximum(np.abs(A).max(axis=0), 1e-30)  # columns differ by 1e9 in scale
    best, best_res = np.zeros(k), float(y @ y)
    for size in range(1, k + 1):
        for cols in combinations(range(k), size):
            idx = list(cols)
            sol = np.linalg.lstsq(A[:, idx] / scale[idx], y, rcond=None)[0] / scale[idx]
            if (sol < 0).any():
                continue
            res = y - A[:, idx] @ sol
            if float(res @ res) < best_res - 1e-15:
                best, best_res = np.zeros(k), float(res @ res)
                best[idx] = sol
    return [float(c) for c in best]


def _rel_err(pred: list[float], meas: list[float]) -> float:
    """Mean absolute error relative to the mean measured value (robust to phases near 0 s)."""
    total = sum(meas)
    return sum(abs(a - b) for a, b in zip(pred, meas, strict=True)) / total if total > 1e-9 else 0.0


def fit(obs: list[StepObservation], *, prior: CostParams | None = None,
        link: LinkCalibration | None = None) -> FitResult:
    """Fit the parameters to measured steps, one linear problem per phase.

    A phase whose drivers never vary across `obs` cannot separate its terms; least squares then
    picks one split of the same total, which predicts the measured layouts equally well. Terms
    never observed (no offload on CPU, no link sync in a colocate-only profile) keep `prior`.
    Weight movement is such a phase in every run (one policy size): without `link` its whole time
    lands in `sync_fixed_s`, with a measured link (`placement.link_calibration`) its bandwidth
    holds (`_sync_on_calibrated_link`)."""
    if not obs:
        raise ValueError("fit needs at least one measured step")
    p = replace(prior) if prior is not None else CostParams()

    def per_rollout_device(o: StepObservation) -> tuple[float, float]:
        R = o.layout.rollout_pool
        return o.samples / R, o.get("tokens/generated") / R

    # generation
    rows, ys = [], []
    for o in obs:
        _seqs, toks = per_rollout_device(o)
        # a refill is another call: its fixed cost, and decode steps to its longest response (the
        # step's longest stands for each call's)
        rows.append([o.calls, o.calls * o.get("response/length_max"), toks])
        ys.append(o.get("time/rollout"))
    p.gen_fixed_s, p.gen_step_s, p.gen_token_s = _nnls(rows, ys)
    p.gen_concurrency = math.inf
    # scoring: every mode reports `time/reward` as the slowest rank's scoring of its own share
    # of the samples, done by the rank itself or (partial_colocate) by the scorers it streams to
    rows = [[o.samples / o.layout.train_pool] for o in obs]
    (p.reward_sample_s,) = _nnls(rows, [o.get("time/reward") for o in obs])
    # reference and training, per device
    # (the training devices' pass covers the rows that came without the workers' log-probs)
    with_ref = [o for o in obs if o.get("time/reference") > 0]
    if with_ref:
        (p.ref_token_s,) = _nnls([[o.get("tokens/trained") / o.layout.train_pool * _ref_here(o)]
                                  for o in with_ref],
                                 [o.get("time/reference") for o in with_ref])
    rows, ys = [], []
    for o in obs:
        T = o.layout.train_pool
        gb = o.param_bytes if o.grad_bytes is None else o.grad_bytes
        rows.append([1.0, o.get("tokens/trained") / T, 2 * (T - 1) / T * gb if T > 1 else 0.0])
        ys.append(o.get("time/train"))
    p.train_fixed_s, p.train_token_s, inv_ar = _nnls(rows, ys)
    p.allreduce_Bps = 1 / inv_ar if inv_ar > 0 else math.inf
    # weight movement: in place (colocate / partial) and over a link (disaggregated)
    if link is not None and len({o.param_bytes for o in obs}) == 1:
        _sync_on_calibrated_link(p, obs, link)
    else:
        rows, ys = [], []
        for o in obs:
            local = o.layout.mode != "disaggregated"
            rows.append([1.0, o.param_bytes if local else 0.0, 0.0 if local else o.param_bytes])
            ys.append(o.get("time/weight_sync"))
        sync_fixed, inv_local, inv_link = _nnls(rows, ys)
        p.sync_fixed_s = sync_fixed
        if any(o.layout.mode != "disaggregated" for o in obs):
            p.sync_local_Bps = 1 / inv_local if inv_local > 0 else math.inf
        if any(o.layout.mode == "disaggregated" for o in obs):
            p.sync_link_Bps = 1 / inv_link if inv_link > 0 else math.inf
    offloads = [o.get("time/offload") for o in obs if "time/offload" in o.metrics]
    if offloads:
        p.offload_s = sum(offloads) / len(offloads)
    # What the phases do not explain (driver, reporting, Ray calls): the mean residual. It can
    # come out negative: each phase is reported as its slowest rank's, and under load the ranks'
    # slow phases fall on different steps, so the sum of maxima overstates the slowest rank.
    p.overhead_s = 0.0
    resid = [o.get("time/step") - _composed(p, o) for o in obs]
    p.overhead_s = sum(resid) / len(resid)

    # errors: each phase against its measurement, and the composed step time
    pred_phase: dict[str, list[float]] = {k: [] for k in ("rollout", "reward", "train", "weight_sync")}
    meas_phase: dict[str, list[float]] = {k: [] for k in pred_phase}
    pred_step, meas_step = [], []
    for o in obs:
        pt = _phases_of(p, o)
        for k in pred_phase:
            pred_phase[k].append(getattr(pt, k))
            meas_phase[k].append(measured_phase(o, k))
        pred_step.append(pt.step)
        meas_step.append(o.get("time/step"))
    by_mode: dict[str, dict[str, float]] = {}
    for mode in sorted({o.layout.mode for o in obs}):
        idx = [i for i, o in enumerate(obs) if o.layout.mode == mode]
        meas = sum(meas_step[i] for i in idx) / len(idx)
        pred = sum(pred_step[i] for i in idx) / len(idx)
        by_mode[mode] = {"measured_s": meas, "predicted_s": pred, "steps": float(len(idx)),
                         "error": (pred - meas) / meas if meas else 0.0}
    return FitResult(params=p, step_error=_rel_err(pred_step, meas_step),
                     phase_error={k: _rel_err(pred_phase[k], meas_phase[k]) for k in pred_phase},
                     observations=len(obs), by_mode=by_mode)


def _sync_on_calibrated_link(p: CostParams, obs: list[StepObservation], link: LinkCalibration) -> None:
    """The weight-movement terms of `p` from steps of one policy size and a measured link.

    One size cannot separate a round's fixed cost from its bytes / bandwidth: every split of the
    measured time predicts these steps equally well, and least squares puts all of it in the fixed
    term, which predicts a 70 MB policy's sync as a 4 MB one's. The calibration measured two sizes,
    so what the steps cannot see comes from it, as `fit` keeps any unobserved term from its prior:

    - the link's bandwidth, always;
    - the fixed cost of a round: what the link steps (disaggregated) measured beyond their bytes'
      share, the run's own; without link steps, the calibration's;
    - in-place movement (colocate, partial_colocate) shares that fixed term (the model has one) and
      puts what its steps measured beyond it on the bytes, as the in-place bandwidth.

    When the link steps took less than their bytes at the calibrated bandwidth alone, this is not
    the calibrated link: their own bandwidth is fitted (no fixed cost), as a fit of one size does."""
    links = [o for o in obs if o.layout.mode == "disaggregated"]
    local = [o for o in obs if o.layout.mode != "disaggregated"]
    p.sync_link_Bps, p.sync_fixed_s = link.sync_link_Bps, link.sync_fixed_s
    if links:
        per_byte = 1 / link.sync_link_Bps if math.isfinite(link.sync_link_Bps) else 0.0
        fixed = _mean([o.get("time/weight_sync") - o.param_bytes * per_byte for o in links])
        if fixed < 0:
            (inv,) = _nnls([[o.param_bytes] for o in links], [o.get("time/weight_sync") for o in links])
            p.sync_link_Bps, fixed = (1 / inv if inv > 0 else math.inf), 0.0
        p.sync_fixed_s = fixed
    if local:
        beyond = _mean([o.get("time/weight_sync") - p.sync_fixed_s for o in local])
        p.sync_local_Bps = _mean([o.param_bytes for o in local]) / beyond if beyond > 0 else math.inf


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def measured_phase(o: StepObservation, phase: str) -> float:
    """The measured counterpart of PhaseTimes' `phase`: in partial_colocate the reward phase is
    the scoring the step waited for after generation (`time/reward_wait`), not the scorers' busy
    time, most of which hid under generation."""
    if phase == "reward" and o.layout.mode == "partial_colocate":
        return o.get("time/reward_wait")
    return o.get(f"time/{phase}")


def _ref_here(o: StepObservation) -> float:
    """Of an observed step's reference pass, the share the training devices ran."""
    return 1.0 - o.get("reference/given_frac")


def _phases_of(p: CostParams, o: StepObservation) -> PhaseTimes:
    """Phase times of one observed step, from its own measured lengths and token counts."""
    L = o.layout
    R, T = L.rollout_pool, L.train_pool
    seqs_r, toks_r = o.samples / R, o.get("tokens/generated") / R
    gen = _gen_time(p, seqs_r, o.get("response/length_max"), toks_r, o.calls)
    tokens_t = o.get("tokens/trained") / T
    gb = o.param_bytes if o.grad_bytes is None else o.grad_bytes
    ref = p.ref_token_s * tokens_t if o.get("time/reference") > 0 else 0.0
    train = p.train_fixed_s + p.train_token_s * tokens_t + _allreduce(p, gb, T)
    reward = p.reward_sample_s * o.samples / L.scoring_pool
    if L.mode == "disaggregated":
        sync = _sync(p, o.param_bytes, local=False)
        # the workers ran the rest of the reference pass (on their R devices) after generating
        moved = p.ref_token_s * o.get("tokens/trained") / R * o.get("reference/given_frac")
        ref *= _ref_here(o)
        rollout_side, train_side = gen + sync + moved, reward + ref + train + sync
        core = max(rollout_side, train_side) if L.staleness >= 1 else rollout_side + train_side
        return PhaseTimes(gen, reward, ref, train, sync, 0.0, p.overhead_s, core + p.overhead_s,
                          rollout_side=rollout_side, train_side=train_side)
    sync = _sync(p, o.param_bytes, local=True)
    if L.mode == "partial_colocate":
        longest = o.get("response/length_max")
        dist = LengthDist.from_mean_max(o.get("response/length_mean"), longest, o.samples)
        own = _gen_time(p, seqs_r, min(dist.expected_max(seqs_r), longest), toks_r, o.calls)
        reward = _streamed_scoring(p, gen, own, p.reward_sample_s * o.samples, L.scoring_pool)
    step = gen + reward + ref + train + sync + p.offload_s + p.overhead_s
    return PhaseTimes(gen, reward, ref, train, sync, p.offload_s, p.overhead_s, step)


def predicted_steps(p: CostParams, obs: list[StepObservation]) -> list[float]:
    """The step time `p` predicts for each observed step, from the step's own lengths and token
    counts (what `fit` compares with; here for parameters fitted on other steps)."""
    return [_phases_of(p, o).step for o in obs]


def _composed(p: CostParams, o: StepObservation) -> float:
    return _phases_of(p, o).step - p.overhead_s


def observations_from_metrics(rows: list[dict[str, Any]], layout: Layout, *, param_bytes: float,
                              grad_bytes: float | None = None,
                              skip_first: int = 2) -> list[StepObservation]:
    """Observations from metrics.jsonl rows (one per RL step); the first steps are warm-up
    (first vLLM calls, an empty prefetch queue) and are skipped."""
    out = []
    for r in rows:
        if int(r.get("step", 0)) <= skip_first or "time/step" not in r:
            continue
        out.append(StepObservation(layout=layout, param_bytes=param_bytes, grad_bytes=grad_bytes,
                                   metrics={k: float(v) for k, v in r.items()
                                            if isinstance(v, int | float)}))
    return out


class OnlineFit:
    """The cost model refitted as a run goes: fed each step's combined metrics, it refits on the
    last `window` steps every `every` steps and returns its parameters and fit error as metrics
    (`placement/cost/*`, `placement/fit/*`) for every step once it has `min_steps`. With `link`
    (`placement.link_calibration`) the link terms keep the measured link's bandwidth."""

    def __init__(self, layout: Layout, *, param_bytes: float, window: int = 50, every: int = 5,
                 min_steps: int = 4, skip_first: int = 2, link: LinkCalibration | None = None):
        self.layout, self.param_bytes, self.link = layout, param_bytes, link
        self.window, self.every, self.min_steps, self.skip_first = window, every, min_steps, skip_first
        self.obs: list[StepObservation] = []
        self.result: FitResult | None = None

    @classmethod
    def for_config(cls, cfg: Any) -> OnlineFit | None:
        """For a TrainerConfig of a mode the model covers; None when the model's shape is unknown.
        ConfigError when `placement.link_calibration` names a file that is not a calibration."""
        from trainer.placement.link import config_link_calibration
        from trainer.placement.memory import DTYPE_BYTES, model_shape

        p = cfg.placement
        if p.mode not in MODES or (p.mode == "disaggregated" and p.devices < 2):
            return None
        shape = model_shape(cfg)
        if shape is None:
            return None
        return cls(Layout(p.mode, p.devices, rollout_devices=p.rollout_devices,
                          reward_devices=p.reward_devices if p.mode == "partial_colocate" else None,
                          staleness=p.staleness,
                          reference_on_rollout=layout_reference_share(cfg) if p.mode == "disaggregated" else 0.0),
                   param_bytes=shape.params * DTYPE_BYTES[cfg.model.dtype],
                   link=config_link_calibration(cfg))

    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Take one step's metrics; the current fit's metrics (empty until there is one)."""
        if step > self.skip_first and "time/step" in metrics and metrics.get("tokens/generated"):
            self.obs.append(StepObservation(self.layout, self.param_bytes, dict(metrics)))
            self.obs = self.obs[-self.window:]
            if len(self.obs) >= self.min_steps and (self.result is None or step % self.every == 0):
                self.result = fit(self.obs, link=self.link)
        return self.result.as_metrics() if self.result is not None else {}
