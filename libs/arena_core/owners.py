"""Who owns what: every rollout, group, bundle, environment, episode, evaluation report and
trajectory belongs to a project (the project of the API key that made it) and records that
key (its id, never the secret). docs/projects.md, docs/rollout.md ("Owners").

- **Projects hide.** A key sees only its own project's objects (an admin key sees every
  project's): to a key of another project an object does not exist, so every read, list,
  change, export or stream answers as for an unknown one (404 ``not_found``, same message).
- **Owners refuse.** Within a project, only the key that made an object, or an admin key,
  may cancel, replace, delete or take it over: another key of the project gets 403
  ``forbidden`` (it sees the object, so a 404 would hide nothing).

With keys off (``ARENA_AUTH=off``) nobody is identified: everything is of project
:data:`DEFAULT_PROJECT`, owned by :data:`ANONYMOUS`, and nothing is checked. An object made
while keys were off is then changeable by an admin key only.
"""

from __future__ import annotations

from arena_core.apikeys import DEFAULT_PROJECT, ApiKey
from arena_core.errors import Forbidden, NotFound

#: The owner of everything made while keys are not enforced.
ANONYMOUS = "anonymous"
#: The NATS header naming the project of a message whose body does not (live trainer metrics).
PROJECT_HEADER = "Arena-Project"
__all__ = ["ANONYMOUS", "DEFAULT_PROJECT", "PROJECT_HEADER", "owner_of", "project_of", "sees", "listing_project", "visible",
           "scoped_name", "split_scoped", "named_in", "may_change", "check"]


def owner_of(key: ApiKey | None) -> str:
    """What an object made by ``key`` records as its owner."""
    return key.key_id if key is not None else ANONYMOUS


def project_of(key: ApiKey | None) -> str:
    """The project an object made by ``key`` belongs to (``default`` with keys off)."""
    return key.project if key is not None else DEFAULT_PROJECT


def sees(project: str, key: ApiKey | None) -> bool:
    """Whether an object of ``project`` exists for ``key``: always with keys off, else for a key of
    that project or an admin key."""
    return key is None or key.sees(project)


def listing_project(key: ApiKey | None) -> str | None:
    """The one project a listing, a statistic or an export is limited to for ``key``; ``None``:
    every project (keys off, or an admin key)."""
    return None if key is None or key.allows("admin") else key.project


def visible(project: str, key: ApiKey | None, not_found: str) -> None:
    """Raise 404 ``not_found`` with the message an unknown object gets (``not_found``) unless
    ``key`` sees objects of ``project``."""
    if not sees(project, key):
        raise NotFound(not_found)


def scoped_name(project: str, name: str) -> str:
    """Where ``project``'s object named ``name`` (a name its makers chose: an environment, an
    evaluation job) is kept: ``name`` itself for the default project (as before projects),
    ``{project}/{name}`` for another (a name never holds a ``/``). Names are per project."""
    return name if project == DEFAULT_PROJECT else f"{project}/{name}"


def split_scoped(key: str) -> tuple[str, str]:
    """(project, name) of a :func:`scoped_name`."""
    project, sep, name = key.partition("/")
    return (project, name) if sep else (DEFAULT_PROJECT, key)


def named_in(key: ApiKey | None, asked: str | None) -> str | None:
    """The project in which ``key`` resolves a name (an environment's, an evaluation job's):
    ``asked`` (a ``?project=`` of the route) when the key sees that project (keys off, an admin
    key, or its own), its own project when nothing is asked; ``None`` when it asked for a project
    it does not see (the caller answers 404, as for an unknown name)."""
    if asked is None:
        return project_of(key)
    return asked if sees(asked, key) else None


def may_change(owner: str, key: ApiKey | None) -> bool:
    """Whether ``key`` may change an object owned by ``owner``: always with keys off (``key``
    None), else when it made it or is an admin key."""
    return key is None or key.key_id == owner or key.allows("admin")


def check(owner: str, key: ApiKey | None, what: str) -> None:
    """Raise 403 ``forbidden`` unless ``key`` may change ``what`` (owned by ``owner``; call
    :func:`visible` first, so another project's object is a 404, never a 403)."""
    if not may_change(owner, key):
        raise Forbidden(f"{what} belongs to another API key: only the key that made it, or an admin key, "
                        f"may change it (this key is {key.key_id})")
