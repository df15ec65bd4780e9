"""Prompt files (JSONL, Parquet) and hub datasets, read into :class:`Example` lists."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.data.examples import DataError, Example


def _example(row: dict[str, Any], *, prompt_key: str, answer_key: str, where: str) -> Example:
    if prompt_key not in row:
        raise DataError(f"{where}: no '{prompt_key}' key (data.prompt_key); keys: {sorted(row)}")
    answer = row.get(answer_key)
    return Example(prompt=str(row[prompt_key]), answer=None if answer is None else str(answer))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: each line must be a JSON object")
            rows.append(row)
    return rows


def _read_hub(dataset_id: str, split: str) -> list[dict[str, Any]]:
    try:
        import datasets  # type: ignore[import-not-found]
    except ModuleNotFoundError as exc:
        raise DataError(
            f"data path {dataset_id!r} is not a local file, and loading hub datasets needs the "
            "`datasets` package (pip install datasets) and network access to the hub"
        ) from exc
    name, _, config = dataset_id.partition(":")  # "openai/gsm8k:main" picks a config
    ds = datasets.load_dataset(name, config or None, split=split)
    return [dict(row) for row in ds]


def load_rows(
    path: str, *, prompt_key: str = "prompt", answer_key: str = "answer", split: str = "train"
) -> list[Example]:
    """Read ``path``: a .jsonl/.json-lines or .parquet file, or a hub dataset id (``id[:config]``)."""
    file = Path(path)
    if file.is_file():
        suffix = file.suffix.lower()
        if suffix in (".jsonl", ".json", ".ndjson"):
            rows = _read_jsonl(file)
        elif suffix in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            rows = pq.read_table(file).to_pylist()
        else:
            raise DataError(f"{path}: unknown format {suffix!r}; use .jsonl or .parquet")
    elif file.suffix.lower() in (".jsonl", ".json", ".parquet", ".pq") or path.startswith(
        (".", "/")
    ):
        raise DataError(f"{path}: no such file")
    else:
        rows = _read_hub(path, split)
    if not rows:
        raise DataError(f"{path}: no rows")
    where = f"{path}"
    return [
        _example(row, prompt_key=prompt_key, answer_key=answer_key, where=f"{where} row {i}")
        for i, row in enumerate(rows)
    ]
