"""A checkpoint as a streamed .tar.gz: read from the artifact store and compressed on the fly,
with memory bounded by a pipe's buffer however large the weights are."""

from __future__ import annotations

import logging
import os
import tarfile
import threading
import time
from collections.abc import Iterator

from service.core.artifacts import COMPLETE, ArtifactStore, Stored

log = logging.getLogger(__name__)
CHUNK = 1 << 16


def downloadable(files: list[Stored]) -> list[Stored]:
    """What a user takes away: the weights, their config and the tokenizer; not the optimizer
    state (a pickle, only for resuming inside the service)."""
    return [f for f in files if f.key != COMPLETE]


def tar_gz(store: ArtifactStore, prefix: str, files: list[Stored], *, top: str) -> Iterator[bytes]:
    """Chunks of a .tar.gz holding `files` (listed under `prefix`) in folder `top/`.

    A thread writes the archive into a pipe while this generator reads it: a client that stops
    reading closes the pipe, and the writer stops at its next write."""
    read_fd, write_fd = os.pipe()

    def write() -> None:
        try:
            with os.fdopen(write_fd, "wb") as out, tarfile.open(fileobj=out, mode="w|gz") as tar:
                for f in files:
                    info = tarfile.TarInfo(f"{top}/{f.key}")
                    info.size, info.mtime, info.mode = f.size, int(time.time()), 0o644
                    with store.open(f"{prefix}/{f.key}") as src:
                        tar.addfile(info, src)
        except BrokenPipeError:
            pass  # the client went away
        except Exception:  # the store failed mid-stream: the archive ends short, and the log says why
            log.exception("archive of %s stopped", prefix)

    writer = threading.Thread(target=write, name=f"tar-{top}", daemon=True)
    writer.start()
    with os.fdopen(read_fd, "rb") as inp:
        while chunk := inp.read(CHUNK):
            yield chunk
    writer.join()
