"""Cell runtime: the edge server of a cell."""
