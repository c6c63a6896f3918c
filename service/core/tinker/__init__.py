"""The tinker-compatible API's contract, shared by its routes (service/api/tinker/) and the session run
(worker/session/): the SDK's wire format (wire.py), its requests as records (requests.py) and sampling's
parameters (sampling.py). As all of `service.core`, it imports neither torch, FastAPI, the store nor the
worker."""
