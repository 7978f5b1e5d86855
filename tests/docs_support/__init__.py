"""Helpers of tests/test_docs.py: the guides' code blocks, parsed and run (blocks.py)."""
