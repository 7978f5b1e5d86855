"""Parallelism beyond sharded data parallelism, what the models compute with: experts split over
ranks (``expert.py``), and sequences split over ranks, context parallelism (``context/``: the
load-balanced layout, ring and all-to-all attention, the model's ``ContextParallel`` state and
``context_batch``)."""
