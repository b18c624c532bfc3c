"""Data: tokenizers, token files, batch loaders and `python -m data.prepare`."""
