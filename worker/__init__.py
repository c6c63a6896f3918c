"""The compute, in rooms: jobs/ (the job host: the only room that may import `service.store`), loops/ (one
run() per job kind on the skeleton and rollouts), session/ (the tinker session run), engines/ (samplers),
model/ (loading, checkpoints and the teacher-forced forward), machine/ (what the worker runs on), parallel/,
environments/, rewards/, algos/ (pure torch). Beside them the records and ports every room shares: the
rollout batch and the sampler protocol (batch.py), the Reporter seam (reporting.py), datasets, the
optimizer and seeding (training.py), the retriever and the sparsity tracker. `service.core` is the one part
of the service they import."""
