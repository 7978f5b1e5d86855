"""`layershard train`: pre-training and fine-tuning from one command, one machine to many.

launch.py prepares everything in one process and starts the ranks with torchrun; rank.py (with trainer.py) is what
each rank runs. config.py (flags and YAML), data.py (corpus, split, tokens, per-rank batches),
tokenizer.py (cached BPE), sft.py (loss masks), modeling.py (which model), report.py (metrics
and plot). trainer.py calls layershard's public API directly (shard, save/load_checkpoint, export_hf).
"""
