"""Learning-rate schedules: the plan a run follows, and how it continues after a resume."""
