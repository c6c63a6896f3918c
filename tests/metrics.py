"""What tests comparing two runs' metrics leave out: what the machine measured, not what was learned."""

from service.core.fingerprint import MEASURED  # noqa: F401  (one definition, shared with `grpo-jobs reproduce`)
