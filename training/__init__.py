"""The machinery under train.py: device set-up, optimizer, run pieces, budget, log and plan."""
