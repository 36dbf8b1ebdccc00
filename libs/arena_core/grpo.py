"""Group-relative advantages (GRPO): how much better each member of a group did than its peers.

Pure functions, no I/O. The trajectory plane attaches these to every ``GroupCompleted``;
trainers may recompute them with other options from ``GroupCompleted.rewards``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], *, normalize_std: bool = True, eps: float = 1e-6) -> list[float]:
    """``(r - mean) / (std + eps)`` for each reward, with the population std of the group.

    ``normalize_std=False`` returns ``r - mean`` (Dr. GRPO style). A group whose rewards
    are all equal carries no learning signal: every advantage is exactly ``0.0``.
    Raises ``ValueError`` on a NaN or infinite reward instead of spreading it.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    values = [float(r) for r in rewards]
    if not values:
        return []
    for r in values:
        if not math.isfinite(r):
            raise ValueError(f"reward {r} is not a finite number")
    if max(values) == min(values):
        return [0.0] * len(values)
    mean = math.fsum(values) / len(values)
    centered = [r - mean for r in values]
    if not normalize_std:
        return centered
    std = math.sqrt(math.fsum(c * c for c in centered) / len(values))
    return [c / (std + eps) for c in centered]
