"""The Plan schema and its execution with torch.distributed."""
