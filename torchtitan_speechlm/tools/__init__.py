"""Small standalone tools (reading offline wandb runs back without syncing)."""
