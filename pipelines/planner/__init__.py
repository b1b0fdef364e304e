"""The auto-parallel planner: every (dp, cp, tp, pp, ZeRO, micro-batch, recompute) plan for a model on N GPUs,
its memory from the start-up plan, its step time from a calibrated cost model, ranked (launch/plan.py)."""
