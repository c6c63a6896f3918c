"""The compute, in rooms: jobs/ (the job host: the only room that may import `service.store`), loops/,
engines/, parallel/, session/, algos/, rewards/; beside them the parts the loops share (the Reporter seam,
models, checkpoints, datasets, training helpers). `service.core` is the one part of the service they import."""
