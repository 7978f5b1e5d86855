"""The data: a corpus read, tokenized once, split, and served as each rank's batches."""
