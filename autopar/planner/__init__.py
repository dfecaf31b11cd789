"""The planner: an outer search over mesh shapes around an ILP over per-layer strategies."""

from autopar.planner.search import Candidate, SearchResult, search

__all__ = ["Candidate", "SearchResult", "search"]
