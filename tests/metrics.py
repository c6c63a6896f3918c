"""What tests comparing two runs' metrics leave out: what the machine measured, not what was learned."""

MEASURED = ("time/", "throughput/", "memory/", "mfu/", "tracin/time_s", "sparsity/time_s", "health/grader_time")

