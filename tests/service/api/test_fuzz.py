"""Fuzz the API from its own OpenAPI schema with every schemathesis check: no 5xx, every status,
header and body as documented, invalid requests rejected, the Allow header of a 405 exact.

One check is left out, `positive_data_acceptance` (a request valid by the schema must be
accepted): a job spec has rules across fields (warm-up no longer than the run, LoRA for
TracIn, k <= candidates, ...) and names things that must exist on this server (models, data
files), which JSON Schema cannot say; those requests get a 422 naming the field, which the
other checks verify is documented and shaped as sent."""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import CHECKS

from service.app import create_app
from service.core.settings import Settings
from service.store import jobs as jobs_q
from service.store import keys as keys_q
from service.store.db import session_scope
from service.store.migrate import upgrade

# tinker's forward_backward bodies are protobuf: arbitrary bytes, which the route must refuse with a 400
schemathesis.openapi.media_type("application/x-protobuf", st.binary(max_size=512))
ALL_BUT_POSITIVE = [c for c in CHECKS.get_all() if c.__name__ != "positive_data_acceptance"]
RESPONSE_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Settings:
    """The settings of a store of the test's own, migrated."""
    settings = Settings(GRPO_DATA_DIR=str(tmp_path_factory.mktemp("fuzz")))
    upgrade(settings.store_url)
    return settings


@pytest.fixture(scope="module")
def api_key(store: Settings) -> str:
    """A key whose owner has one job."""
    with session_scope(store.store_url) as db:
        key = keys_q.create_key(db, owner="fuzz")
        jobs_q.create_job(db, owner="fuzz", kind="grpo", spec={"kind": "grpo"}, name=None, total_steps=1)
    return key


@pytest.fixture(scope="module")
def api_schema(store: Settings):
    """The schema, loaded when the test runs: built at collection (schemathesis's coverage cases for 59
    operations), it cost every process that collects the suite about 11 CPU-s, not only the one that runs it."""
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(store))


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(autouse=True)
def _node_id(request) -> None:
    """schemathesis 4.32's lazy schemas read the running test's `_nodeid`, which pytest 9.2 keeps only as
    `nodeid`: each operation then reports as a subtest of this test, by its label."""
    request.node._nodeid = request.node.nodeid


@pytest.mark.long
@pytest.mark.slow  # every operation, one after another, in one test (schemathesis's subtests)
@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_response_is_as_documented(case, api_key):
    if case.path.endswith("/stream"):
        pytest.skip("an endless event stream; covered by test_api")
    # What the responses are, not how fast they come (the API's latency under hostile input is
    # test_hostile_input's, on a machine left to it): schemathesis's default 10 s wait for an in-process
    # answer ran out once on a 2-core machine whose suite ran at half its usual speed (its pages written out).
    case.call_and_validate(headers={"Authorization": f"Bearer {api_key}"}, checks=ALL_BUT_POSITIVE, timeout=RESPONSE_TIMEOUT_S)
