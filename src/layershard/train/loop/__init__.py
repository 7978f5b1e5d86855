"""The loop: one rank's life (rank.py) around the training loop (trainer.py)."""
