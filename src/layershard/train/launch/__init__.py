"""The launcher: everything before the ranks start (one process per node)."""
