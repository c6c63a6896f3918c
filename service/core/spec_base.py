"""What every section of a job spec shares: storable values, unknown fields refused, and settings a job
would ignore refused too."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

INT64 = 2**63 - 1


def storable(value: Any) -> Any:
    """Reject what the store or a worker cannot hold: NUL or unpaired surrogates in strings, and
    integers beyond 64 bits. (Floats are kept finite by `allow_inf_nan=False`.)"""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError("must not contain NUL characters")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode (it contains an unpaired surrogate)") from None
    elif isinstance(value, bool):
        pass
    elif isinstance(value, int) and not -INT64 - 1 <= value <= INT64:
        raise ValueError("must fit in 64 bits")
    elif isinstance(value, (list, tuple)):
        for item in value:
            storable(item)
    return value


class _Section(BaseModel):
    # Unknown fields are an error, so a typo ("num_generation") is a 422, not silently ignored.
    # NaN and infinities are refused: JSON cannot carry them and no knob means them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _storable(cls, v: Any) -> Any:
        return storable(v)


def reject_unused(section: BaseModel, where: str, fields: tuple[str, ...], unless: str) -> None:
    """A setting this job would ignore is a mistake to report, not a value to drop: refuse any of
    `fields` of `section` that differs from its default (`unless`: when it would take effect)."""
    changed = [f"{where}.{f}" for f in fields
               if getattr(section, f) != type(section).model_fields[f].get_default(call_default_factory=True)]
    if changed:
        raise ValueError(f"{', '.join(changed)} would have no effect: {'it applies' if len(changed) == 1 else 'they apply'} "
                         f"only {unless}; remove {'it' if len(changed) == 1 else 'them'}")
