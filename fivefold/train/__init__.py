"""Training: the loop and launcher (`trainer`), config validation, corpus and dataset, run
records."""
