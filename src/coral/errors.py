"""User-facing error types: raised for bad input, printed by the CLI without a traceback."""
from collections.abc import Iterable


class CoralError(Exception):
    """A mistake in the user's input or environment, with a message that says how to fix it."""


class UnknownNameError(CoralError, KeyError):
    """A name (GPU, configuration, region, model, scenario) that is not in the catalog."""

    def __init__(self, kind: str, name: str, valid: list[str] | tuple[str, ...]) -> None:
        self.kind = kind
        self.name = name
        self.valid = tuple(valid)
        shown = ", ".join(self.valid) if self.valid else "(none)"
        super().__init__(f"unknown {kind} {name!r}; valid {kind}s: {shown}")

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def unknown(kind: str, name: str, valid: "Iterable[str]") -> UnknownNameError:
    """Build the error for an unknown name, listing the valid ones sorted."""
    return UnknownNameError(kind, name, sorted(valid))
