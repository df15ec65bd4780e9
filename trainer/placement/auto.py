"""`placement.mode: auto`: choose the plan with the least predicted step time, and change it while
the run goes on (DESIGN §3.5).

The planner is fed every step's combined metrics by the driver and answers with decisions; the
driver applies a switch (checkpoint at a step boundary, stop the gang, start one with the new
plan, resume). Phases of a run:

1. profile: the run starts in colocate (it always fits if anything does; otherwise the first
   candidate that fits) and measures `placement.profile_steps` steps after 2 warm-up steps.
   One layout cannot separate a phase's fixed cost from its per-work cost (every driver scales
   the same way), so the profile then visits the best-predicted other layout for as many steps.
2. initial choice: the cost model fitted to both layouts predicts every candidate's step time on
   the measured workload; the run moves to the best one that fits in memory when the gain clears
   `placement.replan_min_gain` (and at least `placement.replan_every` steps remain). Events carry
   the last measured switch cost and what the remaining steps would save, for the reader: on a
   loaded 2-core machine a switch costs minutes, which a short run never earns back.
3. re-plan: every `placement.replan_every` steps the measured phase times of the current plan are
   compared with the prediction of the last decision. When they drift by more than
   `placement.replan_drift` (of the step time), the check says why — how much the work per step
   changed (tokens, response lengths) and how far the model is off on the work done now — and
   updates the model by the cause: the work changed and the model predicts it → the same model;
   every phase took the same factor longer for its work (the machine's speed or load) → the model
   rescaled by that factor, which moves every plan alike; otherwise one part of the step changed,
   the other plans' steps from before the shift are stale, and each candidate is predicted under
   every attribution of the change to a phase's terms (`_replan_per_phase`): a plan faster under
   all of them is switched to, one faster under some only is re-profiled (measured for
   `profile_steps` steps, kept only when faster beyond the noise of the two plans' steps, both
   scaled to the same work by the model: `at_common_work`). Then
   the candidates are compared again on the current work: a switch, or "kept" when the gain is
   too small. After a switch the measured step time of the new plan is reported and the model
   refitted on the steps both plans ran since the shift; a switch that measured slower than the
   plan it left is reverted. The revert's follow-up checks it in turn: when the plan gone back to
   no longer measures what the revert went by, the workload shifted while the other plan was
   measured, and the two plans' steps since then decide (`_check_revert`).

Candidates come from `CANDIDATE_FAMILIES`, one entry per mode: colocate, disaggregated with every
split, and partial_colocate with every number of scoring devices when the reward is a model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from trainer.config import ConfigError, TrainerConfig, parse_config
from trainer.placement.cost_model import (
    CostParams,
    Layout,
    PhaseTimes,
    StepObservation,
    fit,
    layout_reference_share,
    measured_phase,
    phase_times,
    predicted_steps,
)
from trainer.placement.link import LinkCalibration, config_link_calibration

__all__ = ["CANDIDATE_FAMILIES", "AutoPlanner", "Decision", "candidate_layouts", "layout_config",
           "layout_label", "starting_layout"]

WARMUP_STEPS = 2  # after every gang start: first engine calls, an empty prefetch queue
DEFAULT_SWITCH_COST_S = 30.0  # until one is measured: stop, start actors and engines, resume
PHASES = ("rollout", "reward", "train", "weight_sync")


def _colocate(cfg: TrainerConfig) -> list[Layout]:
    return [Layout("colocate", cfg.placement.devices, staleness=cfg.placement.staleness)]


def _disaggregated(cfg: TrainerConfig) -> list[Layout]:
    d = cfg.placement.devices
    return [Layout("disaggregated", d, rollout_devices=r, staleness=cfg.placement.staleness,
                   reference_on_rollout=layout_reference_share(cfg))
            for r in range(1, d)]


def _partial_colocate(cfg: TrainerConfig) -> list[Layout]:
    # only a reward model makes scoring cost enough to hide; a rule scores in microseconds
    if cfg.reward.kind != "model":
        return []
    d = cfg.placement.devices
    return [Layout("partial_colocate", d, reward_devices=k, staleness=cfg.placement.staleness)
            for k in range(1, d + 1)]


# One entry per placement mode auto may choose.
CANDIDATE_FAMILIES: tuple[Callable[[TrainerConfig], list[Layout]], ...] = (
    _colocate, _disaggregated, _partial_colocate)


def layout_label(layout: Layout) -> str:
    """How a plan is named in events: `colocate`, `disaggregated 1 rollout / 1 train`,
    `partial_colocate 1 scoring / 2`."""
    if layout.mode == "disaggregated":
        return f"disaggregated {layout.rollout_pool} rollout / {layout.train_pool} train"
    if layout.mode == "partial_colocate":
        return f"partial_colocate {layout.scoring_pool} scoring / {layout.devices}"
    return layout.mode


def layout_config(cfg: TrainerConfig, layout: Layout) -> TrainerConfig:
    """`cfg` running `layout` (a concrete mode and split): what the controllers are given."""
    data = cfg.model_dump()
    data["placement"]["mode"] = layout.mode
    data["placement"]["rollout_devices"] = layout.rollout_devices if layout.mode == "disaggregated" else None
    if layout.mode == "partial_colocate":
        data["placement"]["reward_devices"] = layout.scoring_pool
    return parse_config(data)


def _valid(cfg: TrainerConfig, layout: Layout) -> TrainerConfig | None:
    try:
        return layout_config(cfg, layout)
    except ConfigError:  # e.g. the batch does not split over this training pool
        return None


def _fits(cfg: TrainerConfig) -> bool:
    from trainer.placement.memory import estimate_memory

    est = estimate_memory(cfg)
    return est is None or est.fits


def candidate_layouts(cfg: TrainerConfig) -> list[tuple[Layout, bool]]:
    """Every plan auto may choose for `cfg`, with whether it fits in memory; plans whose config
    does not validate (the batch does not split over the training pool) are left out."""
    out = []
    for family in CANDIDATE_FAMILIES:
        for layout in family(cfg):
            concrete = _valid(cfg, layout)
            if concrete is not None:
                out.append((layout, _fits(concrete)))
    return out


def starting_layout(cfg: TrainerConfig, candidates: list[tuple[Layout, bool]] | None = None) -> Layout:
    """Colocate when it fits (it holds the most, so anything else fits too), else the first
    candidate that fits; ConfigError when none does."""
    candidates = candidate_layouts(cfg) if candidates is None else candidates
    for layout, fits in candidates:
        if fits:
            return layout
    raise ConfigError([("placement.mode", "placement.mode=auto: no candidate plan fits in memory "
                        f"({', '.join(layout_label(lay) for lay, _ in candidates) or 'none valid'})")])


@dataclass
class Decision:
    """One placement decision (`kind`: profile, initial, replan, kept) or the measured follow-up
    of one (`kind`: measured). `switch` is true when the run moves to `chosen`."""

    kind: str
    step: int
    current: Layout
    chosen: Layout
    reason: str
    predictions: list[dict[str, Any]] = field(default_factory=list)
    predicted_step_s: float | None = None
    measured_step_s: float | None = None
    drift: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def switch(self) -> bool:
        return self.chosen != self.current

    def message(self) -> str:
        if self.kind == "measured":
            return (f"placement {layout_label(self.chosen)}: measured {self.measured_step_s:.3f} s/step "
                    f"(predicted {self.predicted_step_s:.3f} s)")
        verb = "switch to" if self.switch else "keep"
        return f"placement {self.kind} at step {self.step}: {verb} {layout_label(self.chosen)} — {self.reason}"

    def to_event(self) -> dict[str, Any]:
        """The `placement` event's data (what the API returns and the run page marks)."""
        return {"decision": self.kind, "step": self.step, "switch": self.switch,
                "current": _layout_dict(self.current), "chosen": _layout_dict(self.chosen),
                "plan": layout_label(self.chosen), "reason": self.reason,
                "candidates": self.predictions, "predicted_step_s": self.predicted_step_s,
                "measured_step_s": self.measured_step_s, "drift": self.drift, **self.extra}


def _layout_dict(layout: Layout) -> dict[str, Any]:
    return {"mode": layout.mode, "devices": layout.devices,
            "rollout_devices": layout.rollout_pool if layout.mode == "disaggregated" else None,
            "train_devices": layout.train_pool,
            "reward_devices": layout.scoring_pool if layout.mode == "partial_colocate" else None}


def _prediction_event(p: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in p.items() if k not in ("layout", "phases")}
    out["phases"] = {k: round(v, 4) for k, v in p["phases"].as_dict().items() if math.isfinite(v)}
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


# A re-profile keeps the plan it measured when its mean step time is below the plan's it left by
# more than this many standard errors of the difference of the two means.
REPROFILE_SE = 2.0


def _sample_var(xs: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    m = _mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def _noise_margin(left: list[float], here: list[float]) -> float:
    """`REPROFILE_SE` standard errors of the difference of two plans' mean step times (Welch:
    each plan's own spread over its own steps). A re-profile compares `profile_steps` (4) steps of
    each: with noise alone the new plan's mean comes out below the old one's half of the time, and
    the re-profile used to keep it then (no margin), a gang restart on a coin flip; beyond 2
    standard errors, about 5% of the time (one-sided, t with ~6 degrees of freedom). A plan with
    one step borrows the other's spread; with one step each there is none to go by (margin 0)."""
    v_left, v_here = _sample_var(left), _sample_var(here)
    if v_left is None and v_here is None:
        return 0.0
    v_left = v_here if v_left is None else v_left
    v_here = v_left if v_here is None else v_here
    assert v_left is not None and v_here is not None
    return REPROFILE_SE * math.sqrt(v_left / len(left) + v_here / len(here))


# What a step's work is made of: the cost model's drivers, as the controllers report them.
WORK_KEYS = ("tokens/generated", "tokens/trained", "response/length_mean", "response/length_max")
# ... and what else of it the model reads: the generate calls of dynamic sampling
MODEL_WORK_KEYS = (*WORK_KEYS, "sampling/refills", "sampling/refills_max")


def _step_times(obs: list[StepObservation]) -> list[float]:
    return [o.get("time/step") for o in obs]


def _var_of_mean(xs: list[float]) -> float:
    v = _sample_var(xs)
    return 0.0 if v is None else v / len(xs)


def at_common_work(params: CostParams | None, a: list[StepObservation],
                   b: list[StepObservation]) -> tuple[list[float], list[float], bool]:
    """Two plans' step times to compare, each on its own steps (`a`, `b`): as measured, or each
    step's time scaled to the mean work of all the steps of both, by what the model predicts for
    its own plan (time × predicted at the mean work / predicted at the step's own work).

    Under dynamic sampling a step's work varies with its refills (each another generate call) and
    lengths, and raw step times compare whatever work each plan happened to draw: the spread is
    wide (a noise margin of 35% of the step in the demo's slow-decoder run) and a plan that drew
    more refills looks slower for it. Scaled to the same work, only the variation the model does
    not explain is left. The scaled times are used when they spread less than the raw ones (the
    sum of the two means' variances): a model that explains none of it changes nothing. Returns
    (a's times, b's times, whether they were scaled)."""
    raw_a, raw_b = _step_times(a), _step_times(b)
    if params is None or not a or not b:
        return raw_a, raw_b, False
    both = a + b
    common = {k: _mean([o.get(k) for o in both]) for k in MODEL_WORK_KEYS
              if any(k in o.metrics for o in both)}

    def scaled(obs: list[StepObservation]) -> list[float] | None:
        keys = {k for o in obs for k in o.metrics}
        own = {k: _mean([o.get(k) for o in obs]) for k in keys}
        ref = StepObservation(obs[0].layout, obs[0].param_bytes, {**own, **common}, grad_bytes=obs[0].grad_bytes)
        at_mean, *preds = predicted_steps(params, [ref, *obs])
        if at_mean <= 0 or any(not math.isfinite(x) or x <= 0 for x in preds):
            return None
        return [o.get("time/step") * at_mean / x for o, x in zip(obs, preds, strict=True)]

    adj_a, adj_b = scaled(a), scaled(b)
    if adj_a is None or adj_b is None:
        return raw_a, raw_b, False
    if _var_of_mean(adj_a) + _var_of_mean(adj_b) < _var_of_mean(raw_a) + _var_of_mean(raw_b):
        return adj_a, adj_b, True
    return raw_a, raw_b, False


def _work(obs: list[StepObservation]) -> dict[str, float]:
    return {k: _mean([o.get(k) for o in obs]) for k in WORK_KEYS}


def _work_change(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The largest relative change of any driver of the work per step (`work_change`), and which
    driver it was, with its value before and after."""
    changed = [(abs(after[k] - v) / v, k) for k, v in before.items() if v > 0 and k in after]
    if not changed:
        return {"work_change": 0.0}
    change, key = max(changed)
    return {"work_change": change, "work_driver": key, "work_before": round(before[key], 2),
            "work_after": round(after[key], 2)}


def _trigger_text(drift: float, cause: dict[str, Any], threshold: float) -> str:
    """Why a check compared the plans again: the measured phase times left the prediction, or the
    work per step moved past the threshold while the time per unit of work held."""
    if cause.get("trigger") == "work":
        return (f"the work per step changed since the last decision ({cause['work_driver']} "
                f"{cause['work_before']:g} → {cause['work_after']:g} per step) while the measured phase "
                f"times stayed within {drift:.0%} of the prediction for the old work"
                f"{_cause_text(cause, threshold)}: the plans are compared again on the work done now")
    return f"measured phase times drifted {drift:.0%} from the prediction{_cause_text(cause, threshold)}"


def _measured_times(obs: list[StepObservation]) -> PhaseTimes:
    """The mean measured phase times of `obs` (steps of one plan), as a prediction to compare with."""
    m = {k: _mean([measured_phase(o, k) for o in obs])
         for k in ("rollout", "reward", "reference", "train", "weight_sync", "step")}
    return PhaseTimes(m["rollout"], m["reward"], m["reference"], m["train"], m["weight_sync"],
                      offload=0.0, overhead=0.0, step=m["step"])


def _gap(measured: dict[str, float], pred: PhaseTimes) -> float:
    """The largest gap between a measured phase (or the step) and its prediction, relative to the
    predicted step time."""
    p = pred.as_dict()
    return max(abs(measured[k] - p[k]) for k in (*PHASES, "step")) / max(p["step"], 1e-9)


def _scaled(p: CostParams, factor: float) -> CostParams:
    """`p` on a device `factor` times slower: every time term × factor, every bandwidth ÷ factor."""
    out = replace(p)
    for f in fields(CostParams):
        v = getattr(p, f.name)
        if f.name.endswith("_s"):
            setattr(out, f.name, v * factor)
        elif f.name.endswith("_Bps"):
            setattr(out, f.name, v / factor)
    return out


def _mean_params(ps: list[CostParams]) -> CostParams:
    """The term-by-term mean of parameter sets that differ only in finite terms."""
    out = replace(ps[0])
    for f in fields(CostParams):
        vals = [getattr(p, f.name) for p in ps]
        if all(math.isfinite(v) for v in vals):
            setattr(out, f.name, _mean(vals))
    return out


def _spread_predictions(variants: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One prediction per candidate from the same candidates predicted under several parameter
    sets: the mean phase and step times, `predicted_range_s` (the least and the most), and `fits`
    only when every set predicts a finite step time."""
    out = []
    for same in zip(*variants, strict=True):
        steps = [p["predicted_step_s"] for p in same]
        if any(s is None for s in steps):
            out.append({**same[0], "fits": False, "predicted_step_s": None, "predicted_range_s": None})
            continue
        phases = PhaseTimes(**{f.name: _mean([getattr(p["phases"], f.name) for p in same])
                               for f in fields(PhaseTimes)})
        out.append({**same[0], "phases": phases, "predicted_step_s": round(_mean(steps), 4),
                    "predicted_range_s": [round(min(steps), 4), round(max(steps), 4)],
                    "fits": all(p["fits"] for p in same)})
    return out


def _cause_text(cause: dict[str, Any], threshold: float) -> str:
    work, err = cause.get("work_change"), cause.get("model_error")
    if work is None or err is None:
        return ""
    speed = cause.get("speed_factor")
    if speed is not None:
        why = (f"every phase took ×{speed:.2f} the predicted time for its work: the machine's "
               "speed or load changed, which moves every plan alike; the model is rescaled, not refitted")
    elif err <= threshold:
        why = "the work changed and the model predicts it"
    elif work < threshold / 2:
        why = "the same work takes a different time: the machine's speed or load changed, not the work"
    else:
        why = "the work changed and so did the time it takes"
    if cause.get("model_update") == "per_phase":
        why += (", not alike in every phase: the other plans' steps before step "
                f"{cause.get('stale_before_step')} are stale, and each plan is predicted under every "
                "attribution of the change to a phase's terms (per token or per step)")
    return (f" (work per step changed {work:.0%}; at the work done now the model is off by "
            f"{err:.0%}: {why})")


class AutoPlanner:
    """The decisions of `placement.mode: auto`, from the steps the run measures. Pure: no Ray, no
    clock unless asked (`now`), so the decision logic is unit-tested on synthetic steps."""

    def __init__(self, cfg: TrainerConfig, *, param_bytes: float,
                 candidates: list[tuple[Layout, bool]] | None = None, start: Layout | None = None,
                 link: LinkCalibration | None = None):
        p = cfg.placement
        # the measured link (placement.link_calibration): every fit keeps its bandwidth, which the
        # run's one policy size cannot separate from the fixed cost of a weight-sync round
        self.link = link if link is not None else config_link_calibration(cfg)
        self.candidates = candidate_layouts(cfg) if candidates is None else candidates
        self.layout = start or starting_layout(cfg, self.candidates)
        self.param_bytes = param_bytes
        self.max_steps = cfg.train.max_steps
        self.profile_steps, self.replan_every = p.profile_steps, p.replan_every
        self.drift_threshold, self.min_gain = p.replan_drift, p.replan_min_gain
        self.obs: list[StepObservation] = []
        self.params: CostParams | None = None
        self.profiled: list[Layout] = []  # layouts measured during the profile, in order
        self.phase = "profile"
        self.skip_until = WARMUP_STEPS  # steps up to this one are warm-up
        self.pending: Layout | None = None  # a switch asked for and not applied yet
        self.anchor: PhaseTimes | None = None  # the current plan's prediction at the last decision
        self.anchor_step = 0
        self.anchor_work: dict[str, float] = {}  # the work per step the anchor was predicted for
        self._pred_work: dict[str, float] = {}
        self.last_kept_step = -10**9
        self.checks: list[dict[str, float]] = []  # every drift check: step, drift, its cause
        self.switches = 0
        self.switch_cost_s = DEFAULT_SWITCH_COST_S
        self._stopped_at: float | None = None  # when the last gang's final step was reported
        self._followup: Decision | None = None  # the switch whose measured step time is due
        # the plan a switch left and its steps measured since the last shift
        self._left: tuple[Layout, list[StepObservation]] | None = None
        self.fresh_since = 0  # steps before this one were measured before the last shift: stale
        self._reprofiling = False  # the pending switch measures a plan the model could not decide on
        # after a revert: the plan it reverted from, its steps, and the step time of the plan it
        # went back to that the revert went by (`_check_revert`)
        self._reverted: tuple[Layout, list[StepObservation], float] | None = None

    # ------------------------------------------------------------------ the driver's calls
    def observe(self, step: int, metrics: dict[str, float], *, now: float | None = None) -> list[Decision]:
        """Take one step's combined metrics; returns the decisions it led to (often none)."""
        if self.pending is not None or step <= self.skip_until:
            return []
        if self._stopped_at is not None:  # first measured step of a new gang: the switch's cost
            now = time.time() if now is None else now
            self.switch_cost_s = max(0.0, now - self._stopped_at - metrics.get("time/step", 0.0)
                                     * (WARMUP_STEPS + 1))
            self._stopped_at = None
        if "time/step" not in metrics or not metrics.get("tokens/generated"):
            return []
        self.obs.append(StepObservation(self.layout, self.param_bytes, {**metrics, "_step": float(step)}))
        out: list[Decision] = []
        if self._followup is not None:
            out += self._measure_followup(step)
        if self.phase == "profile":
            out += self._profile(step)
        elif step - self.anchor_step >= self.replan_every and self._followup is None:
            out += self._check(step)
        return out

    def stopping(self, *, now: float | None = None) -> None:
        """The gang's last step before a switch was reported (the switch cost starts here)."""
        self._stopped_at = time.time() if now is None else now

    def switched(self, layout: Layout, resume_step: int) -> None:
        """The new gang runs `layout` from the checkpoint of `resume_step`."""
        self.layout, self.pending = layout, None
        self.skip_until = resume_step + WARMUP_STEPS
        self.anchor_step = resume_step + WARMUP_STEPS
        self.switches += 1

    # ------------------------------------------------------------------ phases
    def _recent(self, layout: Layout, k: int) -> list[StepObservation]:
        return [o for o in self.obs if o.layout == layout][-k:]

    def _profile(self, step: int) -> list[Decision]:
        here = [o for o in self.obs if o.layout == self.layout]
        if len(here) < self.profile_steps:
            return []
        if self.layout not in self.profiled:
            self.profiled.append(self.layout)
        self.params = self._fit(self.obs)
        preds = self._predictions(self.params, here[-self.profile_steps:])
        fitting = [p for p in preds if p["fits"]]
        others = [p for p in fitting if p["layout"] not in self.profiled]
        if len(self.profiled) == 1 and others:
            best_other = min(others, key=lambda p: p["predicted_step_s"])
            return [self._decide("profile", step, best_other["layout"], preds,
                                 "one layout cannot separate fixed from per-work phase costs: "
                                 f"profile {layout_label(best_other['layout'])} too "
                                 f"({self.profile_steps} steps)")]
        self.phase = "steady"
        best = min(fitting, key=lambda p: p["predicted_step_s"])
        return [self._choose("initial", step, preds, best)]

    def _check(self, step: int) -> list[Decision]:
        recent = self._recent(self.layout, self.replan_every)
        recent = [o for o in recent if self._step_of(o) > self.anchor_step - 1]
        self.anchor_step = step
        if len(recent) < max(2, self.replan_every // 2) or self.anchor is None:
            return []
        measured = {k: _mean([measured_phase(o, k) for o in recent]) for k in (*PHASES, "step")}
        drift = _gap(measured, self.anchor)
        # why: did the work per step change, or the time the same work takes (load, a slower
        # device)? The model as fitted at the last decision, on the work done now, tells them apart.
        work_change = _work_change(self.anchor_work, _work(recent))
        cause: dict[str, Any] = {"work_change": work_change["work_change"]}
        if self.params is not None:
            cause["model_error"] = _gap(measured, self._predict(self.params, recent, self.layout))
        self.checks.append({"step": step, "drift": drift, **cause})
        if drift <= self.drift_threshold and cause["work_change"] <= self.drift_threshold:
            return []
        # the work itself moving past the threshold is reason enough to compare the plans again:
        # a plan chosen for one mix of generation and training may not be the best for another,
        # even when this plan's time per unit of work holds (a growing dynamic-sampling ratio
        # generates more per step while training stays fixed)
        cause["trigger"] = "drift" if drift > self.drift_threshold else "work"
        cause.update(work_change)
        if cause.get("model_error", math.inf) <= self.drift_threshold:
            # the work changed and the model predicts this plan on it: compare the plans on it
            recent = recent[-max(4, self.replan_every // 2):]
            cause["model_update"] = "same"
        else:
            # the drift may have begun mid-window: the steps before it are stale, also as what a
            # re-profile compares with (a step from before a slowdown made the plan the run left
            # look faster than it was, and a faster alternative was sent back within the noise)
            k = self._shift_index(recent)
            self.fresh_since = self._step_of(recent[k])
            since = len(recent) - k
            need = min(self.profile_steps, self.replan_every)  # the window holds replan_every steps
            if since < need:
                # too few steps since the shift to tell a load from a phase, or for a re-profile to
                # compare with (2 steps whose work varies ±20% gave a noise margin no plan clears):
                # check again once this plan has `profile_steps` of them
                self.anchor_step = step - self.replan_every + need - since
                self.checks[-1]["deferred"] = True
                return []
            recent = recent[min(k, max(0, len(recent) - 3)):]  # at least 3 to fit attributions on
            measured["step"] = _mean([o.get("time/step") for o in recent])
            cause["stale_before_step"] = self.fresh_since
            speed = self._uniform_speed(recent)
            if speed is not None:
                # every phase that matters takes the same factor longer (or shorter) for its work:
                # the machine's speed changed (load), which moves every plan alike. A refit on this
                # plan's new steps beside the other plans' old ones would credit those with the old
                # speed.
                assert self.params is not None
                self.params = _scaled(self.params, speed)
                cause["speed_factor"] = speed
                cause["model_update"] = "rescaled"
            else:
                return self._replan_per_phase(step, recent, drift, measured["step"], cause)
        assert self.params is not None  # fitted at the profile's end, before any check
        preds = self._predictions(self.params, recent)
        fitting = [p for p in preds if p["fits"]]
        best = min(fitting, key=lambda p: p["predicted_step_s"])
        d = self._choose("replan", step, preds, best, drift=drift, measured=measured["step"], cause=cause)
        return self._rate_limited(step, d)

    def _replan_per_phase(self, step: int, recent: list[StepObservation], drift: float,
                          measured: float, cause: dict[str, Any]) -> list[Decision]:
        """One part of the step changed (a phase took longer for its work, or the work changed in a
        way the model did not predict): the other plans' steps from before the shift are stale, and
        this plan's new steps alone cannot say which term of the changed phase moved. Generation
        that got slower per decode step costs a 1-device rollout pool what it costs each of 2
        devices; slower per token, twice as much. So every candidate is predicted under each
        attribution (`_attributions`), and:

        - a plan faster by `replan_min_gain` under every attribution: switch to it;
        - a plan faster by that much under some attribution only: re-profile it (switch, measure
          `profile_steps` steps, keep it only when it measured faster than this plan by more than
          `REPROFILE_SE` standard errors of the difference, else go back; refit on both plans'
          new steps) — the model cannot decide, a measurement can;
        - otherwise keep the plan."""
        cause["model_update"] = "per_phase"
        attributions = self._attributions(recent)
        variants = [self._predictions(params, recent) for params in attributions]
        preds = _spread_predictions(variants)
        self.params = _mean_params(attributions)
        cur = self.layout
        gains: dict[Layout, list[float]] = {}
        for vp in variants:
            by = {p["layout"]: p for p in vp}
            cur_s = by[cur]["predicted_step_s"]
            for lay, p in by.items():
                if lay != cur and p["fits"] and cur_s:
                    gains.setdefault(lay, []).append((cur_s - p["predicted_step_s"]) / cur_s)
        gains = {lay: g for lay, g in gains.items() if len(g) == len(variants)}
        sure = {lay: min(g) for lay, g in gains.items() if min(g) >= self.min_gain}
        maybe = {lay: max(g) for lay, g in gains.items() if max(g) >= self.min_gain}
        by_point = {p["layout"]: p for p in preds}
        if sure:
            best = by_point[max(sure, key=lambda lay: sure[lay])]
            cause["gain_least"] = sure[best["layout"]]  # under the attribution least in its favour
        elif maybe:
            target = max(maybe, key=lambda lay: maybe[lay])
            lo, hi = by_point[target]["predicted_range_s"]
            c_lo, c_hi = by_point[cur]["predicted_range_s"]
            remaining = self.max_steps - step
            reason = (f"{_trigger_text(drift, cause, self.drift_threshold)}; {layout_label(target)} predicted "
                      f"{lo:.3f}–{hi:.3f} s/step vs {c_lo:.3f}–{c_hi:.3f} for {layout_label(cur)} "
                      f"(up to {maybe[target]:.1%} faster; this plan's steps alone cannot say which): ")
            # what the remaining steps would save under the attribution most in the plan's favour
            saving = max(by[cur]["predicted_step_s"] - by[target]["predicted_step_s"]
                         for by in ({p["layout"]: p for p in vp} for vp in variants))
            extra = {"switch_cost_s": self.switch_cost_s, "saved_s": saving * remaining, **cause}
            if remaining < self.replan_every:
                d = self._decide("kept", step, cur, preds, reason + f"only {remaining} steps remain "
                                 "(fewer than placement.replan_every) to re-profile it",
                                 drift=drift, measured=measured, gain=maybe[target], switch_cost=extra)
                return self._rate_limited(step, d)
            d = self._decide("replan", step, target, preds,
                             reason + f"re-profile it for {self.profile_steps} steps and keep it if faster "
                             "beyond the noise",
                             drift=drift, measured=measured, gain=maybe[target],
                             switch_cost={**extra, "reprofile": True})
            self._reprofiling = True
            return [d]
        else:  # no plan gains enough under any attribution
            best = min((p for p in preds if p["fits"]), key=lambda p: p["predicted_step_s"])
        d = self._choose("replan", step, preds, best, drift=drift, measured=measured, cause=cause)
        return self._rate_limited(step, d)

    def _rate_limited(self, step: int, d: Decision) -> list[Decision]:
        if not d.switch and step - self.last_kept_step < 3 * self.replan_every:
            return []  # "kept" is rate-limited; the check itself re-anchored the prediction
        if not d.switch:
            self.last_kept_step = step
        return [d]

    def _measure_followup(self, step: int) -> list[Decision]:
        d = self._followup
        assert d is not None
        here = [o for o in self.obs if o.layout == self.layout and self._step_of(o) > self.skip_until]
        if len(here) < self.profile_steps:
            return []
        self._followup = None
        here = here[-self.profile_steps:]
        times = _step_times(here)
        measured = _mean(times)
        left = self._left
        self._left = None
        reprofile, self._reprofiling = self._reprofiling, False
        reverted, self._reverted = self._reverted, None
        stale = None
        if reverted is not None:
            judged = reverted[2]
            stale_drift = abs(measured - judged) / judged if judged > 0 else 0.0
            if self.phase == "steady" and stale_drift > self.drift_threshold:
                # the revert went by this plan's steps from before a shift: both plans' steps since
                # the plan it reverted from began measuring are what compare now
                stale = (stale_drift, reverted)
                self.fresh_since = max(self.fresh_since, self._step_of(reverted[1][0]))
        # both plans now have steps measured since the last shift: refit on those alone
        preds: list[dict[str, Any]] = []
        fresh = [o for o in self.obs if self._step_of(o) >= self.fresh_since]
        if self.phase == "steady" and len({o.layout for o in fresh}) >= 2:
            self.params = self._fit(fresh, prior=self.params)
            preds = self._predictions(self.params, here)
        reason = f"after the {d.kind} at step {d.step}"
        left_s = _mean(_step_times(left[1])) if left is not None else 0.0
        noise: dict[str, Any] = {}
        # the two plans compared at the same work (`at_common_work`): the new plan's mean and the
        # left plan's, as measured when the model explains none of their spread
        here_c, left_c = measured, left_s
        if left is not None and self.phase == "steady" and d.kind != "profile":
            left_t, here_t, scaled = at_common_work(self.params if preds else None, left[1], here)
            here_c, left_c = _mean(here_t), _mean(left_t)
            noise = {"left_step_s": left_s, "left_steps": len(left[1])}
            if scaled:
                noise.update(work_adjusted=True, step_at_common_work_s=here_c,
                             left_step_at_common_work_s=left_c)
            if reprofile:
                # a re-profile keeps the plan it measured only when it measured faster than the
                # plan the run was on by more than the noise of the two means (_noise_margin)
                margin = _noise_margin(left_t, here_t)
                keep = left_c - here_c > margin
                noise.update(noise_margin_s=margin, reprofile_kept=keep)
                at = (f"; at the same work: {here_c:.3f} against {left_c:.3f}" if scaled else "")
                reason += (f" (a re-profile: {'faster' if here_c < left_c else 'slower'} than the "
                           f"{left_s:.3f} s/step {layout_label(left[0])} measured before it{at}; "
                           f"noise margin {margin:.3f} s ({REPROFILE_SE:g} standard errors of the "
                           f"difference): {'kept' if keep else 'not faster beyond it'})")
        out = [Decision("measured", step, d.chosen, d.chosen, reason,
                        predictions=[_prediction_event(p) for p in preds],
                        predicted_step_s=d.predicted_step_s, measured_step_s=measured,
                        extra={"decision_step": d.step, "error": (d.predicted_step_s - measured)
                               / measured if measured and d.predicted_step_s else None,
                               **({"reprofile": True} if reprofile else {}), **noise})]
        if preds:
            self.anchor = next(p["phases"] for p in preds if p["layout"] == self.layout)
            self.anchor_work, self.anchor_step = self._pred_work, step
        if stale is not None:
            return out + self._check_revert(step, here, preds, *stale)
        # a re-profile goes back unless the plan it measured was faster beyond the noise; a switch
        # the model was sure of is reverted only when it measured slower by the gain threshold (no
        # ping-pong on noisy steps)
        if "reprofile_kept" in noise:
            back_now = not noise["reprofile_kept"]
        else:
            back_now = here_c > left_c * (1 + self.min_gain)
        if left is not None and self.phase == "steady" and d.kind != "profile" and back_now:
            # the measurement does not back this switch: go back to the plan the run was on
            back = left[0]
            at = (f" ({here_c:.3f} against {left_c:.3f} s/step at the same work)"
                  if noise.get("work_adjusted") else "")
            why = (f"not faster than {left_s:.3f} s/step of {layout_label(back)} by more than the "
                   f"noise margin ({noise['noise_margin_s']:.3f} s){at}: switching back to the plan the "
                   "run was on" if reprofile else
                   f"slower than {left_s:.3f} s/step of {layout_label(back)} before the switch{at}: "
                   "switching back")
            out.append(self._decide("replan", step, back, preds,
                                    f"{layout_label(self.layout)} measured {measured:.3f} s/step, " + why,
                                    predicted=left_s, measured=measured,
                                    switch_cost={"reprofile": True, **noise} if reprofile else None))
            self._left = None  # a revert is not itself reverted: no ping-pong on noisy steps
            # ... but it is checked: back on the plan it left, its steps must still measure what
            # the revert went by (a shift during the measurement makes them stale)
            self._reverted = (self.layout, here, left_s)
            # the model was wrong here: later checks compare against what the plan measured
            back_obs = self._recent(back, self.profile_steps)
            if back_obs:
                self.anchor, self.anchor_work = _measured_times(back_obs), _work(back_obs)
        return out

    def _check_revert(self, step: int, here: list[StepObservation], preds: list[dict[str, Any]],
                      drift: float, reverted: tuple[Layout, list[StepObservation], float]) -> list[Decision]:
        """Back on the plan a revert returned to, its steps measured `drift` off the step time the
        revert went by: the workload shifted while the other plan was measured (a re-profile decided
        before a shift and measured after it compares the new workload on one plan with the old on
        the other). Both plans' steps since then are what compare, at the same work: switch to the
        one reverted from when it measured faster beyond the noise of the two means, else keep this
        plan; either way later checks compare with what this plan measures now."""
        other, other_obs, judged = reverted
        measured, other_s = _mean(_step_times(here)), _mean(_step_times(other_obs))
        here_t, other_t, scaled = at_common_work(self.params if preds else None, here, other_obs)
        here_c, other_c = _mean(here_t), _mean(other_t)
        margin = _noise_margin(here_t, other_t)
        other_from = self._step_of(other_obs[0])
        at = f" ({here_c:.3f} against {other_c:.3f} s/step at the same work)" if scaled else ""
        why = (f"{layout_label(self.layout)} measured {measured:.3f} s/step back on it, drifted "
               f"{drift:.0%} from the {judged:.3f} s/step the revert went by: the workload shifted "
               f"while {layout_label(other)} was measured, so its {other_s:.3f} s/step from step "
               f"{other_from} on is what compares{at}")
        extra = {"left_step_s": measured, "noise_margin_s": margin, "stale_before_step": other_from,
                 "stale_revert": True,
                 **({"work_adjusted": True, "step_at_common_work_s": other_c,
                     "left_step_at_common_work_s": here_c} if scaled else {})}
        if here_c - other_c > margin:
            d = self._decide("replan", step, other, preds,
                             why + f": faster by more than the noise margin ({margin:.3f} s), switching to it",
                             predicted=other_s, measured=measured, drift=drift, switch_cost=extra)
            self._left = None  # settled on both plans' steps after the shift: not reverted again
            return [d]
        d = self._decide("kept", step, self.layout, preds,
                         why + f": not faster by more than the noise margin ({margin:.3f} s), kept",
                         predicted=measured, measured=measured, drift=drift, switch_cost=extra)
        self.anchor, self.anchor_work, self.last_kept_step = _measured_times(here), _work(here), step
        return [d]

    # ------------------------------------------------------------------ choosing
    def _choose(self, kind: str, step: int, preds: list[dict[str, Any]], best: dict[str, Any], *,
                drift: float | None = None, measured: float | None = None,
                cause: dict[str, Any] | None = None) -> Decision:
        current = next(p for p in preds if p["layout"] == self.layout)
        cur_s, best_s = current["predicted_step_s"], best["predicted_step_s"]
        gain = (cur_s - best_s) / cur_s if cur_s > 0 else 0.0
        remaining = max(0, self.max_steps - step)
        repaid = (cur_s - best_s) * remaining
        if best["layout"] == self.layout:
            reason = f"{layout_label(self.layout)} is predicted fastest ({cur_s:.3f} s/step)"
            chosen = self.layout
        elif gain < self.min_gain:
            reason = (f"{layout_label(best['layout'])} predicted {best_s:.3f} s/step vs "
                      f"{cur_s:.3f}: gain {gain:.1%} below placement.replan_min_gain "
                      f"{self.min_gain:.0%}")
            chosen = self.layout
        elif remaining < self.replan_every:
            reason = (f"{layout_label(best['layout'])} predicted {gain:.1%} faster, but only "
                      f"{remaining} steps remain (fewer than placement.replan_every)")
            chosen = self.layout
        else:
            reason = (f"{layout_label(best['layout'])} predicted {best_s:.3f} s/step vs "
                      f"{cur_s:.3f} for {layout_label(self.layout)}: {gain:.1%} faster")
            chosen = best["layout"]
        if drift is not None:
            reason = f"{_trigger_text(drift, cause or {}, self.drift_threshold)}; " + reason
        if kind == "replan" and chosen == self.layout:
            kind = "kept"
        return self._decide(kind, step, chosen, preds, reason, predicted=next(
            p["predicted_step_s"] for p in preds if p["layout"] == chosen),
            drift=drift, measured=measured, gain=gain,
            switch_cost={"switch_cost_s": self.switch_cost_s, "saved_s": repaid, **(cause or {})})

    def _decide(self, kind: str, step: int, chosen: Layout, preds: list[dict[str, Any]], reason: str,
                *, predicted: float | None = None, drift: float | None = None,
                measured: float | None = None, gain: float | None = None,
                switch_cost: dict[str, Any] | None = None) -> Decision:
        if predicted is None:
            predicted = next((p["predicted_step_s"] for p in preds if p["layout"] == chosen), None)
        d = Decision(kind, step, self.layout, chosen, reason,
                     predictions=[_prediction_event(p) for p in preds],
                     predicted_step_s=predicted, measured_step_s=measured, drift=drift,
                     extra={**({"gain": gain} if gain is not None else {}), **(switch_cost or {})})
        times = {p["layout"]: p["phases"] for p in preds}
        self.anchor = times.get(chosen, self.anchor)
        if preds:
            self.anchor_work = self._pred_work
        self.anchor_step = step
        if d.switch:
            here = [o for o in self._recent(self.layout, self.profile_steps)
                    if self._step_of(o) >= self.fresh_since]
            self._left = (self.layout, here) if here else None
            self.pending = chosen
            self._followup = d
        return d

    def _fit(self, obs: list[StepObservation], prior: CostParams | None = None) -> CostParams:
        params = fit(obs, prior=prior, link=self.link).params
        if prior is not None and all(o.layout.train_pool == 1 for o in obs):
            params.allreduce_Bps = prior.allreduce_Bps  # no all-reduce was measured: keep the old term
        return params

    def _predictions(self, params: CostParams, recent: list[StepObservation]) -> list[dict[str, Any]]:
        """Every candidate's predicted phase times on the mean workload of `recent` steps."""
        workload = self._workload(recent)
        self._pred_work = _work(recent)
        out = []
        for layout, fits in self.candidates:
            pt = phase_times(params, workload, layout)
            out.append({"layout": layout, "plan": layout_label(layout), "mode": layout.mode,
                        "rollout_devices": layout.rollout_pool if layout.mode == "disaggregated" else None,
                        "reward_devices": layout.scoring_pool if layout.mode == "partial_colocate" else None,
                        "predicted_step_s": round(pt.step, 4) if math.isfinite(pt.step) else None,
                        "fits": fits, "phases": pt})
        for p in out:
            if p["predicted_step_s"] is None:
                p["fits"] = False
        return out

    def _workload(self, recent: list[StepObservation]) -> Any:
        keys = {k for o in recent for k in o.metrics}
        mean_metrics = {k: _mean([o.get(k) for o in recent]) for k in keys}
        return StepObservation(recent[-1].layout, self.param_bytes, mean_metrics).workload()

    def _predict(self, params: CostParams, recent: list[StepObservation], layout: Layout) -> PhaseTimes:
        return phase_times(params, self._workload(recent), layout)

    def _uniform_speed(self, recent: list[StepObservation]) -> float | None:
        """The factor by which every phase that matters (≥ 10% of the step) ran slower than the
        model predicts for the work of `recent`, when they agree within `replan_drift` of each
        other; None when fewer than two phases matter or they disagree (the shift is in one part
        of the work, and only a refit can say which plan it favours)."""
        if self.params is None:
            return None
        pred = self._predict(self.params, recent, self.layout).as_dict()
        meas = {k: _mean([measured_phase(o, k) for o in recent]) for k in PHASES}
        big = [k for k in PHASES if pred[k] >= 0.1 * pred["step"] and meas[k] > 0]
        if len(big) < 2:
            return None
        factors = [meas[k] / pred[k] for k in big]
        if max(factors) > min(factors) * (1 + self.drift_threshold):
            return None
        return sum(meas[k] for k in big) / sum(pred[k] for k in big)

    def _shift_index(self, recent: list[StepObservation]) -> int:
        """Where in `recent` the shift began: the first of the newest steps whose step time is
        nearer the two newest steps' than the last prediction's."""
        assert self.anchor is not None
        times = [o.get("time/step") for o in recent]
        new, old = _mean(times[-2:]), self.anchor.step
        k = len(times)
        while k > 0 and abs(times[k - 1] - new) <= abs(times[k - 1] - old):
            k -= 1
        return min(k, len(recent) - 1)

    def _attributions(self, recent: list[StepObservation]) -> list[CostParams]:
        """Parameter sets that each reproduce this plan's measured phases on the work of `recent`,
        one per way to put a phase's change on its terms: generation per decode step of the longest
        response (the same on every layout) or per generated token (a pool of half the devices
        generates twice the tokens each); training per step or per trained token. Scoring, the
        reference and weight movement are re-estimated from these steps, the rest (`overhead_s`)
        makes up the step time."""
        assert self.params is not None
        w, lay = self._workload(recent), self.layout
        pred = phase_times(self.params, w, lay)
        meas = {k: _mean([measured_phase(o, k) for o in recent])
                for k in ("rollout", "reference", "train", "weight_sync", "step")}
        longest = w.response.expected_max(w.samples)
        gen_tokens, train_tokens = w.gen_tokens / lay.rollout_pool, w.train_tokens / lay.train_pool
        d_gen, d_train = meas["rollout"] - pred.rollout, meas["train"] - pred.train
        common = replace(self.params)
        if w.samples:  # `time/reward` is a rank's share in every mode, as the fit reads it
            common.reward_sample_s = _mean([o.get("time/reward") for o in recent]) * lay.train_pool / w.samples
        if train_tokens:
            common.ref_token_s = meas["reference"] / train_tokens
        common.sync_fixed_s = max(0.0, common.sync_fixed_s + meas["weight_sync"] - pred.weight_sync)
        gen_ways = [{"gen_step_s": max(0.0, common.gen_step_s + d_gen / max(longest, 1e-9))},
                    {"gen_token_s": max(0.0, common.gen_token_s + d_gen / max(gen_tokens, 1e-9))}]
        train_ways = [{"train_fixed_s": max(0.0, common.train_fixed_s + d_train)},
                      {"train_token_s": max(0.0, common.train_token_s + d_train / max(train_tokens, 1e-9))}]
        out = []
        for g in gen_ways:
            for t in train_ways:
                p = replace(common, **g, **t)
                p.overhead_s += meas["step"] - phase_times(p, w, lay).step
                out.append(p)
        return out

    @staticmethod
    def _step_of(o: StepObservation) -> int:
        return int(o.metrics.get("_step", 0))
