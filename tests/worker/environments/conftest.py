"""The bundled environments' tests import openenv-core, whose package imports its Gradio web interface when
Gradio is installed: about 3.5 CPU-s in every process that collects the suite. No test here serves that
interface, so Gradio is left out, as `worker/environments/serve.py` leaves it out of a bundled server."""

import sys

sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]
