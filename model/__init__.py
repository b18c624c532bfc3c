"""The network: the GPT and generate() (gpt.py), checkpoints, and the optional parts beside them."""
