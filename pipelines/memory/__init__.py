"""Device and host memory of a run: the start-up plan, whether it fits, and what the engine really holds."""
