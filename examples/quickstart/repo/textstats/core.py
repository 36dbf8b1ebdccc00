"""Word counts, slugs and a median."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

_WORD = re.compile(r"[A-Za-z0-9']+")


def word_count(text: str) -> int:
    """Number of words in ``text`` (letters, digits and apostrophes)."""
    return len(_WORD.findall(text))


def top_words(text: str, n: int = 3) -> list[tuple[str, int]]:
    """The ``n`` most frequent words, lower-cased, most frequent first (ties alphabetical)."""
    counts = Counter(word.lower() for word in _WORD.findall(text))
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:n]


def slugify(text: str) -> str:
    """A URL slug: lower-case words joined by single hyphens."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    return "-".join(words)


def median(values: Sequence[float]) -> float:
    """The median of ``values``: the middle value, or the mean of the two middle values."""
    if not values:
        raise ValueError("median() of an empty sequence")
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid] + ordered[mid + 1]) / 2
