"""A run's settings: the (dp, cp, tp, pp) layout and what the DeepSpeed JSON and flags say."""
