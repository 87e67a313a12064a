"""A small name -> callable registry, shared by objectives, advantages, rewards and tasks.

A registry behaves like a read-only ``Mapping[str, fn]`` (``OBJECTIVES["gspo"]``,
``"gspo" in OBJECTIVES``, iteration in sorted name order). Looking up an unknown name
raises :class:`UnknownNameError`, which is both a ``KeyError`` and a ``ValueError`` and
whose message lists the valid names. Registering a taken name raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

__all__ = ["Registry", "UnknownNameError"]

F = TypeVar("F", bound=Callable[..., Any])

_MISSING: Any = object()


class UnknownNameError(KeyError, ValueError):
    """Lookup of a name that is not registered (catchable as KeyError or ValueError)."""

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return str(self.args[0]) if self.args else ""


class Registry(Mapping[str, F]):
    """A small name -> callable registry.

    Args:
        kind: what is registered, used in error messages ("objective",
            "advantage estimator", ...).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name``; returns ``fn`` unchanged.

        Raises:
            ValueError: if ``name`` is empty or already taken.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = fn
            return fn

        return decorator

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def get(self, name: str, default: Any = _MISSING) -> Any:
        """Return the callable registered as ``name``.

        Unlike ``dict.get``, an unknown name raises :class:`UnknownNameError` unless a
        ``default`` is passed explicitly.
        """
        if name in self._entries:
            return self._entries[name]
        if default is not _MISSING:
            return default
        choices = ", ".join(self.names()) or "(none registered)"
        raise UnknownNameError(f"unknown {self.kind} {name!r}; choose one of: {choices}")

    def __getitem__(self, name: str) -> F:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
