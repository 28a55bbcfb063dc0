"""Argument checks shared by the model constructors.

Every check raises an error that names the parameter, the value it got and what is
allowed, so a bad hyper-parameter fails when the model is built, not mid-training.
"""

from __future__ import annotations

from collections.abc import Sequence


def check_int(name: str, value: object, *, minimum: int) -> int:
    """Return `value` if it is an int >= `minimum` (bool is rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}; got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value}")
    return value


def check_layer_sizes(name: str, value: object, *, allow_empty: bool = True) -> tuple[int, ...]:
    """Return hidden-layer sizes as a tuple of positive ints (lists from YAML are accepted)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of positive ints (layer sizes); got {value!r}")
    sizes = tuple(value)
    if not sizes and not allow_empty:
        raise ValueError(f"{name} must list at least one layer size; got {value!r}")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a list of positive ints (layer sizes); got {value!r}")
    return sizes


def check_dropout(name: str, value: object) -> float:
    """Return `value` as a float probability in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1); got {value!r}")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1); got {value!r}")
    return float(value)


def check_choice(name: str, value: object, allowed: Sequence[str]) -> str:
    """Return `value` if it is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}; got {value!r}")
    return value  # type: ignore[return-value]
