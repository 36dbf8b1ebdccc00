import pytest

from textstats import median, slugify, top_words, word_count


def test_word_count():
    assert word_count("It's a small world, after all.") == 6
    assert word_count("") == 0


def test_top_words():
    assert top_words("the cat and the hat and the bat", 2) == [("the", 3), ("and", 2)]


def test_slugify():
    assert slugify("  Hello, World! 2024 ") == "hello-world-2024"


def test_median_odd():
    assert median([5, 1, 3]) == 3


def test_median_empty_raises():
    with pytest.raises(ValueError):
        median([])


def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5


def test_median_two_values():
    assert median([10, 20]) == 15
