"""The planner: trace the trainer's own step on fake tensors, predict each rank's memory for every
candidate strategy, cost it, search, and report (``memfit plan``)."""
