"""JSON that is always valid: undefined numbers (NaN, e.g. AUC with one class; Inf) are null.

Python's ``json`` writes NaN as a bare ``NaN``, which is not JSON; every file fedsub writes goes
through ``dumps`` (``allow_nan=False``, so an invalid file can never be written), and readers
turn null metrics back into NaN with ``metrics_from_json``.
"""

from __future__ import annotations

import json
import math
from typing import Any


def nulled(value: Any) -> Any:
    """``value`` with every non-finite float (nested in dicts and lists) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: nulled(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [nulled(v) for v in value]
    return value


def dumps(value: Any, **options: Any) -> str:
    """Valid JSON text: undefined numbers become null."""
    return json.dumps(nulled(value), allow_nan=False, **options)


def metrics_from_json(metrics: dict[str, Any]) -> dict[str, float]:
    """Metrics read back from JSON: null (an undefined metric) is NaN again."""
    return {k: math.nan if v is None else v for k, v in metrics.items()}
