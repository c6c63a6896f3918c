"""Pure torch math with tensor shapes in comments: losses, advantages, influence, selection, retrieval,
sparsity, FLOPs. It imports torch and `service.core` only: nothing of the loops, the store or the API."""
