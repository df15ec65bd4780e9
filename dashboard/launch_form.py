"""The Launch page's form, as data: which config fields it offers, how its values merge into a
config, and which validation error belongs beside which field (no Streamlit here)."""

from __future__ import annotations

import copy
import hashlib
import json
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trainer.config import TrainerConfig

__all__ = [
    "FormField",
    "FORM_FIELDS",
    "get_path",
    "set_path",
    "field_value",
    "merge_form",
    "parse_yaml",
    "errors_by_field",
    "config_files",
    "submission_key",
]


@dataclass(frozen=True)
class FormField:
    """A config field the form offers: dotted path, label, widget kind and its choices."""

    path: str
    label: str
    kind: str  # "select", "int", "float", "bool", "text"
    options: tuple[Any, ...] = ()
    help: str = ""


def _schema_field(path: str) -> Any:
    model: Any = TrainerConfig
    *groups, leaf = path.split(".")
    for group in groups:
        model = model.model_fields[group].annotation
    return model.model_fields[leaf]


def _literal_options(path: str) -> tuple[Any, ...]:
    annotation = _schema_field(path).annotation
    for arg in (annotation, *typing.get_args(annotation)):
        if typing.get_origin(arg) is typing.Literal:
            return typing.get_args(arg)
    return ()


def _field(path: str, label: str, kind: str) -> FormField:
    options = _literal_options(path) if kind == "select" else ()
    return FormField(path, label, kind, options, _schema_field(path).description or "")


# The fields people change between runs; everything else is edited in the YAML.
FORM_FIELDS: tuple[FormField, ...] = (
    _field("model.path", "Model", "text"),
    _field("algorithm.name", "Algorithm", "select"),
    _field("train.max_steps", "Steps", "int"),
    _field("train.lr", "Learning rate", "float"),
    _field("train.batch_size", "Prompts per step", "int"),
    _field("rollout.engine", "Rollout engine", "select"),
    _field("rollout.n", "Responses per prompt", "int"),
    _field("rollout.max_new_tokens", "Max new tokens", "int"),
    _field("rollout.kv_cache_gb", "KV cache (GB, CPU)", "float"),
    _field("placement.mode", "Placement", "select"),
    _field("placement.devices", "Devices", "int"),
    _field("controller.mode", "Controller", "select"),
    _field("sampling.dynamic", "Dynamic sampling", "bool"),
    _field("algorithm.kl_coef", "KL coefficient", "float"),
    _field("seed", "Seed", "int"),
)

_DEFAULTS: dict[str, Any] = TrainerConfig().model_dump(mode="json")


def get_path(config: Mapping[str, Any], path: str, default: Any = None) -> Any:
    """`config["a"]["b"]` for path "a.b", or `default` when any part is missing."""
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def set_path(config: dict[str, Any], path: str, value: Any) -> None:
    """Set `config["a"]["b"] = value` for path "a.b", creating groups on the way."""
    *groups, leaf = path.split(".")
    node = config
    for part in groups:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[leaf] = value


def field_value(config: Mapping[str, Any], path: str) -> Any:
    """What the field shows: the config's value, else TrainerConfig's default."""
    return get_path(config, path, get_path(_DEFAULTS, path))


def merge_form(base: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `base` with the form's values written in where they change what the run gets.

    A value equal to what the run would get anyway (the base's value, or the default when the
    base is silent) is not written, so the stored config stays as short as the YAML it came from.
    """
    merged = copy.deepcopy(dict(base))
    for path, value in values.items():
        if value != field_value(base, path):
            set_path(merged, path, value)
    return merged


def parse_yaml(text: str) -> tuple[dict[str, Any] | None, str | None]:
    """(config, None) for a YAML mapping, (None, message) for anything else."""
    try:
        data = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        return None, f"YAML does not parse{where}: {problem}"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return None, "The config must be a YAML mapping (keys such as `train:` at the top level)."
    return data, None


def errors_by_field(
    errors: Sequence[tuple[str, str]], fields: Sequence[FormField] = FORM_FIELDS
) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """Split (path, message) errors into those shown beside a form field and the rest.

    An error lands beside a field when its path is that field's path; others (group-level
    checks, fields only the YAML holds) come back in the second list with their path.
    """
    paths = {f.path for f in fields}
    beside: dict[str, list[str]] = {}
    rest: list[tuple[str, str]] = []
    for path, message in errors:
        if path in paths:
            beside.setdefault(path, []).append(message)
        else:
            rest.append((path, message))
    return beside, rest


def config_files(directory: Path) -> list[Path]:
    """The ready configs a user can start from, by name."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.suffix in {".yaml", ".yml"})


def submission_key(visit: str, body: Mapping[str, Any]) -> str:
    """The Idempotency-Key of one form submission: the same for the same request in the same
    visit of the page (a double click launches one run), new for a changed form or a new visit."""
    digest = hashlib.sha256(json.dumps([visit, body], sort_keys=True, default=str).encode()).hexdigest()
    return f"dashboard-{digest[:40]}"
