"""Multi-turn episodes in an environment outside the worker (OpenEnv): the token contract of a turn
(turns.py), an episode and its training rows (episodes.py), a session over OpenEnv's WebSocket protocol with
its MCP tool calls (client.py), what a turn sends and reads back (acting.py; tools as models call them:
tools.py), what bounds an episode (limits.py), playing a step's episodes (runner.py: waves; continuous.py:
the default), the Task API's splits (tasks.py), demonstrations for a cold start (demos.py), the bundled
environments and their server (bundled.py, serve.py, servers.py) and a job's environment (host.py). They
import torch, `worker.engines` and `service.core`, never the store; bundled.py and serve.py import
openenv-core and run in the environment server's process, never in a job's."""
