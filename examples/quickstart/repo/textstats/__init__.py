"""textstats: small helpers for describing text and numbers."""

from textstats.core import median, slugify, top_words, word_count

__all__ = ["median", "slugify", "top_words", "word_count"]
