"""The machine: devices, links, clusters, and estimators of time and memory."""
