"""Text in, token files out: tokenizers, data.prepare, the token files and their batches."""
