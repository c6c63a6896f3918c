"""The tinker-compatible API (`/api/v1`): the routes the unmodified tinker SDK calls, at its paths and
in its formats (SDK versions tested: service.core.tinker.wire.SDK_VERSIONS_TESTED).

A tinker session is a row of `tinker_sessions`; each training run it creates (`create_model`) is a job of
kind `session` owned by the key's owner, whose id for the SDK (`model_id`) is the job's uid. Every
training operation is stored as a `session_ops` row and answered at once with a future (its
`request_id`); the worker holding the run runs the operations in order, and `retrieve_future` hands
back each result once written. Keys: the owner's API keys, sent by the SDK as `X-API-Key`. Like the
rest of the API it imports the core and the store, never the worker.
"""

from service.api.tinker import checkpoints, client, futures, runs, sampling, sessions, training
from service.api.tinker.schemas import FORWARD_BACKWARD_MAX_BYTES

# each included into the app on its own, in the order the routes were declared (the strict router and
# the OpenAPI document see every route as the app's own)
ROUTERS = tuple(part.router for part in (client, sessions, training, checkpoints, sampling, futures, runs))

__all__ = ["FORWARD_BACKWARD_MAX_BYTES", "ROUTERS"]
