"""The ``python`` verifier: a plug-in found by entry point in group ``arena.verifiers``.

A plug-in is a callable ``verify(request: PluginRequest) -> float | PluginVerdict`` (sync or
async), run in the worker's process. See docs/verification.md (Verifiers, **python**).
"""

from __future__ import annotations

import inspect
from importlib.metadata import entry_points
from typing import Any

import msgspec

from arena_core.errors import VerificationError
from arena_core.schemas import PythonVerifier, Task
from arena_verification.answers import Outcome

GROUP = "arena.verifiers"


class InvalidPlugin(VerificationError):
    code = "invalid_plugin"


class PluginRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What a plug-in gets."""

    rollout_id: str
    task: Task
    diff: str
    answer: str | None  # ``answer`` from the agent's result.json, if any
    result: dict[str, Any] | None  # the whole result.json
    config: dict[str, Any]  # the verifier's ``config``


class PluginVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """What a plug-in may return instead of a bare reward."""

    reward: float
    passed: bool | None = None  # default: reward == 1
    components: dict[str, float] = {}
    flags: list[str] = []
    reason: str = ""


def load(name: str):
    found = [ep for ep in entry_points(group=GROUP) if ep.name == name]
    if not found:
        known = sorted(ep.name for ep in entry_points(group=GROUP))
        raise InvalidPlugin(f"no verifier plug-in {name!r} in entry-point group {GROUP} (installed: {known or 'none'})")
    try:
        fn = found[0].load()
    except Exception as exc:  # noqa: BLE001 - any import error of a plug-in is the plug-in's
        raise InvalidPlugin(f"verifier plug-in {name!r} does not import: {exc!r}") from exc
    if not callable(fn):
        raise InvalidPlugin(f"verifier plug-in {name!r} is not callable")
    return fn


async def run_plugin(spec: PythonVerifier, request: PluginRequest) -> Outcome:
    fn = load(spec.name)
    try:
        value = fn(request)
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:  # noqa: BLE001 - reported with the plug-in's name, then retried
        raise VerificationError(f"verifier plug-in {spec.name!r} raised {exc!r}") from exc
    if isinstance(value, bool) or not isinstance(value, (int, float, PluginVerdict)):
        raise InvalidPlugin(f"verifier plug-in {spec.name!r} returned {type(value).__name__}, "
                            "not a float or PluginVerdict")
    verdict = value if isinstance(value, PluginVerdict) else PluginVerdict(reward=float(value))
    if not 0.0 <= verdict.reward <= 1.0:
        raise InvalidPlugin(f"verifier plug-in {spec.name!r} returned reward {verdict.reward}, not in [0, 1]")
    passed = verdict.passed if verdict.passed is not None else verdict.reward == 1.0
    return Outcome(reward=verdict.reward, passed=passed, components={spec.name: verdict.reward, **verdict.components},
                   flags=list(verdict.flags), reason=verdict.reason or f"plug-in {spec.name}: {verdict.reward:g}")
