"""What HF's example scripts write at their end, with HF's names and formats: ``log_metrics`` (a table on
stdout), ``save_metrics`` (``<split>_results.json`` and ``all_results.json``) and ``create_model_card``
(``README.md`` in output_dir). The Trainer's methods of those names call these on the main process.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
from pathlib import Path
from typing import Any

ALL_RESULTS = "all_results.json"


def metrics_format(metrics: dict[str, Any]) -> dict[str, Any]:
    """HF's readable forms: ``*_runtime`` as h:mm:ss.ss, ``*_mem_*`` in MB, ``total_flos`` in GF, other
    floats to 4 decimals."""
    shown: dict[str, Any] = {}
    for key, value in metrics.items():
        if "_mem_" in key and isinstance(value, (int, float)):
            shown[key] = f"{int(value) >> 20}MB"
        elif key.endswith("_runtime") and isinstance(value, (int, float)):
            shown[key] = _duration(float(value))
        elif key == "total_flos" and isinstance(value, (int, float)):
            shown[key] = f"{int(value) >> 30}GF"
        elif isinstance(value, float):
            shown[key] = round(value, 4)
        else:
            shown[key] = value
    return shown


def _duration(seconds: float) -> str:
    whole = datetime.timedelta(seconds=int(seconds))
    return f"{whole}.{int(round((seconds % 1) * 100)) % 100:02d}"


def metrics_table(split: str, metrics: dict[str, Any]) -> str:
    """``***** <split> metrics *****`` and one aligned ``key = value`` line per metric (HF's log_metrics)."""
    shown = metrics_format(metrics)
    if not shown:
        return f"***** {split} metrics *****"
    keys = max(len(str(k)) for k in shown)
    values = max(len(str(v)) for v in shown.values())
    lines = [f"  {k: <{keys}} = {str(shown[k]):>{values}}" for k in sorted(shown)]
    return "\n".join([f"***** {split} metrics *****", *lines])


def save_metrics(output_dir: str | Path, split: str, metrics: dict[str, Any], combined: bool = True) -> Path:
    """Write ``<split>_results.json`` (and merge into ``all_results.json`` when ``combined``)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{split}_results.json"
    plain = {k: _jsonable(v) for k, v in metrics.items()}
    path.write_text(json.dumps(plain, indent=4, sort_keys=True) + "\n", encoding="utf-8")
    if combined:
        every = out / ALL_RESULTS
        merged = json.loads(every.read_text(encoding="utf-8")) if every.exists() else {}
        merged.update(plain)
        every.write_text(json.dumps(merged, indent=4, sort_keys=True) + "\n", encoding="utf-8")
    return path


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def model_card(
    *,
    model_name: str,
    precision: str,
    hyperparameters: dict[str, Any],
    log_history: list[dict[str, Any]],
    language: Any = None,
    license: str | None = None,
    tags: Any = None,
    finetuned_from: str | None = None,
    tasks: Any = None,
    dataset: Any = None,
) -> str:
    """A model card in HF's shape: YAML front matter, what was trained and how, the evaluation results and
    the framework versions. Only what the run knows; nothing is made up."""
    import torch

    import mixprec

    front = {"library_name": "transformers", "tags": ["mixprec", *_list(tags)]}
    for key, value in (("license", license), ("language", language), ("base_model", finetuned_from)):
        if value:
            front[key] = value
    lines = ["---", *(f"{k}: {json.dumps(v)}" for k, v in front.items()), "---", "", f"# {model_name}", ""]
    trained = f"This model was trained with mixprec in {precision}"
    trained += f", from {finetuned_from}" if finetuned_from else ""
    trained += f", on {', '.join(map(str, _list(dataset)))}" if dataset else ""
    lines += [trained + ".", ""]
    if tasks:
        lines += [f"Task: {', '.join(map(str, _list(tasks)))}.", ""]
    lines += ["## Training hyperparameters", ""]
    lines += [f"- {k}: {v}" for k, v in hyperparameters.items() if v is not None]
    evals = [e for e in log_history if any(k.startswith("eval_") for k in e)]
    if evals:
        keys = [k for k in evals[-1] if k.startswith("eval_") and not k.endswith(("_runtime", "_per_second"))]
        lines += ["", "## Evaluation results", "", "| step | epoch | " + " | ".join(keys) + " |"]
        lines += ["|" + " --- |" * (len(keys) + 2)]
        for e in evals:
            row = [str(e.get("step", "")), _cell(e.get("epoch"))] + [_cell(e.get(k)) for k in keys]
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "## Framework versions", "", f"- mixprec {mixprec.__version__}", f"- torch {torch.__version__}"]
    lines += [f"- Python {platform.python_version()}", ""]
    return "\n".join(lines)


def _list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)
