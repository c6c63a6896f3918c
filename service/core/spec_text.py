"""Parse a job spec written as YAML (or JSON, which is YAML) within limits, so that no text can
take the API's time or memory: nesting depth, the number of nodes once aliases and merge keys
are expanded (an alias counts the whole subtree it stands for, so a billion-laughs bomb is
refused after a few thousand events), and the length of integers. The check walks libyaml's
event stream, which needs no recursion; only a text within limits is then composed and loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

MAX_DEPTH = 64
MAX_NODES = 50_000
MAX_INT_DIGITS = 40
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_INTLIKE = re.compile(r"[-+]?[0-9][0-9_]*")


class SpecTextError(ValueError):
    """The text is not YAML, or is beyond the limits; `line` is 1-based where known."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.message, self.line = message, line


class SpecTextBeyondLimits(SpecTextError):
    """Refused before composing: too deep, too many nodes, or too long an integer."""


@dataclass
class ParsedSpec:
    data: object  # what the text holds
    root: yaml.Node | None  # the composed tree, for the line of each field


def _line(event: Any) -> int | None:
    mark = getattr(event, "start_mark", None)
    return mark.line + 1 if mark is not None else None


def check_limits(text: str, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES) -> None:
    try:
        _check_events(text, max_depth=max_depth, max_nodes=max_nodes)
    except yaml.YAMLError as exc:
        # libyaml (PyYAML >= 6.0.4) refuses deep nesting itself, scanning ahead of the events we count
        if "nesting depth" not in str(getattr(exc, "problem", "") or exc):
            raise
        mark = getattr(exc, "problem_mark", None)
        raise SpecTextBeyondLimits(f"nested deeper than {max_depth} levels",
                                   mark.line + 1 if mark is not None else None) from None


def _check_events(text: str, *, max_depth: int, max_nodes: int) -> None:
    depth = nodes = 0
    open_: list[tuple[str | None, int]] = []  # (anchor, nodes when it opened)
    sizes: dict[str, int] = {}  # anchor -> nodes it expands to
    for ev in yaml.parse(text, Loader=_Loader):
        if isinstance(ev, yaml.ScalarEvent):
            nodes += 1
            if ev.anchor:
                sizes[ev.anchor] = 1
            if ev.implicit[0] and len(ev.value) > MAX_INT_DIGITS and _INTLIKE.fullmatch(ev.value):
                raise SpecTextBeyondLimits(f"integer with more than {MAX_INT_DIGITS} digits", _line(ev))
        elif isinstance(ev, yaml.CollectionStartEvent):
            nodes += 1
            depth += 1
            if depth > max_depth:
                raise SpecTextBeyondLimits(f"nested deeper than {max_depth} levels", _line(ev))
            open_.append((ev.anchor, nodes))
        elif isinstance(ev, yaml.CollectionEndEvent):
            depth -= 1
            anchor, start = open_.pop()
            if anchor:
                sizes[anchor] = nodes - start + 1
        elif isinstance(ev, yaml.AliasEvent):
            nodes += sizes.get(ev.anchor, 1)
        if nodes > max_nodes:
            raise SpecTextBeyondLimits(f"more than {max_nodes} values once aliases and merge keys are expanded", _line(ev))


def parse_spec_text(text: str) -> ParsedSpec:
    """The data of a YAML or JSON text within the limits; SpecTextError otherwise."""
    try:
        check_limits(text)
        return ParsedSpec(data=yaml.load(text, Loader=_Loader), root=yaml.compose(text, Loader=_Loader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise SpecTextError(f"not valid YAML or JSON: {getattr(exc, 'problem', None) or exc}",
                            mark.line + 1 if mark is not None else None) from None
