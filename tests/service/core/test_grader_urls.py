"""Grader URLs against the allow-list, compared as URLs: every way a string prefix was fooled."""

import ipaddress

import pytest

from service.core.grader_urls import (
    UrlRefused,
    check_address,
    check_url,
    parse_allow_list,
    parse_url,
)

ALLOW = parse_allow_list(["http://127.0.0.1:8791/ok/", "http://127.0.0.1:8793", "https://Graders.Example/team-a",
                          "http://169.254.10.10/grade"])

ALLOWED = [  # (url, what is called)
    ("http://127.0.0.1:8791/ok/score", "http://127.0.0.1:8791/ok/score"),
    ("http://127.0.0.1:8791/ok/./a/../score", "http://127.0.0.1:8791/ok/score"),
    ("http://127.0.0.1:8791/ok/sc%6Fre?x=1", "http://127.0.0.1:8791/ok/score?x=1"),
    ("HTTP://127.0.0.1:8793/anything", "http://127.0.0.1:8793/anything"),
    ("https://graders.example/team-a", "https://graders.example/team-a"),
    ("https://graders.example:443/team-a/x", "https://graders.example/team-a/x"),
    ("https://GRADERS.example./team-a/x", "https://graders.example/team-a/x"),
    ("http://169.254.10.10/grade", "http://169.254.10.10/grade"),  # the admin named this very address
]

REFUSED = [  # (url, words of the reason)
    ("http://127.0.0.1:8791/ok/../other/score", "allow-list"),
    ("http://127.0.0.1:8791/ok/%2e%2e/other/score", "allow-list"),
    ("http://127.0.0.1:8791/ok/%2E%2E%2Fother", "allow-list"),
    ("http://127.0.0.1:8791/ok/%252e%252e/other", "percent-encoded twice"),
    ("http://127.0.0.1:8793@127.0.0.2:8792/score", "userinfo"),
    ("http://user:pw@127.0.0.1:8793/score", "userinfo"),
    ("http://127.0.0.1:8791\\@127.0.0.2/ok/", "backslash"),
    ("http://127.0.0.1:8791/ok/x#frag", "fragment"),
    ("http://127.0.0.1:8792/ok/score", "allow-list"),  # another port
    ("http://127.0.0.1/ok/score", "allow-list"),  # the default port is not 8791
    ("https://127.0.0.1:8791/ok/score", "allow-list"),  # another scheme
    ("https://graders.example/team-ab", "allow-list"),  # not on a segment boundary
    ("https://graders.example.evil.test/team-a", "allow-list"),
    ("http://127.0.0.2:8793/", "allow-list"),
    ("http://0x7f.0.0.1:8793/", "neither a DNS name"),
    ("http://127.0.0.1:99999/ok/", "port"),
    ("ftp://127.0.0.1:8791/ok/", "http:// or https://"),
    ("http://127.0.0.1:8791/ok/\u00e9", "ASCII"),
    ("http://127.0.0.1:8791/ok/a b", "spaces"),
    ("http://127.0.0.1:8791/ok/%0d%0aHost:x", "control characters"),
    ("http:///ok/", "host"),
    ("http://169.254.169.254/latest/meta-data", "allow-list"),
]


@pytest.mark.parametrize("url,called", ALLOWED)
def test_allowed_urls_are_called_in_their_canonical_form(url, called):
    assert str(check_url(url, ALLOW)) == called


@pytest.mark.parametrize("url,words", REFUSED)
def test_refused_urls_say_why(url, words):
    with pytest.raises(UrlRefused, match=words):
        check_url(url, ALLOW)


@pytest.mark.parametrize("address,refused", [
    ("169.254.169.254", "metadata"), ("fd00:ec2::254", "metadata"), ("100.100.100.200", "metadata"),
    ("169.254.1.1", "link-local"), ("fe80::1", "link-local"), ("::ffff:169.254.169.254", "metadata"),
    ("0.0.0.0", "not a host"), ("127.0.0.1", None), ("10.1.2.3", None), ("203.0.113.9", None),
])
def test_a_host_name_never_leads_to_a_metadata_or_link_local_address(address, refused):
    url = parse_url("https://graders.example/team-a/x")
    if refused is None:
        check_address(url, ipaddress.ip_address(address))
    else:
        with pytest.raises(UrlRefused, match=refused):
            check_address(url, ipaddress.ip_address(address))


def test_a_bad_allow_list_entry_stops_the_service_naming_it(settings_factory):
    with pytest.raises(ValueError, match="GRPO_REWARD_URLS entry 'http://a@b/'.*userinfo"):
        settings_factory(GRPO_REWARD_URLS="http://ok.example/,http://a@b/")
