"""Node 0's side of a multi-node job: the rendezvous port it hosts on, and the marker the other nodes check to
know they see its files."""

import socket

import pytest

from service.core.queue import NodeMessage
from tests.conftest import free_port
from worker.jobs import nodes


def test_node_0_hosts_on_a_free_port_of_the_range_at_its_address(settings_factory):
    port = free_port()
    settings = settings_factory(GRPO_RENDEZVOUS_PORTS=f"{port}-{port}", GRPO_NODE_ADDRESS="10.0.0.7")
    assert nodes.rendezvous_endpoint(settings) == f"10.0.0.7:{port}"
    with socket.create_server(("", port)):  # another program holds the only port
        with pytest.raises(nodes.NoRendezvousPort, match=f"every port of GRPO_RENDEZVOUS_PORTS \\({port}-{port}\\)"):
            nodes.rendezvous_endpoint(settings)
    taken, free = free_port(), free_port()
    with socket.create_server(("", taken)):  # the range's other ports are tried
        wide = settings_factory(GRPO_RENDEZVOUS_PORTS=f"{min(taken, free)}-{max(taken, free)}", GRPO_NODE_NAME="n1")
        assert nodes.rendezvous_endpoint(wide).rsplit(":", 1)[1] != str(taken)
    assert wide.rendezvous_address == socket.gethostname() and wide.node == "n1"


def test_a_node_sees_node_0s_files_only_through_the_same_cache(settings_factory, tmp_path):
    settings = settings_factory()
    message = NodeMessage(job_id=1, uid="u1", gpus=0, attempt=2, node=1, endpoint="h:1", head="a:1:x")
    assert not nodes.sees_node_0(settings, message)
    marker = nodes.shared_marker(settings, "u1", 2)
    marker.parent.mkdir(parents=True)
    marker.write_text("a:1:x")
    assert nodes.sees_node_0(settings, message)
    assert not nodes.sees_node_0(settings, NodeMessage(job_id=1, uid="u1", gpus=0, attempt=2, node=1, endpoint="h:1", head="a:2:y"))  # another lease's
