"""Analyses and transformations of captured torch.fx graphs."""
