"""autopar: automatic parallelization planner and compiler for PyTorch training."""
