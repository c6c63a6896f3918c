"""What tests comparing two runs' metrics leave out: what the machine measured, not what was learned."""

MEASURED = ("time/", "throughput/", "memory/", "tracin/time_s", "sparsity/time_s")

