"""Memory accounting: categories, the step tracer (fake tensors) and the planner built on it."""
