"""The artifact store: checkpoints and uploaded files, by key, in a folder or in S3-compatible
object storage, through fsspec.

The API streams downloads from it and workers write checkpoints and read files through it, so
with `GRPO_ARTIFACT_STORE=s3://bucket/prefix` API and workers share no disk. Keys:

    <job uid>/checkpoints/step-N/<file>     a job's checkpoints (worker/model/checkpoints.py)
    files/<owner folder>/<file id>          uploaded data files (service/core/datafiles.py)

A store that cannot be reached raises `ArtifactStoreError` with a message naming the store
(never its credentials); a missing key is a plain FileNotFoundError. Never imports torch.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import fsspec

from service.core.settings import Settings

T = TypeVar("T")

# A marker file written last: a checkpoint folder without it is incomplete (a crash mid-upload).
COMPLETE = "trainer_state.pt"


class ArtifactStoreError(RuntimeError):
    """The store could not be reached or refused an operation; the message says which store."""


@dataclass(frozen=True)
class Stored:
    key: str  # relative to the prefix it was listed under
    size: int


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_key(owner_folder: str, file_id: str) -> str:
    return f"files/{owner_folder}/{file_id}"


def checkpoints_prefix(uid: str) -> str:
    return f"{uid}/checkpoints"


def checkpoint_key(uid: str, step: int) -> str:
    return f"{checkpoints_prefix(uid)}/step-{step}"


def newest_step(files: list[Stored]) -> int | None:
    """The newest complete checkpoint among files listed under a checkpoints prefix."""
    done = (re.fullmatch(r"step-(\d+)/" + re.escape(COMPLETE), f.key) for f in files)
    return max((int(m.group(1)) for m in done if m), default=None)


class ArtifactStore:
    """Keys are '/'-separated paths under `root` of filesystem `fs`."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, *, name: str, local: bool) -> None:
        self.fs, self.root, self.name, self.local = fs, root.rstrip("/"), name, local

    def _path(self, key: str) -> str:
        return f"{self.root}/{key.strip('/')}" if key.strip("/") else self.root

    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        try:
            return fn(*args, **kw)
        except FileNotFoundError:
            raise
        except Exception as exc:  # botocore/aiohttp/OS errors: one readable error naming the store
            raise ArtifactStoreError(f"the artifact store ({self.name}) could not {what}: "
                                     f"{type(exc).__name__}: {exc}") from exc

    def local_path(self, key: str) -> Path | None:
        """Where `key` lives on this machine's disk, for the filesystem store (no copy needed)."""
        return Path(self._path(key)) if self.local else None

    # -- reading -----------------------------------------------------------------------------
    def list(self, prefix: str) -> list[Stored]:
        """Every file under `prefix`, keys relative to it, sorted; [] when there is none."""
        base = self._path(prefix)

        def find() -> dict[str, Any]:
            if not self.fs.exists(base):
                return {}
            return cast(dict[str, Any], self.fs.find(base, detail=True))

        found = self._call(f"list {prefix}", find)
        strip = len(base.rstrip("/")) + 1  # roots carry no protocol, so found paths start with base
        out = [Stored(p[strip:], int(info.get("size") or 0))
               for p, info in found.items() if info.get("type", "file") == "file"]
        return sorted(out, key=lambda s: s.key)

    def ping(self) -> None:
        """One cheap call to the store; ArtifactStoreError when it cannot be reached."""
        self._call("be reached", self.fs.exists, self.root)

    def exists(self, key: str) -> bool:
        return bool(self._call(f"look up {key}", self.fs.exists, self._path(key)))

    def open(self, key: str) -> BinaryIO:
        return cast(BinaryIO, self._call(f"read {key}", self.fs.open, self._path(key), "rb"))

    def get_file(self, key: str, dest: Path) -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        self._call(f"download {key}", self.fs.get_file, self._path(key), str(tmp))
        tmp.replace(dest)
        return dest

    def get_dir(self, prefix: str, dest: Path) -> Path:
        """Download every file under `prefix` into folder `dest` (replaced when it exists)."""
        files = self.list(prefix)
        if not files:
            raise FileNotFoundError(f"{prefix} is not in the artifact store")
        tmp = dest.with_name(dest.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        for f in files:
            self.get_file(f"{prefix}/{f.key}", tmp / f.key)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        return dest

    # -- writing -----------------------------------------------------------------------------
    def put_fileobj(self, key: str, src: BinaryIO) -> None:
        def put() -> None:
            with self.fs.open(self._path(key), "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        self._call(f"write {key}", put)

    def put_dir(self, prefix: str, src: Path) -> None:
        """Upload folder `src` as `prefix/...`, the COMPLETE marker last: a reader that sees the
        marker sees every other file."""
        files = sorted((p for p in src.rglob("*") if p.is_file()), key=lambda p: p.name == COMPLETE)
        for p in files:
            self._call(f"write {prefix}", self.fs.put_file, str(p), self._path(f"{prefix}/{p.relative_to(src).as_posix()}"))

    def delete(self, prefix: str) -> int:
        """Remove every file under `prefix`; how many there were."""
        n = len(self.list(prefix))
        if n or self.exists(prefix):
            self._call(f"delete {prefix}", self.fs.rm, self._path(prefix), recursive=True)
        return n


def folder_store(root: Path, *, name: str) -> ArtifactStore:
    root.mkdir(parents=True, exist_ok=True)
    return ArtifactStore(fsspec.filesystem("file", auto_mkdir=True), str(root.resolve()), name=name, local=True)


def open_store(settings: Settings) -> ArtifactStore:
    """The store `settings` name: S3 for an `s3://` GRPO_ARTIFACT_STORE, else the folder."""
    url = settings.artifact_store_url.strip()
    if not url:
        return folder_store(settings.artifacts_dir, name="$GRPO_ARTIFACTS_ROOT")
    if not url.startswith("s3://"):
        raise ValueError(f"GRPO_ARTIFACT_STORE must be empty or s3://bucket/prefix, not {url!r}")
    return ArtifactStore(_s3(settings.s3_endpoint_url, settings.s3_region, settings.s3_access_key_id,
                             settings.s3_secret_access_key.get_secret_value() if settings.s3_secret_access_key else None),
                         url[len("s3://"):], name=url, local=False)


@lru_cache(maxsize=8)
def _s3(endpoint: str | None, region: str | None, key: str | None, secret: str | None) -> fsspec.AbstractFileSystem:
    import s3fs

    return s3fs.S3FileSystem(
        key=key, secret=secret, endpoint_url=endpoint, use_listings_cache=False, skip_instance_cache=True,
        client_kwargs={"region_name": region} if region else {},
        # a store that went away fails a call in seconds, never hangs a request or a step
        config_kwargs={"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3, "mode": "standard"}},
    )
