"""The ``rubric`` and ``exact`` verifiers, and what text they grade. Pure.

The graded text (``source``) is the agent's *answer* -- ``answer`` in the
``result.json`` the agent wrote beside ``/sandbox/.arena/done`` (a string or number; any
other result is graded as its JSON) -- or its final *diff*.
"""

from __future__ import annotations

import math
import re
import unicodedata
from fractions import Fraction
from typing import Any

import msgspec

from arena_core.schemas import EnvRewardVerifier, ExactVerifier, RubricVerifier

FLAG_NO_ANSWER = "no_answer"


class Outcome(msgspec.Struct, frozen=True, kw_only=True):
    """One verifier's verdict before it becomes a ``VerificationResult``."""

    reward: float
    passed: bool
    components: dict[str, float] = {}
    flags: list[str] = []
    reason: str = ""


def answer_text(result: dict[str, Any] | None) -> str | None:
    """The agent's answer from its ``result.json``; ``None`` when it gave none."""
    if result is None:
        return None
    answer = result.get("answer")
    if isinstance(answer, str):
        return answer
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return repr(answer)
    return msgspec.json.encode(result).decode()


# ------------------------------------------------------------------------------ rubric


class InvalidRubric(ValueError):
    """A rubric regex does not compile."""


def rubric(spec: RubricVerifier, text: str | None) -> Outcome:
    """Weighted share of satisfied items; ``passed`` when every item is satisfied."""
    if not spec.items:
        raise InvalidRubric("a rubric needs at least one item")
    flags = [FLAG_NO_ANSWER] if text is None else []
    text = text or ""
    flags_re = 0 if spec.case_sensitive else re.IGNORECASE
    total = sum(max(item.weight, 0.0) for item in spec.items)
    got = 0.0
    components: dict[str, float] = {}
    misses: list[str] = []
    for i, item in enumerate(spec.items):
        name = item.name or f"item{i}"
        if item.regex:
            try:
                found = re.search(item.pattern, text, flags_re) is not None
            except re.error as exc:
                raise InvalidRubric(f"rubric item {name}: bad regex {item.pattern!r}: {exc}") from exc
        elif spec.case_sensitive:
            found = item.pattern in text
        else:
            found = item.pattern.casefold() in text.casefold()
        ok = found != item.forbidden
        components[name] = 1.0 if ok else 0.0
        if ok:
            got += max(item.weight, 0.0)
        else:
            misses.append(f"{'forbidden' if item.forbidden else 'missing'} {name}")
    reward = got / total if total > 0 else 0.0
    passed = not misses
    reason = "every rubric item satisfied" if passed else "; ".join(misses)
    return Outcome(reward=reward, passed=passed, components=components, flags=flags, reason=reason)


# ------------------------------------------------------------------------------ exact

_BOXED = re.compile(r"\\boxed\{(.*)\}")
_NUMBER = re.compile(r"^[-+]?(\d{1,3}(,\d{3})+|\d+)?(\.\d+)?([eE][-+]?\d+)?$")
_FRACTION = re.compile(r"^([-+]?\d+)\s*/\s*(\d+)$")


def final_answer(text: str) -> str:
    """The last ``\\boxed{...}`` or the part after the last ``####``, else the whole text."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    boxed = _BOXED.findall(text)
    if boxed:
        text = boxed[-1]
    return text.strip()


def normalize_string(text: str, *, case_sensitive: bool) -> str:
    text = unicodedata.normalize("NFKC", final_answer(text))
    text = " ".join(text.split()).strip("\"'`$ ").rstrip(".")
    return text if case_sensitive else text.casefold()


def parse_number(text: str) -> Fraction | float | None:
    """``42``, ``-3.5``, ``1,234``, ``1e-3``, ``3/4``, ``50%`` (= 50), ``$12`` -> a number."""
    s = final_answer(text).strip().strip("$").rstrip(".").strip()
    s = s.removesuffix("%").strip()
    if m := _FRACTION.match(s):
        den = int(m.group(2))
        return Fraction(int(m.group(1)), den) if den else None
    if not s or not _NUMBER.match(s) or not any(c.isdigit() for c in s):
        return None
    try:
        return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _numbers_equal(a: Fraction | float, b: Fraction | float, rel: float) -> bool:
    if a == b:
        return True
    return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=0.0)


def exact(spec: ExactVerifier, text: str | None) -> Outcome:
    if not spec.answers:
        raise InvalidRubric("an exact verifier needs at least one accepted answer")
    if text is None:
        return Outcome(reward=0.0, passed=False, components={"exact": 0.0}, flags=[FLAG_NO_ANSWER],
                       reason="the agent gave no answer")
    got_number = parse_number(text) if spec.mode != "string" else None
    got_string = normalize_string(text, case_sensitive=spec.case_sensitive)
    for expected in spec.answers:
        want_number = parse_number(expected) if spec.mode != "string" else None
        if got_number is not None and want_number is not None:
            if _numbers_equal(got_number, want_number, spec.rel_tolerance):
                return Outcome(reward=1.0, passed=True, components={"exact": 1.0},
                               reason=f"numerically equal to {expected!r}")
            continue
        if spec.mode == "number":
            continue
        if got_string == normalize_string(expected, case_sensitive=spec.case_sensitive):
            return Outcome(reward=1.0, passed=True, components={"exact": 1.0}, reason=f"matches {expected!r}")
    shown = got_string if len(got_string) <= 80 else got_string[:77] + "..."
    return Outcome(reward=0.0, passed=False, components={"exact": 0.0},
                   reason=f"answer {shown!r} matches none of {len(spec.answers)} accepted answers")


# ------------------------------------------------------------------------------ env_reward

FLAG_NOT_DONE = "env_not_done"


def env_reward(spec: EnvRewardVerifier, result: dict[str, Any] | None) -> Outcome:
    """The OpenEnv environment's own rewards (``env_rewards``/``env_done``, recorded by the
    sandbox worker, never written by the agent): their sum or the last one."""
    if result is None or not isinstance(result.get("env_rewards"), list):
        raise InvalidEnvResult("the sandbox recorded no environment rewards (not an OpenEnv episode?)")
    rewards = [float(r) for r in result["env_rewards"] if isinstance(r, (int, float)) and not isinstance(r, bool)
               and math.isfinite(r)]
    done = result.get("env_done") is True
    flags = [] if done else [FLAG_NOT_DONE]
    if spec.require_done and not done:
        return Outcome(reward=0.0, passed=False, flags=flags, reason="the environment never ended the episode")
    if spec.reduce == "last":
        reward = rewards[-1] if rewards else 0.0
    else:
        reward = math.fsum(rewards)
    return Outcome(reward=reward, passed=reward >= spec.pass_threshold, flags=flags,
                   components={"steps": float(len(result["env_rewards"]))},
                   reason=f"{spec.reduce} of {len(rewards)} step rewards = {reward:g}"
                          + ("" if done else " (the environment never said done)"))


class InvalidEnvResult(ValueError):
    """An ``env_reward`` verifier on a rollout that has no recorded environment rewards."""
