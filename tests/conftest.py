"""Shared fixtures: real stores and brokers where they run, a clear skip (or, under CI, a failure)
where they do not."""

from __future__ import annotations

import itertools
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# Under pytest-xdist, each test process (and every process it starts) takes its share of the cores:
# OpenMP threads spinning against another worker's on the same cores make a step several times slower.
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(workers))))
    if "torch" in sys.modules:  # a plugin imported it before this file: its pool is sized already
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # (a job's vLLM server on the CPU takes the same count: worker/engines/vllm_engine.py)

PG_ADMIN_URL = os.environ.get("TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ARTIFACTS = Path(__file__).parent.parent / "test-artifacts"


def _machine_auto_dtype() -> str:
    """float32 or bfloat16: `auto`'s choice on this machine, probed once and kept beside the converted models."""
    import torch

    from worker.machine import precision

    root = Path(os.environ.get("GRPO_TEST_MODELS_ROOT") or ARTIFACTS.parent / ".test-models")
    rates, _ = precision.probe(torch.device("cpu"), root / "precision.json")
    return "bfloat16" if rates.speedup >= precision.NATIVE else "float32"


def pytest_configure(config):
    """GRPO_TEST_DETERMINISTIC=1 runs the suite with torch's deterministic algorithms (and warns
    where an op has none): a tolerance that only holds for one kernel choice shows up as a failure."""
    # one API process per `serve` a test starts, as on a one-core machine; the tests of several name theirs
    os.environ.setdefault("GRPO_API_WORKERS", "1")
    # `model.dtype: auto` decided once for the run, as the machine's probe says: a job in a test's own data folder
    # would probe again, and under the suite's load two probes of a CPU near the line can disagree. Set
    # GRPO_AUTO_DTYPE to run the suite under the other choice.
    if "GRPO_AUTO_DTYPE" not in os.environ:
        os.environ["GRPO_AUTO_DTYPE"] = _machine_auto_dtype()
    if os.environ.get("GRPO_TEST_DETERMINISTIC") == "1":
        import torch

        torch.use_deterministic_algorithms(True, warn_only=True)


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require(service: str, host: str, port: int) -> None:
    if not _reachable(host, port):
        msg = f"{service} is not reachable at {host}:{port}"
        if CI:
            pytest.fail(msg + " (CI=true: the suite needs it)")
        pytest.skip(msg)


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    require("PostgreSQL", "127.0.0.1", 5432)
    return PG_ADMIN_URL


@pytest.fixture
def pg_url_factory(pg_admin_url):
    """Fresh PostgreSQL databases for one test, dropped afterwards."""
    from sqlalchemy import create_engine, text

    from service.store.db import get_engine

    admin = create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    made: list[tuple[str, str]] = []

    def make() -> str:
        name = f"grpo_test_{uuid.uuid4().hex[:10]}"
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        url = pg_admin_url.rsplit("/", 1)[0] + f"/{name}"
        made.append((name, url))
        return url

    yield make
    for name, url in made:
        get_engine(url).dispose()
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def pg_url(pg_url_factory):
    """A fresh PostgreSQL database for one test, dropped afterwards."""
    return pg_url_factory()


def _xdist_index(worker_id: str) -> int | None:
    """pytest-xdist's worker number (gw3 -> 3), None when the suite runs in one process."""
    return None if worker_id == "master" else int(worker_id.removeprefix("gw"))


@pytest.fixture
def redis_url(worker_id):
    """The shared Redis, its database emptied; under pytest-xdist each worker process gets its own
    database (1, 2, ...), so one test's Celery worker never takes another's task from the same queue."""
    require("Redis", "127.0.0.1", 6379)
    n = _xdist_index(worker_id)
    url = REDIS_URL if n is None else REDIS_URL.rsplit("/", 1)[0] + f"/{1 + n % 15}"
    # emptied first: a run killed mid-test (or one before on this machine) can leave tasks queued there,
    # which this test's worker would otherwise take for its own job of the same id
    import redis

    with redis.Redis.from_url(url) as r:
        r.flushdb()
    return url


def _environment_python(variable: str, what: str, target: str) -> Path:
    """The Python of an environment of its own that `make test` builds and names in `variable`."""
    python = os.environ.get(variable)
    if not python or not Path(python).exists():
        msg = f"no {what} environment: {variable} is {python!r} (`make {target}` builds it)"
        if CI:
            pytest.fail(msg + " (CI=true: the suite needs it)")
        pytest.skip(msg)
    return Path(python)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The engine environment's Python (`make vllm` builds .venv-vllm)."""
    return _environment_python("GRPO_VLLM_PYTHON", "vLLM", "vllm")


@pytest.fixture(scope="session")
def cookbook_python() -> Path:
    """tinker-cookbook's environment's Python (`make cookbook` builds .venv-cookbook)."""
    return _environment_python("GRPO_COOKBOOK_PYTHON", "tinker-cookbook", "cookbook")


@pytest.fixture(scope="session")
def openenv_python() -> Path:
    """OpenEnv's current release's Python (`make openenv` builds .venv-openenv)."""
    return _environment_python("GRPO_OPENENV_PYTHON", "openenv 0.10", "openenv")


@pytest.fixture(scope="session")
def models_root() -> Path:
    """One model cache for every run in this checkout (GRPO_TEST_MODELS_ROOT, else `.test-models`): the bundled
    SmolLM2 converts from its GGUF once (about 22 CPU-s, most of it transformers' GGUF reader), under a file
    lock, even when pytest-xdist's workers ask for it at the same time; the serial phase, the numerics runs
    and the next run find it converted."""
    root = Path(os.environ.get("GRPO_TEST_MODELS_ROOT") or ARTIFACTS.parent / ".test-models")
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture
def settings_factory(tmp_path, models_root):
    from service.core.settings import Settings

    def make(database_url: str | None = None, broker_url: str | None = None, **extra):
        return Settings(GRPO_DATA_DIR=tmp_path, DATABASE_URL=database_url, BROKER_URL=broker_url,
                        GRPO_MODELS_ROOT=models_root, **extra)

    return make


@pytest.fixture
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


def _digit_share(completion, answers):
    """A reward a 2-layer random model can learn fast: the share of digits in its completion."""
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))


@pytest.fixture
def digit_reward(monkeypatch):
    """Registers `digit_share`, a dense reward with spread even for random models."""
    from service.core import reward_specs
    from worker import rewards as R

    monkeypatch.setitem(R.REGISTRY, "digit_share", R.RewardInfo(_digit_share))
    monkeypatch.setitem(reward_specs.BUILTIN_REWARDS, "digit_share", "share of digits in the completion (tests)")


@pytest.fixture
def constant_reward(monkeypatch):
    """Registers `constant`: 0.5 for every completion, so every group ties whatever the model draws (a random
    model's completions solve an arith sum now and then, which a numeric match would reward)."""
    from service.core import reward_specs
    from worker import rewards as R

    monkeypatch.setitem(R.REGISTRY, "constant", R.RewardInfo(lambda completion, answers: 0.5))
    monkeypatch.setitem(reward_specs.BUILTIN_REWARDS, "constant", "0.5 for every completion (tests)")


@pytest.fixture
def distinct_reward(monkeypatch):
    """Registers `char_code`: the completion's character codes mod 101, which tells almost any two different
    completions apart, so a group of a random model's completions has rewards that differ whatever it draws
    (a digit share of a few random tokens ties at 0 in a group often enough)."""
    from service.core import reward_specs
    from worker import rewards as R

    monkeypatch.setitem(R.REGISTRY, "char_code", R.RewardInfo(lambda completion, answers: sum(map(ord, completion)) % 101 / 100))
    monkeypatch.setitem(reward_specs.BUILTIN_REWARDS, "char_code", "character codes mod 101 (tests)")


def install_reward_plugin(site: Path, dist_name: str, module: str, source: str, name: str) -> None:
    """A package `module` (with `source`) whose entry point in grpo_jobs.rewards names `name`,
    installed in folder `site` (put it on the path to load it)."""
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text(source)
    dist = site / f"{module}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[grpo_jobs.rewards]\n{name} = {module}:{name}\n")


@pytest.fixture
def digit_plugin(tmp_path, monkeypatch):
    """`digit_share` as an installed reward plugin on PYTHONPATH, so processes this test starts
    (ranks, workers) find it too."""
    from service.core.reward_specs import plugins

    site = tmp_path / "site"
    install_reward_plugin(site, "digit-reward", "digit_reward", "def digit_share(completion, answers):\n"
                          "    return sum(c.isdigit() for c in completion) / max(1, len(completion))\n", "digit_share")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    plugins.cache_clear()
    yield site
    plugins.cache_clear()
    from worker.rewards import REGISTRY

    REGISTRY.pop("digit_share", None)
    sys.modules.pop("digit_reward", None)


from fastapi.testclient import TestClient  # noqa: E402

from service.app import create_app  # noqa: E402
from service.store import keys as keys_q  # noqa: E402
from service.store.db import session_scope  # noqa: E402
from service.store.migrate import upgrade  # noqa: E402


class Api:
    """A TestClient on a migrated store with two owners' keys."""

    def __init__(self, settings):
        self.settings = settings
        upgrade(settings.store_url)
        with session_scope(settings.store_url) as s:
            self.alice = keys_q.create_key(s, owner="alice")
            self.bob = keys_q.create_key(s, owner="bob")
        self.client = TestClient(create_app(settings))

    def auth(self, key=None):
        return {"Authorization": f"Bearer {key or self.alice}"}

    def get(self, path, key=None, **kw):
        return self.client.get(path, headers={**self.auth(key), **kw.pop("headers", {})}, **kw)

    def post(self, path, key=None, **kw):
        return self.client.post(path, headers={**self.auth(key), **kw.pop("headers", {})}, **kw)

    def delete(self, path, key=None, **kw):
        return self.client.delete(path, headers={**self.auth(key), **kw.pop("headers", {})}, **kw)

    def upload(self, content: bytes, purpose: str = "train", filename: str = "data.jsonl", key=None):
        return self.post("/v1/files", key=key, files={"file": (filename, content)}, data={"purpose": purpose})

    def run_job(self, spec: dict) -> int:
        """Submit `spec` over HTTP, run it in this process as a worker would, expect success; the job id."""
        from worker.jobs import runner

        r = self.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        jid = r.json()["id"]
        assert runner.run_job(jid, settings=self.settings) == "succeeded"
        return jid


@pytest.fixture(params=["sqlite", "postgres"])
def api(request, settings_factory):
    url = request.getfixturevalue("pg_url") if request.param == "postgres" else None
    return Api(settings_factory(database_url=url))


@pytest.fixture
def sqlite_api(settings_factory):
    return Api(settings_factory())


_PORT_BLOCK = 1500  # ports per test process
_ports_handed = itertools.count()


def free_port() -> int:
    """A free port no other process of this test run is handed: below the kernel's ephemeral range
    (where bind(0) and every outgoing connection take theirs), in a block of its own per xdist
    process, each port handed out once. The port bind(0) gave and the test released raced: another
    test process's server could bind it first, and that server's /healthz then answered for ours."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 0
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    first = low - _PORT_BLOCK * (index + 1)
    if first < 1024:  # no room below the ephemeral range: the kernel's pick, as before
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(_PORT_BLOCK):
        port = first + next(_ports_handed) % _PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken outside this run, or a killed server's connections linger
                continue
            return port
    raise RuntimeError(f"no free port in {first}..{first + _PORT_BLOCK - 1}")


class S3Server:
    """moto's S3-compatible server in its own process, on a free port; `stop()` takes it away."""

    def __init__(self) -> None:
        import subprocess
        import sys
        import time

        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not _reachable("127.0.0.1", self.port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("moto's S3 server did not start")
            time.sleep(0.1)

    def settings(self, bucket: str) -> dict:
        """Settings fields for a store in a fresh `bucket` of this server."""
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        return {"GRPO_ARTIFACT_STORE": f"s3://{bucket}/grpo", "GRPO_S3_ENDPOINT_URL": self.endpoint,
                "GRPO_S3_ACCESS_KEY_ID": "test", "GRPO_S3_SECRET_ACCESS_KEY": "test", "GRPO_S3_REGION": "us-east-1"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture(params=["folder", "s3"])
def store_settings(request) -> dict:
    """Settings fields of an artifact store: the default folder, or a fresh bucket of a local S3 server."""
    if request.param == "folder":
        return {}
    return request.getfixturevalue("s3_server").settings(f"b-{uuid.uuid4().hex[:12]}")


@pytest.fixture(autouse=True)
def _same_numbers_every_run():
    """Each test draws the same random numbers on every run (GRPO_TEST_SEED picks others): a failure
    reproduces. A test that seeds a stream of its own keeps its numbers."""
    from tests.numerics import SEED

    if (torch := sys.modules.get("torch")) is not None:
        torch.manual_seed(SEED)
    if (np := sys.modules.get("numpy")) is not None:
        np.random.seed(SEED)


@pytest.fixture
def tinker_service():
    """`tinker_service(base_url, api_key)`: a tinker.ServiceClient closed when the test ends, so its
    session's heartbeat stops with it (an open one logs 'Session heartbeat failed' for as long as the
    test process lives once its server is gone)."""
    import tinker

    made: list = []

    def make(base_url: str, api_key: str):
        made.append(tinker.ServiceClient(base_url=base_url, api_key=api_key))
        return made[-1]

    yield make
    for client in made:
        try:  # finishes the session where its server still runs; stops the heartbeat either way
            client.close("success").result(timeout=10)
        except Exception:
            pass


def _weight(item) -> int:
    """How long a test is likely to take, in coarse classes, longest first: vLLM servers; the modules whose
    tests share a service they start once (an `xdist_group`: pytest-xdist's `loadgroup` hands such a module
    to one process as one unit, which starts the service once instead of in each process its tests were
    spread over, about 30 CPU-s each); the longest of the rest (`long`: the tinker cookbook's loops, the
    examples, the multi-node faults, the joint retriever's learning, the fuzz test); the other fault tests;
    the other end-to-end tests (real processes); the rest marked slow."""
    path = str(item.path)
    for weight, marker in ((7, "vllm"), (6, "xdist_group"), (5, "long")):
        if item.get_closest_marker(marker):
            return weight
    if "/tests/faults/" in path:
        return 4
    if "/tests/e2e/" in path:
        return 3
    return 2 if item.get_closest_marker("slow") else 0


def pytest_collection_modifyitems(config, items):
    """The longest tests first, a stable sort: the same order in every pytest-xdist process. `make test`
    runs `--dist loadgroup --no-loadscope-reorder`, which hands each process one test (or one group) at a
    time in this order as it frees up, so the long ones spread over the processes from the start and the
    short ones fill in at the end. `--dist worksteal` split the order into one contiguous third a process
    and moved tests by count, not by length: the process holding the long tests kept them, and the
    cookbook's two loops started 23 minutes into a 29-minute phase, the others idle beside them."""
    items.sort(key=lambda item: -_weight(item))


def _cpu_s() -> float:
    """CPU seconds of this process and of every child it has waited for (the servers, workers and runs a
    test starts, once they have exited)."""
    import resource

    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each test's CPU and wall seconds, setup to teardown, ride on its teardown report: on two cores a
    suite is as long as its computing, so the run's summary ranks tests by CPU as well as by wall time."""
    if call.when == "setup":
        item.stash[_AT_SETUP] = (_cpu_s(), time.monotonic())
    outcome = yield
    if call.when == "teardown" and _AT_SETUP in item.stash:
        cpu, wall = item.stash[_AT_SETUP]
        outcome.get_result().user_properties += [("cpu_s", round(_cpu_s() - cpu, 1)),
                                                 ("wall_s", time.monotonic() - wall)]


_AT_SETUP = pytest.StashKey[tuple[float, float]]()
_cpu_by_test: dict[str, float] = {}
_SLOW_S = 60.0
_started = time.monotonic()
_reporter = None  # the controller's terminal, where the long tests are named as they end


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    global _reporter
    if not hasattr(session.config, "workerinput"):  # the controller: pytest-xdist's workers print nowhere
        _reporter = session.config.pluginmanager.get_plugin("terminalreporter")


def pytest_runtest_logreport(report):
    properties = dict(report.user_properties) if report.when == "teardown" else {}
    if "cpu_s" in properties:
        _cpu_by_test[report.nodeid] = properties["cpu_s"]
    # A long test is named in the log as it ends, with the run's clock: a run cut off by CI's time limit
    # still says where its time went (the summary below prints only once every test is done).
    if properties.get("wall_s", 0.0) >= _SLOW_S and _reporter is not None:
        minutes, seconds = divmod(int(time.monotonic() - _started), 60)
        # on a line of its own: the progress dots leave the cursor mid-line
        _reporter.write(f"\n[{minutes:3d}:{seconds:02d}] {properties['wall_s']:5.0f}s {report.nodeid}\n")


def pytest_terminal_summary(terminalreporter):
    if not _cpu_by_test:
        return
    ranked = sorted(_cpu_by_test.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"CPU seconds by test: {sum(_cpu_by_test.values()):,.0f} in all, the 30 most")
    for nodeid, seconds in ranked[:30]:
        terminalreporter.write_line(f"{seconds:8.1f}s cpu {nodeid}")
    by_file: dict[str, float] = {}
    for nodeid, seconds in ranked:
        by_file[nodeid.split("::")[0]] = by_file.get(nodeid.split("::")[0], 0.0) + seconds
    terminalreporter.write_sep("-", "CPU seconds by file, the 15 most")
    for path, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:15]:
        terminalreporter.write_line(f"{seconds:8.1f}s cpu {path}")
