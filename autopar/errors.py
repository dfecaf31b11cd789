"""Errors autopar raises on purpose, each with a message a user can act on."""

from cost_models.errors import AutoparError, ConfigError
from passes.trace import GraphCaptureError as CaptureError
from runtime.plan import PlanError

# CaptureError (the model could not be captured; the message names the construct, the
# source line and the `opaque=` remedy) is defined in passes.trace, where capture lives,
# so that passes/ can raise it without importing from above.


class InfeasibleError(AutoparError):
    """No plan fits the cluster; the message gives the smallest per-rank memory any plan needs."""


class TimeLimitError(AutoparError):
    """The search found no plan within its time limit; the message says how to allow more."""


__all__ = ["AutoparError", "CaptureError", "ConfigError", "InfeasibleError", "PlanError",
           "TimeLimitError"]
