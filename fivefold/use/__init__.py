"""Using a trained model: `fivefold generate` (`generate.py`) and `fivefold eval` (`evaluate.py`),
each on one process holding the whole model (`model.py`: read from a run of any layout or from a
Hugging Face directory, with its tokenizer)."""
