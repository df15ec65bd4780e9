"""Checkpoints: everything needed to continue a run exactly where it stopped.

Layout under ``<run dir>/checkpoints/step_000010/``:

- ``policy/``          the policy as an HF directory (weights + tokenizer): the sampler loads it
- ``optimizer.pt``     optimizer, lr scheduler (and critic + its optimizer for PPO)
- ``rank<r>.pt``       each controller's data position, RNG states and sampling state
- ``trainer_state.json`` step, eval results so far, written last
- ``COMPLETE``         marker: a directory without it is an interrupted save and is ignored

Rank 0 writes the shared parts (every controller holds the same weights); each rank writes its
own file; rank 0 marks the checkpoint complete after a barrier and prunes old ones.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "checkpoint_dir",
    "latest_checkpoint",
    "step_of",
    "discard_after",
    "list_checkpoints",
    "rng_state",
    "set_rng_state",
    "save_shared",
    "save_rank",
    "mark_complete",
    "prune",
    "load_shared",
    "load_rank",
    "read_trainer_state",
    "export_final",
    "dir_size",
]

MARKER = "COMPLETE"


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if (p / MARKER).exists()]
    return sorted(done, key=step_of)


def latest_checkpoint(run_dir: str | Path, *, at_most: int | None = None) -> Path | None:
    """The newest complete checkpoint (no newer than step `at_most`): the resume point of a run."""
    found = [p for p in list_checkpoints(run_dir) if at_most is None or step_of(p) <= at_most]
    return found[-1] if found else None


def step_of(path: Path) -> int:
    return int(path.name.split("_")[1])


def discard_after(run_dir: str | Path, step: int) -> list[int]:
    """Delete the complete checkpoints newer than `step`; returns their steps.

    A controller checkpoints before the driver has drained its reports of the steps up to the
    checkpoint; if it dies in between, a resume from that checkpoint would never report those
    steps again, so the driver resumes from the newest checkpoint it has reported through and
    discards the newer ones (their steps are trained again).
    """
    gone = [p for p in list_checkpoints(run_dir) if step_of(p) > step]
    for p in gone:
        (p / MARKER).unlink(missing_ok=True)  # not a resume point from here on, even half-deleted
        shutil.rmtree(p, ignore_errors=True)
    return [step_of(p) for p in gone]


def rng_state() -> dict[str, Any]:
    """Every random generator a step draws from: Python, NumPy, torch CPU and (if any) CUDA."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _state(module_or_state: Any) -> dict[str, Any]:
    return module_or_state if isinstance(module_or_state, dict) else module_or_state.state_dict()


def save_shared(path: Path, *, policy: Any, tokenizer: Any, optimizer: Any, scheduler: Any,
                critic: Any = None, critic_opt: Any = None, reference: Any = None,
                policy_state: dict[str, Any] | None = None) -> None:
    """Rank 0's part: the policy as an HF directory, and the optimizer state.

    ``critic`` and ``reference`` are modules or whole state dicts; ``policy_state`` is the
    policy's whole state dict when its parameters are sharded (FSDP2). A sharded learner passes
    ``optimizer=None``: each rank saves its own optimizer shards in ``rank<r>.pt``.
    """
    if path.exists() and not (path / MARKER).exists():
        shutil.rmtree(path)  # a save that an earlier attempt left half-written
    path.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(path / "policy", state_dict=policy_state, safe_serialization=True)
    tokenizer.save_pretrained(path / "policy")
    state: dict[str, Any] = {"scheduler": scheduler.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if critic is not None:
        state["critic"] = _state(critic)
        if critic_opt is not None:
            state["critic_optimizer"] = critic_opt.state_dict()
    if reference is not None:  # the frozen reference is the policy after warm start, not now
        state["reference"] = _state(reference)
    torch.save(state, path / "optimizer.pt")


def save_rank(path: Path, rank: int, state: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f"rank{rank}.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(path / f"rank{rank}.pt")


def mark_complete(path: Path, trainer_state: dict[str, Any]) -> None:
    (path / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
    (path / MARKER).write_text("")


def prune(run_dir: str | Path, keep: int, *, reported_through: int | None = None) -> None:
    """Delete all but the newest `keep` complete checkpoints, and the newest one not newer than
    `reported_through` (the step the driver has taken every report of: the resume point if the
    controller dies before the newer checkpoints' steps are reported, see `discard_after`)."""
    found = list_checkpoints(run_dir)
    kept = set(found[-keep:])
    if reported_through is not None:
        safe = [p for p in found if step_of(p) <= reported_through]
        kept.update(safe[-1:])
    for old in found:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)


def load_shared(path: Path, *, optimizer: Any, scheduler: Any, critic: Any = None,
                critic_opt: Any = None, reference: Any = None) -> dict[str, Any]:
    """Restore rank 0's part into what is given (None: skipped); returns it all as saved.

    The returned dict holds the whole ``reference`` and ``critic`` state dicts, for a learner
    that loads them itself (sharded modules take their shards of them).
    """
    state = torch.load(path / "optimizer.pt", weights_only=False)
    if optimizer is not None and "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if critic_opt is not None and "critic_optimizer" in state:
        critic_opt.load_state_dict(state["critic_optimizer"])
    if critic is not None and "critic" in state:
        critic.load_state_dict(state["critic"])
    if reference is not None and "reference" in state:
        reference.load_state_dict(state["reference"])
    return state


def load_rank(path: Path, rank: int) -> dict[str, Any] | None:
    f = path / f"rank{rank}.pt"
    return torch.load(f, weights_only=False) if f.exists() else None


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer_state.json").read_text())


def export_final(out: Path, *, policy: Any, tokenizer: Any,
                 state_dict: dict[str, Any] | None = None) -> Path:
    """Save the final policy as an HF model directory (transformers and vLLM load it);
    ``state_dict``: its whole weights when the policy's parameters are sharded."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
