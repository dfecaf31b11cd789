"""Errors autopar raises on purpose, each with a message a user can act on."""

from cost_models.errors import AutoparError, ConfigError
from runtime.plan import PlanError


class CaptureError(AutoparError):
    """The model could not be captured as a graph; the message names the construct and line."""


class InfeasibleError(AutoparError):
    """No plan fits the cluster; the message gives the smallest per-rank memory any plan needs."""


__all__ = ["AutoparError", "CaptureError", "ConfigError", "InfeasibleError", "PlanError"]
