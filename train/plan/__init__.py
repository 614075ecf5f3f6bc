"""Planning a layout before running it: the memory/cost model, the planner and the AOT check."""
