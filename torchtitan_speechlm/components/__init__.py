"""What torchtitan's Trainer calls besides the model: loss, metrics processor, validator, and
the exact statistics and resume rules behind them."""
