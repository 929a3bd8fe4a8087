"""Runtime: the hooks on the model and the per-model engine behind them."""
