"""The machinery under train.py: device set-up, optimizer and schedule, HellaSwag, plot, wandb."""
