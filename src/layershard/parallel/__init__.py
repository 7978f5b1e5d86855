"""Parallelism beyond sharded data parallelism: experts split over ranks (expert.py)."""
