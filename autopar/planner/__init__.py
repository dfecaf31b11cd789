"""The planner: every configuration (mesh, schedule, micro-batches) through one engine of
per-layer option ILPs, the fastest plan kept."""

from autopar.planner.configs import Config
from autopar.planner.engine import Engine, Outcome, evaluate_plan
from autopar.planner.search import Candidate, SearchResult, search

__all__ = ["Candidate", "Config", "Engine", "Outcome", "SearchResult", "evaluate_plan", "search"]
