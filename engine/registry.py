"""Name → class registries of the execution seams (attention backends, MoE backends, ...).

Each seam keeps one `Registry`; a backend registers itself with the registry's `register(name)`
class decorator, and the engine picks one once, at construction, by name (`get(name)`). The names
feed CLI choices (`names()`), and an unknown name is a ValueError that lists the known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Classes by name for one seam; `kind` names the seam in error messages ("attention backend")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: make `cls` available as `name` (and set `cls.name`); a second, different
        class under a taken name is a ValueError."""

        def deco(cls: T) -> T:
            taken = self._classes.get(name)
            if taken is not None and taken is not cls:
                raise ValueError(f"{self.kind} {name!r} is already registered ({taken.__name__})")
            cls.name = name
            self._classes[name] = cls
            return cls

        return deco

    def get(self, name: str) -> T:
        """The class registered as `name`; a ValueError listing the known names otherwise."""
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names()) or '(none)'}") from None

    def names(self) -> list[str]:
        """Registered names, sorted (CLI choices)."""
        return sorted(self._classes)
